"""The patch strategy, rollout side."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import torch

from protocol.codec.compress import Codec
from protocol.lazy import lazy_module
from protocol.wire.framing import MessageType

from .base import ReceiverBase

if TYPE_CHECKING:
    from protocol.codec import entropy, packed

    from . import kernels
else:  # numba loads on first use (protocol/lazy.py)
    entropy, packed, kernels = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.packed"), lazy_module("receiver.kernels")


def compile_kernels() -> None:
    """Compile the decoders and the scatter kernels (or load them from numba's cache,
    which a first run on a fresh install fills: ``python -m receiver compile``)."""
    packed.warm_up()
    entropy.warm_up()
    kernels.warm_up()


class PatchReceiver(ReceiverBase):
    """Applies PATCH messages, each only on top of exactly its ``base_version``."""

    strategy = "patch"
    data_type = MessageType.PATCH

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        patch = self.config.patch
        if patch.compressor is Codec.NVCOMP_LZ4:  # decompressed where it was compressed: on the GPU
            self.device = torch.device("cuda", torch.cuda.current_device())

    async def prepare(self) -> None:
        await asyncio.to_thread(compile_kernels)  # now, not in the first patch
