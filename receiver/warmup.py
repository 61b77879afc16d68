"""Ahead-of-time compile of the receiver's numba kernels (``python -m receiver compile``):
numba compiles a kernel the first time it sees a signature, so an image build or an install
fills its cache here rather than in the first start, which would compile for tens of seconds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from protocol.lazy import lazy_module

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
