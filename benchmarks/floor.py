"""Pure reference sizes of one update: the entropy floor and RLinf's format.

Both take a tensor's old and new values at the receiver's dtype and look only at the
bits, so NaN and -0.0 count as changes exactly as the library's bitwise comparison does.

* ``entropy_floor_bits``: positions cost ``n*H(p)`` bits (``p`` the changed fraction),
  values cost ``changed * H0`` bits, ``H0`` the order-0 (empirical) entropy of the value
  change: the lower of the ulp difference (``new_bits - old_bits`` as integers) and the
  XOR of the bit patterns.
* ``seed_format_bytes``: RLinf's patch, no compression: the 2-D COO view, rows/cols
  delta-encoded as in ``protocol/codec/coo.py`` and each downscaled to the smallest unsigned
  dtype that holds its maximum, plus the raw new values at the receiver's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from protocol.codec.coo import delta_encode, split_rows_cols

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` flattened, as the same-width integer type (no copy)."""
    return t.detach().contiguous().reshape(-1).view(_BITS[t.element_size()])


def binary_entropy(p: float) -> float:
    """H(p) in bits."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def order0_entropy(symbols: torch.Tensor) -> float:
    """Empirical order-0 entropy of ``symbols`` in bits per symbol."""
    if symbols.numel() == 0:
        return 0.0
    _, counts = torch.unique(symbols.reshape(-1), return_counts=True)
    p = counts.to(torch.float64) / symbols.numel()
    return float(-(p * torch.log2(p)).sum())


def unsigned_width(top: int) -> int:
    """Bytes of the smallest unsigned dtype holding ``top`` (uint8/16/32/64)."""
    for width in (1, 2, 4, 8):
        if top < 1 << (8 * width):
            return width
    raise ValueError(f"{top} does not fit in 64 bits")


@dataclass
class TensorChange:
    """One tensor's update at the receiver's dtype."""

    shape: tuple[int, ...]
    itemsize: int
    flat: torch.Tensor  # sorted int64 flat indices of changed elements
    ulp: torch.Tensor  # new_bits - old_bits (int64) at ``flat``
    xor: torch.Tensor  # new_bits ^ old_bits at ``flat``

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def changed(self) -> int:
        return self.flat.numel()


def tensor_change(old: torch.Tensor, new: torch.Tensor) -> TensorChange:
    """The bitwise difference of two same-shaped, same-dtype tensors."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"old {old.dtype}{list(old.shape)} and new {new.dtype}{list(new.shape)} differ")
    a, b = bits_view(old), bits_view(new)
    flat = torch.nonzero(a != b).squeeze(1)
    a, b = a[flat], b[flat]
    return TensorChange(tuple(old.shape), old.element_size(), flat, b.to(torch.int64) - a.to(torch.int64), a ^ b)


def entropy_floor_bits(change: TensorChange) -> float:
    """Positions ``n*H(p)`` plus ``changed * min(H0(ulp diff), H0(xor))`` bits."""
    n, k = change.numel, change.changed
    if k == 0:
        return 0.0
    values = min(order0_entropy(change.ulp), order0_entropy(change.xor))
    return n * binary_entropy(k / n) + k * values


def seed_format_bytes(change: TensorChange) -> int:
    """Bytes of RLinf's patch of one tensor: delta rows + delta cols + raw values."""
    k = change.changed
    if k == 0:
        return 0
    rows, cols = delta_encode(*split_rows_cols(change.flat, change.shape))
    return k * (unsigned_width(int(rows.max())) + unsigned_width(int(cols.max())) + change.itemsize)


@dataclass
class UpdateSizes:
    """Reference sizes of a whole update (all tensors)."""

    tensors: int = 0
    elements: int = 0
    changed: int = 0
    dense_bytes: int = 0
    entropy_floor_bits: float = 0.0
    seed_format_bytes: int = 0
    ulp_histogram: dict[int, int] | None = None  # |ulp| -> count, for |ulp| <= 3; larger under -1

    @property
    def entropy_floor_bytes(self) -> float:
        return self.entropy_floor_bits / 8

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    def add(self, change: TensorChange) -> None:
        self.tensors += 1
        self.elements += change.numel
        self.changed += change.changed
        self.dense_bytes += change.numel * change.itemsize
        self.entropy_floor_bits += entropy_floor_bits(change)
        self.seed_format_bytes += seed_format_bytes(change)
        hist = self.ulp_histogram if self.ulp_histogram is not None else {}
        mag = change.ulp.abs()
        for m in (1, 2, 3):
            hist[m] = hist.get(m, 0) + int((mag == m).sum())
        hist[-1] = hist.get(-1, 0) + int((mag > 3).sum())
        self.ulp_histogram = hist


def update_sizes(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> UpdateSizes:
    """Reference sizes of the update ``old`` -> ``new`` (same keys, shapes and dtypes)."""
    sizes = UpdateSizes()
    for key, t in old.items():
        sizes.add(tensor_change(t, new[key]))
    return sizes
