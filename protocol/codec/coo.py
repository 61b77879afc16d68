"""RLinf's 2-D COO view and its delta encoding of rows and cols.

Every tensor is seen as a matrix: a scalar as (1, 1), a vector as (1, N), a matrix as
is, and an N-D tensor as (shape[0], prod(shape[1:])). Changed positions, in row-major
order, become ``rows`` and ``cols``. With delta encoding, ``rows`` holds the difference
to the previous row (the first entry relative to row 0), and ``cols`` holds the
difference to the previous column while the row stays the same, or the absolute column
when a new row starts. Both are stored in the smallest unsigned dtype that fits.
"""

from __future__ import annotations

import math

import torch

from protocol.errors import ProtocolError


def coo_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, int]:
    """The (rows, cols) matrix shape a tensor of ``shape`` is viewed as."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (1, shape[0])
    return (shape[0], math.prod(shape[1:]))


def split_rows_cols(flat: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute (rows, cols) of sorted flat indices."""
    ncols = coo_shape(shape)[1]
    return flat // ncols, flat % ncols


def delta_encode(rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RLinf's delta encoding of row-major sorted (rows, cols)."""
    if rows.numel() == 0:
        return rows, cols
    drows = torch.diff(rows, prepend=rows.new_zeros(1))
    new_row = drows != 0
    new_row[0] = True
    dcols = torch.where(new_row, cols, cols - torch.cat([cols.new_zeros(1), cols[:-1]]))
    return drows, dcols


def delta_decode(drows: torch.Tensor, dcols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``delta_encode`` on int64 inputs; rejects repeated positions within a row."""
    if drows.numel() == 0:
        return drows, dcols
    rows = torch.cumsum(drows, 0)
    new_row = drows != 0
    new_row[0] = True
    if bool((dcols[~new_row] == 0).any()):
        raise ProtocolError("delta-encoded cols repeat a position")
    csum = torch.cumsum(dcols, 0)
    starts = torch.nonzero(new_row).squeeze(1)
    segment = torch.cumsum(new_row.to(torch.int64), 0) - 1
    base = (csum[starts] - dcols[starts])[segment]
    return rows, csum - base
