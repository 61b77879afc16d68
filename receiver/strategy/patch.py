"""The patch strategy, rollout side."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from protocol.codec.compress import Codec
from protocol.wire.framing import MessageType

from ..apply import warmup
from .base import ReceiverBase
from .hooks import StrategyHooks


class PatchReceiver(ReceiverBase):
    """Applies PATCH messages, each only on top of exactly its ``base_version``."""

    strategy = "patch"
    data_type = MessageType.PATCH

    def __init__(self, config: Any = None, hooks: StrategyHooks | None = None) -> None:
        super().__init__(config, hooks)
        patch = self.config.patch
        if patch.compressor is Codec.NVCOMP_LZ4:  # decompressed where it was compressed: on the GPU
            self.device = torch.device("cuda", torch.cuda.current_device())

    async def prepare(self) -> None:
        """Compile (or load) the kernels for this model's dtypes now, not in the first patch."""
        dtypes = warmup.COMMON_DTYPES if self.metadata is None else dict.fromkeys(self.metadata.dtypes)
        await asyncio.to_thread(warmup.compile_kernels, dtypes)
