"""Ahead-of-time compile of the receiver's numba kernels (``python -m receiver compile``):
numba compiles a kernel the first time it sees a signature, so an image build or an install
fills its cache here rather than in the first start, which would compile for tens of seconds.
What is compiled is the kernel modules' own table of the signatures their callers use
(``protocol/codec/aot.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from protocol.codec.aot import COMMON_DTYPES, Signature, compile_all
from protocol.lazy import lazy_module

if TYPE_CHECKING:
    from protocol.codec import entropy, packed

    from . import kernels
else:  # numba loads on first use (protocol/lazy.py)
    entropy, packed, kernels = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.packed"), lazy_module("receiver.apply.kernels")

__all__ = ["COMMON_DTYPES", "compile_kernels", "signatures"]


def signatures(dtypes: Iterable[torch.dtype]) -> list[Signature]:
    """Every kernel signature a receiver of tensors of these dtypes reaches: the decoders
    and the writes into its targets."""
    dtypes = list(dtypes)
    return [*packed.decode_signatures(dtypes), *entropy.decode_signatures(), *kernels.signatures(dtypes)]


def compile_kernels(dtypes: Iterable[torch.dtype] = COMMON_DTYPES) -> None:
    """Compile the decoders and the scatter kernels for targets of these dtypes (or load
    them from numba's cache, which a first run on a fresh install fills:
    ``python -m receiver compile``)."""
    compile_all(signatures(dtypes))
