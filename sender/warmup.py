"""Ahead-of-time compile of the sender's numba kernels (``python -m sender compile``):
numba compiles a kernel the first time it sees a signature, so an image build or an install
fills its cache here rather than beside the first receiver's bootstrap."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from protocol.lazy import lazy_module

if TYPE_CHECKING:
    from protocol.codec import entropy, packed

    from . import fastdiff
else:  # numba loads on first use (protocol/lazy.py)
    entropy, packed, fastdiff = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.packed"), lazy_module("sender.fastdiff")

# (model, receiver) dtypes ``python -m sender compile`` compiles by default: fp32 or bf16
# training, bf16 or fp32 rollouts, and int64 buffers (step counters, position ids)
COMMON_PAIRS = (
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.int64, torch.int64),
)


def compile_kernels(pairs: Iterable[tuple[torch.dtype, torch.dtype]] = COMMON_PAIRS) -> None:
    """Compile the compare kernels for these (model, receiver) dtype pairs and the
    encoders (or load them from numba's cache, which a first run on a fresh install
    fills: ``python -m sender compile``)."""
    fastdiff.warm_up(set(pairs))
    packed.warm_up()
    entropy.warm_up()
