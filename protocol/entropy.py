"""Entropy coding of patches, close to the information floor.

Positions: the gaps between changed flat indices are split Rice-style into a high part
``gap >> k``, entropy coded with rANS under its empirical distribution (a small counts
table travels along), and ``k`` low bits packed at fixed width (they are close to
uniform). Large high parts escape to a raw side buffer.

Values: the change of each element as an integer difference of its bit pattern
(``new_bits - old_bits``, wrapping at the dtype's width; +-1 for a one-ulp move),
zigzag-mapped and rANS coded under its empirical distribution; large differences are
coded as their bit length plus the bits below the leading one. Exact for every bit pattern, NaN and infinities included,
and valid only on top of exactly the base version.

rANS is ``constriction``'s (Rust, vectorized over a whole buffer). Decoders treat
every buffer as hostile: table sizes, escape counts and the decoded positions are all
checked; anything off raises ``ProtocolError``.
"""

from __future__ import annotations

import math

import constriction
import numba
import numpy as np
import torch

from .dtypes import bits_dtype
from .errors import ProtocolError

ans_model = constriction.stream.model  # a native module: its submodules are attributes, not importable
ans_stack = constriction.stream.stack

HIGH_SYMBOLS = 64  # gap high parts 0..62, 63 = escape
MAX_K = 40


# -- rANS with an empirical model ----------------------------------------------------------
def ans_encode(symbols: np.ndarray, alphabet: int) -> tuple[np.ndarray, np.ndarray]:
    """rANS words (uint32) and the counts table (uint32, trimmed) for ``symbols``."""
    counts = np.bincount(symbols, minlength=1).astype(np.uint32)
    if len(counts) > alphabet:
        raise ValueError("symbol outside the alphabet")
    coder = ans_stack.AnsCoder()
    coder.encode_reverse(symbols.astype(np.int32, copy=False), _model(counts))
    return np.array(coder.get_compressed(), dtype=np.uint32), counts  # an owned, contiguous copy


def ans_decode(words: np.ndarray, counts: np.ndarray, n: int, alphabet: int) -> np.ndarray:
    if counts.ndim != 1 or not 0 < len(counts) <= alphabet or int(counts.sum(dtype=np.uint64)) != n:
        raise ProtocolError(f"entropy model of {len(counts)} symbols does not describe {n} values")
    try:
        symbols = ans_stack.AnsCoder(np.ascontiguousarray(words, dtype=np.uint32)).decode(_model(counts), n)
    except Exception as e:  # constriction reports exhausted or inconsistent streams its own way
        raise ProtocolError(f"entropy-coded stream does not decode: {e}") from None
    if np.bincount(symbols, minlength=len(counts))[: len(counts)].tolist() != counts.tolist():
        raise ProtocolError("entropy-coded stream does not match its model")
    return symbols


def _model(counts: np.ndarray) -> object:
    # Both sides build the model from the same integer counts, so the quantized
    # probabilities (and therefore the code) are identical. A one-symbol alphabet gets
    # an unused second symbol: the coder needs two.
    probabilities = np.zeros(max(2, len(counts)))
    probabilities[: len(counts)] = counts
    return ans_model.Categorical(probabilities, perfect=False)


# -- fixed-width bit packing ------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _pack(values, width, out):
    acc = np.uint64(0)  # bits not yet written, most significant first
    held = 0
    o = 0
    mask = (np.uint64(1) << np.uint64(width)) - np.uint64(1) if width < 64 else ~np.uint64(0)
    for v in values:
        bits = np.uint64(v) & mask
        for shift in range(width - 8, -8, -8):  # at most 8 bits at a time keeps acc from overflowing
            take = 8 if shift >= 0 else 8 + shift
            chunk = (bits >> np.uint64(max(shift, 0))) & np.uint64((1 << take) - 1)
            acc = (acc << np.uint64(take)) | chunk
            held += take
            if held >= 8:
                held -= 8
                out[o] = np.uint8((acc >> np.uint64(held)) & np.uint64(0xFF))
                o += 1
    if held:
        out[o] = np.uint8((acc << np.uint64(8 - held)) & np.uint64(0xFF))


@numba.njit(cache=True, nogil=True)
def _unpack(padded, width, out):
    """Fields of up to 57 bits from a buffer with 8 bytes of zero padding at its end."""
    for i in range(out.shape[0]):
        bit = i * width
        start = bit >> 3
        window = np.uint64(0)
        for j in range(8):  # big-endian 64-bit window starting at the field's first byte
            window = (window << np.uint64(8)) | np.uint64(padded[start + j])
        window = window << np.uint64(bit & 7)
        out[i] = np.int64(window >> np.uint64(64 - width))


@numba.njit(cache=True, nogil=True)
def _unpack_wide(packed, width, out):
    bit = 0
    for i in range(out.shape[0]):
        value = np.uint64(0)
        for _ in range(width):
            value = (value << np.uint64(1)) | np.uint64((packed[bit >> 3] >> (7 - (bit & 7))) & 1)
            bit += 1
        out[i] = np.int64(value)


def warm_up() -> None:
    """Compile (or load from numba's cache) the bit-packing kernels before they are timed."""
    values = torch.arange(4, dtype=torch.int64)
    unpack_bits(pack_bits(values, 3), 3, 4)
    unpack_bits(pack_bits(values, 60), 60, 4)


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """The low ``width`` bits of each value (int64), most significant first, as bytes."""
    out = np.zeros(math.ceil(values.numel() * width / 8), dtype=np.uint8)
    if width and values.numel():
        _pack(values.contiguous().numpy(), width, out)
    return torch.from_numpy(out)


def unpack_bits(packed: torch.Tensor, width: int, n: int) -> torch.Tensor:
    if packed.dtype != torch.uint8 or packed.numel() != math.ceil(n * width / 8):
        raise ProtocolError(f"{packed.numel()} bytes of {width}-bit fields for {n} values")
    out = np.zeros(n, dtype=np.int64)
    if width and n and width <= 57:
        padded = np.zeros(packed.numel() + 8, dtype=np.uint8)
        padded[: packed.numel()] = packed.numpy()
        _unpack(padded, width, out)
    elif width and n:
        _unpack_wide(packed.contiguous().numpy(), width, out)
    return torch.from_numpy(out)


# -- positions ----------------------------------------------------------------------------
def rice_parameter(gaps: torch.Tensor) -> int:
    """The split ``k`` that minimises ``k`` low bits plus the entropy of ``gap >> k``.

    Starts from the median (robust to a few huge gaps) and tries its neighbours.
    """
    if gaps.numel() == 0:
        return 0
    gaps = gaps[:: max(1, gaps.numel() // 8192)]  # a strided sample decides as well, much cheaper
    median = float(gaps.double().median())
    start = max(0, int(math.log2(median + 1)))
    best, best_bits = 0, math.inf
    for k in range(max(0, start - 2), min(MAX_K, start + 2) + 1):
        high = gaps >> k
        escaped = int((high >= HIGH_SYMBOLS - 1).sum())
        counts = torch.bincount(high.clamp(max=HIGH_SYMBOLS - 1)).double()
        p = counts[counts > 0] / gaps.numel()
        bits = gaps.numel() * k + float(-(p * p.log2()).sum()) * gaps.numel() + 64 * escaped
        if bits < best_bits:
            best, best_bits = k, bits
    return best


def encode_gaps(gaps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy-coded gaps: ``words`` (uint32), ``low`` (uint8), ``model`` (int64: k, then
    the counts of the high parts), ``escapes`` (int64 raw gaps whose high part escaped)."""
    k = rice_parameter(gaps)
    high = gaps >> k
    escaped = high >= HIGH_SYMBOLS - 1
    symbols = torch.where(escaped, HIGH_SYMBOLS - 1, high).numpy()
    words, counts = ans_encode(symbols, HIGH_SYMBOLS)
    return {
        "words": torch.from_numpy(words),
        "low": pack_bits(gaps & ((1 << k) - 1), k),
        "model": torch.cat([torch.tensor([k]), torch.from_numpy(counts.astype(np.int64))]),
        "escapes": gaps[escaped],
    }


def decode_gaps(words: torch.Tensor, low: torch.Tensor, model: torch.Tensor, escapes: torch.Tensor, n: int) -> torch.Tensor:
    if model.dtype != torch.int64 or model.dim() != 1 or model.numel() < 2:
        raise ProtocolError("gap model is malformed")
    k = int(model[0])
    if not 0 <= k <= MAX_K:
        raise ProtocolError(f"gap parameter k={k} out of range")
    counts = model[1:].numpy()
    if (counts < 0).any():
        raise ProtocolError("negative count in the gap model")
    high = torch.from_numpy(ans_decode(_words(words), counts.astype(np.uint32), n, HIGH_SYMBOLS).astype(np.int64))
    escaped = high == HIGH_SYMBOLS - 1
    if escapes.dtype != torch.int64 or escapes.numel() != int(escaped.sum()):
        raise ProtocolError("gap escapes do not match the escape symbols")
    gaps = (high << k) | unpack_bits(low, k, n)
    gaps[escaped] = escapes
    if n and int(gaps.min()) < 0:
        raise ProtocolError("negative gap")
    return gaps


# -- values -------------------------------------------------------------------------------
def ulp_differences(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new_bits - old_bits`` wrapping at the dtype's width, as int64."""
    bits = bits_dtype(new.dtype)
    return (new.view(bits) - old.view(bits)).to(torch.int64)  # wraps in the narrow dtype


def apply_differences(old: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    bits = bits_dtype(old.dtype)
    return (old.view(bits) + diffs.to(bits)).view(old.dtype)


def encode_values(diffs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy-coded ulp differences: ``words``, ``model`` (counts) and ``extra`` bits.

    Zigzag-mapped differences below ``DIRECT`` are symbols of their own; larger ones
    are coded as their bit length (Exp-Golomb style), with the bits below the leading
    one packed per length class into ``extra``. Heavy tails stay cheap.
    """
    zigzag = (diffs << 1) ^ (diffs >> 63)  # 0, -1, 1, -2, ... -> 0, 1, 2, 3, ... (as uint64 bits)
    symbols = zigzag.clone()
    where = torch.nonzero((zigzag >= DIRECT) | (zigzag < 0)).squeeze(1)
    large = zigzag[where]
    lengths = _bit_length(large)
    symbols[where] = DIRECT + lengths - DIRECT_BITS - 1
    words, counts = ans_encode(symbols.numpy(), VALUE_SYMBOLS)
    # Group the large values by length (a stable sort keeps their order within a class),
    # then pack each class at its own width: one pass over the large values in all.
    order = torch.sort(lengths, stable=True).indices
    grouped = large[order]
    extra, start = [], 0
    for c, w in _classes(counts):
        members = grouped[start : start + int(counts[c])]
        extra.append(pack_bits(members & ((1 << (w - 1)) - 1), w - 1))
        start += members.numel()
    return {
        "words": torch.from_numpy(words),
        "model": torch.from_numpy(counts.astype(np.int64)),
        "extra": torch.cat(extra) if extra else torch.zeros(0, dtype=torch.uint8),
    }


def decode_values(words: torch.Tensor, model: torch.Tensor, extra: torch.Tensor, n: int) -> torch.Tensor:
    if model.dtype != torch.int64 or model.dim() != 1 or (model < 0).any():
        raise ProtocolError("value model is malformed")
    counts = model.numpy().astype(np.uint32)
    symbols = torch.from_numpy(ans_decode(_words(words), counts, n, VALUE_SYMBOLS).astype(np.int64))
    classes = list(_classes(counts))
    sizes = [math.ceil(int(counts[c]) * (w - 1) / 8) for c, w in classes]
    if extra.dtype != torch.uint8 or extra.numel() != sum(sizes):
        raise ProtocolError(f"value extra bits: {extra.numel()} bytes, the model needs {sum(sizes)}")
    zigzag = symbols.clone()
    where = torch.nonzero(symbols >= DIRECT).squeeze(1)
    order = torch.sort(symbols[where], stable=True).indices  # the encoder's grouping by class
    grouped = torch.empty(where.numel(), dtype=torch.int64)
    start = byte = 0
    for (c, w), size in zip(classes, sizes):
        n_c = int(counts[c])
        low = unpack_bits(extra[byte : byte + size], w - 1, n_c)
        grouped[start : start + n_c] = (1 << (w - 1)) | low  # for w == 64 the leading one is the sign bit
        start += n_c
        byte += size
    large = torch.empty_like(grouped)
    large[order] = grouped
    zigzag[where] = large
    return ((zigzag >> 1) & _INT64_MAX) ^ -(zigzag & 1)


DIRECT_BITS = 4  # zigzag values below 16 are their own symbols
DIRECT = 1 << DIRECT_BITS
VALUE_SYMBOLS = DIRECT + 64 - DIRECT_BITS  # then one symbol per bit length 5..64
_INT64_MAX = (1 << 63) - 1


def _bit_length(z: torch.Tensor) -> torch.Tensor:
    """Exact bit length of int64 values read as uint64 (64 for the ones with the top bit set)."""
    # frexp is exact below 2**53; the rare larger values are counted bit by bit.
    length = torch.frexp(z.clamp(min=0).double())[1].to(torch.int64)
    wide = (z >= 1 << 52) | (z < 0)
    if bool(wide.any()):
        big = z[wide]
        exact = sum(((big >> k) != 0).to(torch.int64) for k in range(63))
        length[wide] = torch.where(big < 0, 64, exact)
    return length


def _classes(counts: np.ndarray) -> list[tuple[int, int]]:
    """(symbol, bit length) of each length class present in a counts table."""
    return [(c, c - DIRECT + DIRECT_BITS + 1) for c in range(DIRECT, len(counts)) if counts[c]]


def _words(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.uint32 or t.dim() != 1:
        raise ProtocolError("entropy-coded stream must be a 1-D uint32 buffer")
    return t.numpy()
