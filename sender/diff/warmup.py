"""Ahead-of-time compile of the sender's numba kernels (``python -m sender compile``):
numba compiles a kernel the first time it sees a signature, so an image build or an install
fills its cache here rather than beside the first receiver's bootstrap. What is compiled is
the kernel modules' own table of the signatures their callers use (``protocol/codec/aot.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from protocol.codec.aot import COMMON_DTYPES, COMMON_PAIRS, Pair, Signature, compile_all, receiver_dtypes
from protocol.lazy import lazy_module

if TYPE_CHECKING:
    from protocol.codec import entropy, packed

    from . import fastdiff
else:  # numba loads on first use (protocol/lazy.py)
    entropy, packed, fastdiff = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.packed"), lazy_module("sender.diff.fastdiff")

__all__ = ["COMMON_PAIRS", "compile_encoders", "compile_kernels", "encode_signatures", "signatures"]


def encode_signatures(dtypes: Iterable[torch.dtype]) -> list[Signature]:
    """The host encoder's kernels for changes of these (receiver) dtypes."""
    return [*packed.encode_signatures(dtypes), *entropy.encode_signatures()]


def signatures(pairs: Iterable[Pair]) -> list[Signature]:
    """Every kernel signature the sender reaches for these (model, receiver) dtype pairs:
    the compare's and the encoder's."""
    pairs = list(pairs)
    return [*fastdiff.signatures(pairs), *encode_signatures(receiver_dtypes(pairs))]


def compile_kernels(pairs: Iterable[Pair] = COMMON_PAIRS) -> None:
    """Compile the compare kernels and the encoders for these (model, receiver) dtype pairs
    (or load them from numba's cache, which a first run on a fresh install fills:
    ``python -m sender compile``)."""
    compile_all(signatures(pairs))


def compile_encoders(dtypes: Iterable[torch.dtype] = COMMON_DTYPES) -> None:
    """Compile (or load) the host encoder's kernels for changes of these (receiver) dtypes."""
    compile_all(encode_signatures(dtypes))
