"""Encodings of a tensor's changed positions: RLinf's COO (plain or delta), flat-index
gaps (raw or entropy coded) and a bitmap.

Encoders take sorted int32 or int64 flat indices and return index tensors downscaled to the
smallest unsigned dtype. Decoders take untrusted buffers and return sorted, unique,
in-bounds int64 flat indices, or raise ``ProtocolError``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from protocol.codec.coo import coo_shape, delta_decode, delta_encode, split_rows_cols
from protocol.errors import ConfigError, ProtocolError
from protocol.lazy import lazy_module
from protocol.wire.dtypes import smallest_unsigned
from protocol.wire.framing import Encoding, Role

if TYPE_CHECKING:
    from protocol.codec import entropy, packed
else:  # numba loads on first use (protocol/lazy.py)
    entropy, packed = lazy_module("protocol.codec.entropy"), lazy_module("protocol.codec.packed")

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def downscale(t: torch.Tensor, top: int | None = None) -> torch.Tensor:
    """``t`` (non-negative int64) in the smallest unsigned dtype that holds its maximum ``top``."""
    if top is None:
        top = int(t.max()) if t.numel() else 0
    return t.to(smallest_unsigned(top))


def encode_positions(flat: torch.Tensor, shape: tuple[int, ...], encoding: Encoding) -> dict[Role, torch.Tensor]:
    """Index buffers for sorted unique int64 ``flat`` indices of a tensor of ``shape``."""
    if encoding in (Encoding.COO, Encoding.COO_DELTA):
        rows, cols = split_rows_cols(flat, shape)
        if encoding is Encoding.COO_DELTA:
            rows, cols = delta_encode(rows, cols)
        return {Role.ROWS: downscale(rows), Role.COLS: downscale(cols)}
    if encoding is Encoding.GAPS:
        return {Role.POSITIONS: downscale(*gaps_and_top(flat))}
    if encoding is Encoding.ANS_GAPS:
        coded = entropy.encode_gaps(gaps_of(flat).cpu())
        return {
            Role.POSITIONS: coded["words"],
            Role.LOW_BITS: coded["low"],
            Role.POSITION_MODEL: coded["model"],
            Role.POSITION_ESCAPES: coded["escapes"],
        }
    if encoding is Encoding.BITMAP:
        numel = math.prod(shape)
        mask = torch.zeros(math.ceil(numel / 8) * 8, dtype=torch.uint8, device=flat.device)
        mask[flat] = 1
        packed = (mask.view(-1, 8) * _BIT_WEIGHTS.to(flat.device)).sum(1, dtype=torch.uint8)
        return {Role.POSITIONS: packed}
    raise ConfigError(f"{encoding!r} has no positions")


def gaps_of(flat: torch.Tensor) -> torch.Tensor:
    """Zero-run lengths before each of the sorted flat indices."""
    return torch.diff(flat, prepend=flat.new_full((1,), -1)) - 1


def gaps_and_top(flat: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``gaps_of(flat)`` and its largest gap (0 if none): one numba pass on the host
    (~1 us, where the torch ops cost ~5 us each on a small tensor), torch elsewhere."""
    if flat.device.type == "cpu":
        gaps, top = packed.gaps_and_top(flat.contiguous().numpy())
        return torch.from_numpy(gaps), int(top)
    gaps = gaps_of(flat)
    return gaps, int(gaps.max()) if gaps.numel() else 0


def positions_nbytes(nnz: int, numel: int, encoding: Encoding, max_gap: int) -> int:
    """Uncompressed bytes of the positions, to choose between GAPS and BITMAP cheaply."""
    if encoding is Encoding.BITMAP:
        return math.ceil(numel / 8)
    return nnz * smallest_unsigned(max_gap).itemsize


def decode_positions(buffers: dict[Role, torch.Tensor], shape: tuple[int, ...], encoding: Encoding, nnz: int) -> torch.Tensor:
    """Validated sorted unique int64 flat indices from untrusted index buffers."""
    numel = math.prod(shape)
    if encoding in (Encoding.COO, Encoding.COO_DELTA):
        rows, cols = buffers[Role.ROWS], buffers[Role.COLS]
        if rows.dim() != 1 or cols.dim() != 1 or rows.numel() != nnz or cols.numel() != nnz:
            raise ProtocolError(f"rows/cols hold {rows.numel()}/{cols.numel()} entries, expected {nnz}")
        rows, cols = _as_int64(rows), _as_int64(cols)
        nrows, ncols = coo_shape(shape)
        # Bound every entry first, so the int64 sums of delta decoding cannot overflow.
        if nnz and (int(rows.max()) >= nrows or int(cols.max()) >= ncols):
            raise ProtocolError(f"position out of bounds for a {nrows}x{ncols} view")
        if encoding is Encoding.COO_DELTA:
            rows, cols = delta_decode(rows, cols)
        if nnz and (int(rows.max()) >= nrows or int(cols.max()) >= ncols):
            raise ProtocolError(f"position out of bounds for a {nrows}x{ncols} view")
        flat = rows * ncols + cols
        if nnz > 1 and not bool((torch.diff(flat) > 0).all()):
            raise ProtocolError("positions are not strictly increasing")
        return flat
    if encoding in (Encoding.GAPS, Encoding.ANS_GAPS):
        if encoding is Encoding.ANS_GAPS:
            gaps = entropy.decode_gaps(
                buffers[Role.POSITIONS], buffers[Role.LOW_BITS], buffers[Role.POSITION_MODEL], buffers[Role.POSITION_ESCAPES], nnz
            )
        else:
            gaps = buffers[Role.POSITIONS]
            if gaps.dim() != 1 or gaps.numel() != nnz:
                raise ProtocolError(f"gaps hold {gaps.numel()} entries, expected {nnz}")
            if gaps.device.type == "cpu":
                return _positions_on_host(gaps, numel)
            gaps = _as_int64(gaps)
        if nnz and int(gaps.max()) >= numel:  # also bounds the cumsum below against overflow
            raise ProtocolError("gap larger than the tensor")
        flat = torch.cumsum(gaps + 1, 0) - 1
        if nnz and int(flat[-1]) >= numel:
            raise ProtocolError(f"position {int(flat[-1])} out of bounds for {numel} elements")
        return flat
    if encoding is Encoding.BITMAP:
        packed = buffers[Role.POSITIONS]
        if packed.dtype != torch.uint8 or packed.dim() != 1 or packed.numel() != math.ceil(numel / 8):
            raise ProtocolError(f"bitmap of {packed.numel()} bytes for {numel} elements")
        bits = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)).ne(0).reshape(-1)
        if bool(bits[numel:].any()):
            raise ProtocolError("bitmap has bits set past the tensor's end")
        flat = torch.nonzero(bits[:numel]).squeeze(1)
        if flat.numel() != nnz:
            raise ProtocolError(f"bitmap marks {flat.numel()} positions, header says {nnz}")
        return flat
    raise ProtocolError(f"{encoding!r} has no positions")


def _positions_on_host(gaps: torch.Tensor, numel: int) -> torch.Tensor:
    """Positions from untrusted unsigned host ``gaps`` in one numba pass (the torch path
    below makes five, ~10 us on a small tensor)."""
    if gaps.dtype not in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        raise ProtocolError(f"index buffer has dtype {gaps.dtype}, expected an unsigned integer")
    flat = torch.empty(gaps.numel(), dtype=torch.int64)
    if not packed.positions_into(gaps.contiguous().numpy(), numel, flat.numpy()):
        raise ProtocolError(f"gaps run past the tensor's {numel} elements")
    return flat


def _as_int64(t: torch.Tensor) -> torch.Tensor:
    """An unsigned index buffer as int64 (CPU torch lacks most ops on uint16/32/64)."""
    if t.dtype not in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        raise ProtocolError(f"index buffer has dtype {t.dtype}, expected an unsigned integer")
    if t.dtype == torch.uint64:
        signed = t.view(torch.int64)
        if t.numel() and int(signed.min()) < 0:
            raise ProtocolError("index does not fit in int64")
        return signed
    return t.to(torch.int64)
