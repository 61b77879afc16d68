"""One buffer per entropy-coded tensor: ANS_GAPS positions and ULP values, fused (it
travels as the entry's one VALUES buffer, uint8, uncompressed).

The multi-buffer layout (a words, low-bits, model and escapes buffer for the positions, and
three more for the values) cost tens of microseconds a tensor in Python around the kernels:
seven buffers packed, checksummed, described and checked on each side. Here one numba call
encodes a tensor's changes into one uint8 buffer and one call decodes it, checking every
size against the buffer and the target before reading. The symbol coding is ``entropy``'s
(Rice split of the gaps, zigzagged ulp differences by bit length) and the coder ``rans``'s;
the side tables travel as their quantized frequencies (16 bits a symbol), not as int64
counts. Layout (little-endian; ``docs/wire.md``)::

    0   u8   k, the Rice parameter (0..entropy.MAX_K)
    1   u8   gap symbols G (1..entropy.HIGH_SYMBOLS)
    2   u8   value symbols V (1..entropy.VALUE_SYMBOLS)
    3   u8   0 (reserved)
    4   u64  escapes E      12  u64  gap words Wg      20  u64  value words Wv
    28  u16 x G  gap frequencies      then u16 x V  value frequencies (each table sums to 2**15)
        u16 x Wg  gap stream          then u16 x Wv  value stream (rANS, ``rans.decode_into``)
        i64 x E   escaped gaps        then ceil(nnz * k / 8) bytes of gap low bits
        the rest: the extra bits of large value differences (all of them, exactly)
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from protocol.codec import entropy, rans
from protocol.codec.entropy import ESCAPE, HIGH_SYMBOLS, MAX_K, VALUE_SYMBOLS
from protocol.codec.rans import FLUSH_WORDS, PROB_SCALE
from protocol.errors import ProtocolError
from protocol.wire.dtypes import bits_dtype

HEADER = 28
_bits_of = functools.cache(bits_dtype)  # wire.dtypes.bits_dtype builds a tensor (~1.3 us)
TABLE_START = HEADER

# Decoder error codes (0 is success); a stream's own codes (rans.ERRORS) come offset by 10
# (gaps) or 20 (values).
ERRORS = {
    1: "shorter than its header",
    2: "header fields out of range",
    3: "sizes in the header exceed the tensor's changes or the buffer",
    4: "a frequency table does not sum to the coder's scale",
    5: "escaped gaps do not match the escape symbols",
    6: "positions run past the tensor's end (or a gap is negative)",
    7: "extra bits of the values do not fill their section exactly",
}
_GAP_STREAM, _VALUE_STREAM = 10, 20


def max_nbytes(nnz: int) -> int:
    """The largest buffer ``nnz`` changes can need (bounds an untrusted spec before decoding)."""
    words = 2 * (2 * (nnz + FLUSH_WORDS))
    return HEADER + 2 * (HIGH_SYMBOLS + VALUE_SYMBOLS) + words + 8 * nnz + -(-nnz * MAX_K // 8) + -(-nnz * 63 // 8)


def encode(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The packed buffer (uint8, host) of changes at sorted int64 ``flat`` from ``old`` to ``new``."""
    bits = _bits_of(new.dtype)
    shift = 64 - 8 * new.element_size()
    return torch.from_numpy(_encode(_host(flat), _host(new.view(bits)), _host(old.view(bits)), shift))


def decode(buf: np.ndarray, nnz: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions and int64 ulp differences of ``nnz`` changes to a tensor of
    ``numel`` elements, from an untrusted packed buffer; ``ProtocolError`` if it is off."""
    flat = np.empty(nnz, dtype=np.int64)
    diffs = np.empty(nnz, dtype=np.int64)
    code = _decode(buf, numel, flat, diffs)
    if code:
        raise ProtocolError(f"packed entry: {_message(code)}")
    return torch.from_numpy(flat), torch.from_numpy(diffs)


def _message(code: int) -> str:
    if code >= _VALUE_STREAM:
        return f"value stream: {rans.ERRORS[_VALUE_STREAM - code]}"
    if code >= _GAP_STREAM:
        return f"gap stream: {rans.ERRORS[_GAP_STREAM - code]}"
    return ERRORS[code]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels for the common dtypes."""
    flat = torch.arange(0, 4000, 3)
    for dtype in (torch.bfloat16, torch.float32):
        old = torch.zeros(flat.numel(), dtype=dtype)
        buf = encode(flat, old + 1, old).numpy()
        decode(buf, flat.numel(), 4000)
    for gaps in (np.zeros(1, dtype=np.uint8), np.zeros(1, dtype=np.uint16), np.zeros(1, dtype=np.uint32)):
        positions_into(gaps, 4, np.empty(1, dtype=np.int64))  # raw GAPS entries (positions.decode_positions)


# -- kernels --------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def gaps_and_top(flat):  # pragma: no cover - numba
    """Zero-run lengths before each sorted flat index, and the largest (0 if none)."""
    gaps = np.empty(flat.shape[0], dtype=np.int64)
    prev, top = -1, 0
    for i in range(flat.shape[0]):
        gaps[i] = flat[i] - prev - 1
        top = max(top, gaps[i])
        prev = flat[i]
    return gaps, top


@numba.njit(cache=True, nogil=True)
def _differences(new, old, shift):  # pragma: no cover - numba
    """``new - old`` of bit patterns, wrapped at their width (64 - ``shift`` bits), as int64."""
    out = np.empty(new.shape[0], dtype=np.int64)
    for i in range(new.shape[0]):
        d = np.int64(new[i]) - np.int64(old[i])
        out[i] = (d << shift) >> shift
    return out


@numba.njit(cache=True, nogil=True)
def _used(counts):  # pragma: no cover - numba
    """Symbols up to the last counted one (at least one)."""
    n = counts.shape[0]
    while n > 1 and counts[n - 1] == 0:
        n -= 1
    return n


@numba.njit(cache=True, nogil=True)
def _code(symbols, counts, out, at):  # pragma: no cover - numba
    """rANS-code ``symbols`` under ``counts``; writes the frequency table at ``at`` and
    returns it with the words (the stream itself is copied in by the caller)."""
    freq = rans.quantize_into(counts)
    cum = np.zeros(freq.shape[0], dtype=np.uint32)
    for s in range(1, freq.shape[0]):
        cum[s] = cum[s - 1] + freq[s - 1]
    scratch = np.empty(symbols.shape[0] + FLUSH_WORDS, dtype=np.uint16)
    start = rans.encode_into(symbols, freq, cum, scratch)
    out[at : at + 2 * freq.shape[0]].view(np.uint16)[:] = freq
    return scratch[start:]


@numba.njit(cache=True, nogil=True)
def _put_u64(out, at, value):  # pragma: no cover - numba
    out[at : at + 8].view(np.uint64)[0] = np.uint64(value)


@numba.njit(cache=True, nogil=True)
def _encode(flat, new, old, shift):  # pragma: no cover - numba
    n = flat.shape[0]
    gaps, _ = gaps_and_top(flat)
    k = entropy._choose_k(gaps, max(1, n // entropy.RICE_SAMPLE))
    gap_symbols = np.empty(n, dtype=np.uint8)
    low = np.zeros((n * k + 7) // 8, dtype=np.uint8)
    gap_counts = np.zeros(HIGH_SYMBOLS, dtype=np.int64)
    escapes = entropy._split_gaps(gaps, k, gap_symbols, low, gap_counts)
    diffs = _differences(new, old, shift)
    value_symbols = np.empty(n, dtype=np.uint8)
    value_counts = np.zeros(VALUE_SYMBOLS, dtype=np.int64)
    extra = np.zeros((entropy._value_symbols(diffs, value_symbols, value_counts) + 7) // 8, dtype=np.uint8)
    entropy._value_extra(diffs, value_symbols, extra)
    g, v = _used(gap_counts), _used(value_counts)
    tables = np.empty(2 * (g + v), dtype=np.uint8)
    gap_words = _code(gap_symbols, gap_counts[:g], tables, 0)
    value_words = _code(value_symbols, value_counts[:v], tables, 2 * g)
    words_at = TABLE_START + tables.shape[0]
    escapes_at = words_at + 2 * (gap_words.shape[0] + value_words.shape[0])
    low_at = escapes_at + 8 * escapes
    out = np.empty(low_at + low.shape[0] + extra.shape[0], dtype=np.uint8)
    out[0], out[1], out[2], out[3] = k, g, v, 0
    _put_u64(out, 4, escapes)
    _put_u64(out, 12, gap_words.shape[0])
    _put_u64(out, 20, value_words.shape[0])
    out[TABLE_START:words_at] = tables
    value_at = words_at + 2 * gap_words.shape[0]
    out[words_at:value_at].view(np.uint16)[:] = gap_words
    out[value_at:escapes_at].view(np.uint16)[:] = value_words
    escaped = out[escapes_at:low_at].view(np.int64)
    e = 0
    for i in range(n):
        if gap_symbols[i] == ESCAPE:
            escaped[e] = gaps[i]
            e += 1
    out[low_at : low_at + low.shape[0]] = low
    out[low_at + low.shape[0] :] = extra
    return out


@numba.njit(cache=True, nogil=True)
def _tables(freq):  # pragma: no cover - numba
    """(cum, lut) of an untrusted u16 frequency table, or a zero-length lut if it does not
    sum to ``PROB_SCALE`` (the lut then covers every slot with a symbol of the table)."""
    cum = np.zeros(freq.shape[0], dtype=np.uint32)
    total = 0
    for s in range(freq.shape[0]):
        cum[s] = total
        total += freq[s]
    if total != PROB_SCALE:
        return cum, np.empty(0, dtype=np.uint8)
    lut = np.empty(PROB_SCALE, dtype=np.uint8)
    for s in range(freq.shape[0]):
        lut[cum[s] : cum[s] + freq[s]] = s
    return cum, lut


@numba.njit(cache=True, nogil=True)
def positions_into(gaps, numel, out):  # pragma: no cover - numba
    """Positions from untrusted zero-run ``gaps`` (any integer dtype) into int64 ``out``, which
    may be ``gaps`` itself; False if a gap is negative (uint64 past int64 reads as one) or a
    position reaches ``numel``."""
    pos = -1
    for i in range(gaps.shape[0]):
        g = np.int64(gaps[i])
        if g < 0 or g >= numel:  # also keeps pos + g + 1 from overflowing
            return False
        pos += g + 1
        if pos >= numel:
            return False
        out[i] = pos
    return True


@numba.njit(cache=True, nogil=True)
def _decode(buf, numel, flat, diffs):  # pragma: no cover - numba
    """Decode into ``flat`` and ``diffs`` (their length is the change count); an error code."""
    n = flat.shape[0]
    size = buf.shape[0]
    if size < HEADER:
        return 1
    k, g, v = np.int64(buf[0]), np.int64(buf[1]), np.int64(buf[2])
    if k > MAX_K or not 1 <= g <= HIGH_SYMBOLS or not 1 <= v <= VALUE_SYMBOLS or buf[3] != 0:
        return 2
    fields = buf[4:HEADER].view(np.uint64)
    limit = np.uint64(n + FLUSH_WORDS)
    if fields[0] > np.uint64(n) or fields[1] > limit or fields[2] > limit:  # unsigned: no wrap below
        return 3
    escapes, gap_words, value_words = np.int64(fields[0]), np.int64(fields[1]), np.int64(fields[2])
    words_at = TABLE_START + 2 * (g + v)
    value_at = words_at + 2 * gap_words
    escapes_at = value_at + 2 * value_words
    low_at = escapes_at + 8 * escapes
    extra_at = low_at + (n * k + 7) // 8
    if extra_at > size:
        return 3
    gap_freq = buf[TABLE_START : TABLE_START + 2 * g].view(np.uint16).astype(np.uint32)
    value_freq = buf[TABLE_START + 2 * g : words_at].view(np.uint16).astype(np.uint32)
    gap_cum, gap_lut = _tables(gap_freq)
    value_cum, value_lut = _tables(value_freq)
    if gap_lut.shape[0] == 0 or value_lut.shape[0] == 0:
        return 4
    symbols = np.empty(n, dtype=np.uint8)
    code = rans.decode_into(buf[words_at:value_at].view(np.uint16), gap_freq, gap_cum, gap_lut, symbols)
    if code:
        return _GAP_STREAM - code
    if not entropy._join_gaps(symbols, k, buf[low_at:extra_at], buf[escapes_at:low_at].view(np.int64), flat):
        return 5
    if not positions_into(flat, numel, flat):
        return 6
    code = rans.decode_into(buf[value_at:escapes_at].view(np.uint16), value_freq, value_cum, value_lut, symbols)
    if code:
        return _VALUE_STREAM - code
    if (entropy._unzigzag(symbols, buf[extra_at:], diffs) + 7) // 8 != size - extra_at:
        return 7
    return 0
