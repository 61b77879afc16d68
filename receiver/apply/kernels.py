"""numba kernels for sparse updates of CPU tensors: gather-and-add of ulp differences
and the scatter that writes a version. torch's indexing costs tens of ns an element
here; these walk the sorted indices once and release the GIL. Other devices, layouts
and dtypes use torch indexing (``supported`` says which)."""

from __future__ import annotations

from collections.abc import Iterable

import numba
import numpy as np
import torch

from protocol.codec.aot import Signature, array

_SIGNED = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@numba.njit(cache=True, nogil=True)
def _gather_add(target, flat, diffs, out):  # pragma: no cover - numba
    for o in range(flat.shape[0]):
        # int64 diffs, added at 64 bits and truncated to the target's width on the store:
        # the same bits as the encoder's wrapping difference, without a narrowing pass first
        out[o] = target[flat[o]] + diffs[o]


@numba.njit(cache=True, nogil=True)
def _scatter(target, flat, values):  # pragma: no cover - numba
    for o in range(flat.shape[0]):
        target[flat[o]] = values[o]


def supported(target: torch.Tensor) -> bool:
    return target.device.type == "cpu" and target.is_contiguous() and target.element_size() in _SIGNED and not target.dtype.is_complex


_NP_SIGNED = {2: np.int16, 4: np.int32, 8: np.int64}


def _bits(t: torch.Tensor) -> np.ndarray:
    """The bits of contiguous ``t`` as a flat signed numpy array (a view; numpy's reshape is the cheap one)."""
    return t.view(_SIGNED[t.element_size()]).numpy().reshape(-1)


def gather_add(target: torch.Tensor, flat: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    """``target``'s elements at ``flat`` with ``diffs`` added to their bit patterns (a new tensor)."""
    size = target.element_size()
    out = np.empty(flat.numel(), dtype=_NP_SIGNED[size])
    _gather_add(_bits(target), flat.numpy(), diffs.to(torch.int64).numpy(), out)  # one signature a width (``signatures``)
    return torch.from_numpy(out).view(target.dtype)


def scatter(target: torch.Tensor, flat: torch.Tensor, values: torch.Tensor) -> None:
    """``target.view(-1)[flat] = values``, for in-bounds ``flat`` (already validated)."""
    _scatter(_bits(target), flat.numpy(), _bits(values.contiguous()))


def signatures(dtypes: Iterable[torch.dtype]) -> list[Signature]:
    """What ``gather_add`` and ``scatter`` hand the kernels for targets of ``dtypes`` (those
    ``supported``; ``protocol/codec/aot.py``): their bits, int64 positions and differences."""
    int64 = array(np.int64)
    rows = []
    for size in dict.fromkeys(d.itemsize for d in dtypes if supported(torch.empty(0, dtype=d))):
        bits = array(_NP_SIGNED[size])
        rows += [Signature(_gather_add, (bits, int64, int64, bits)), Signature(_scatter, (bits, int64, bits))]
    return rows
