"""One buffer per entropy-coded tensor: ANS_GAPS positions and ULP values, fused (it
travels as the entry's one VALUES buffer, uint8, uncompressed).

The multi-buffer layout (a words, low-bits, model and escapes buffer for the positions, and
three more for the values) cost tens of microseconds a tensor in Python around the kernels:
seven buffers packed, checksummed, described and checked on each side. Here one numba call
encodes a tensor's changes into one uint8 buffer and one call decodes it, checking every
size against the buffer and the target before reading. The symbol coding is ``entropy``'s
(Rice split of the gaps, zigzagged ulp differences by bit length) and the coder ``rans``'s;
the side tables travel as the symbol counts (each in as many bits as the changes left to
count need; the coder's frequencies are derived from them on both sides by ``rans.quantize_into``),
and every size the counts imply (escapes, low bits, extra bits, the value stream) is left out.
Layout (little-endian; ``docs/wire.md``)::

    0   u8   k, the Rice parameter (0..entropy.MAX_K)
    1   u8   gap symbols G (1..entropy.HIGH_SYMBOLS)
    2   u8   value symbols V (1..entropy.VALUE_SYMBOLS)
    3   LEB128  gap words Wg (at most 10 bytes)
        counts: G - 1 gap counts then V - 1 value counts, a bit field each, most significant bit
        first (the last count of each table is what is left of nnz), zero bits to the byte's end;
        then a zero byte if the streams would start at an odd offset
        u16 x Wg  gap stream          then u16 x Wv  value stream (rANS, ``rans.decode_into``)
        i64 x E   escaped gaps (E: the escape symbol's count)
        ceil(nnz * k / 8) bytes of gap low bits
        ceil(X / 8) bytes: the extra bits of large value differences (X: from the value counts)
    Wv is what the buffer leaves for the value stream.

A count ``c`` of ``r`` changes still to count is coded as its bit length ``L`` in
``bit_length(bit_length(r))`` bits, then the ``L - 1`` bits below its leading one: tables cost
~3 bits a symbol, where 16-bit frequencies cost 16 (the real lr 1e-6 workload of
``python -m benchmarks --suite quick``: 4.8 kB of tables in a 230 kB patch -> 1.8 kB).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import numba
import numpy as np
import torch

from protocol.codec import entropy, rans
from protocol.codec.aot import Signature, array, scalar
from protocol.codec.entropy import DIRECT, DIRECT_BITS, ESCAPE, HIGH_SYMBOLS, MAX_K, VALUE_SYMBOLS
from protocol.codec.rans import FLUSH_WORDS, PROB_SCALE
from protocol.errors import ProtocolError
from protocol.wire.dtypes import bits_dtype

FIXED = 3  # k, G, V; then the gap words' LEB128
VARINT_MAX = 10  # LEB128 bytes of a u64
COUNT_BITS_MAX = 6 + 62  # a count's length field and mantissa, counts below 2**63
TABLES_MAX = -(-(HIGH_SYMBOLS + VALUE_SYMBOLS) * COUNT_BITS_MAX // 8) + 1  # with the pad byte
_bits_of = functools.cache(bits_dtype)  # wire.dtypes.bits_dtype builds a tensor (~1.3 us)
_NO_BASE = np.empty(0, dtype=np.int64)  # decode: differences, not values
# From this share of changed elements decode_onto adds each difference to the target as it
# decodes it; below, in a pass of its own after, whose loads do not wait on the decoding's
# chain and so overlap their cache misses. ns a change on a 16 MB bf16 tensor (python -m
# benchmarks.micro --only onto): at 1% fused 9.8, after 7.0; at 3% 8.0 and 10.1; at 10% 7.3 and 7.9.
# A receiver's target is mostly out of cache when a patch arrives: eight 16 MB tensors read
# cold, fused against after, at 2% 20.7 and 13.3 ns, at 2.5% 11.6 and 12.2, at 5% 6.9 and 8.6;
# the real full-suite lr 1e-6 step's tensors (1.7-30% changed) decode in 9.5 ns a change
# from 3%, 10.5 from 2%.
FUSED_FROM = 0.03
COUNT_LANES = 4  # interleaved count tables in the encoder (a power of two)

# Decoder error codes (0 is success); a stream's own codes (rans.ERRORS) come offset by 10
# (gaps) or 20 (values).
ERRORS = {
    1: "shorter than its header",
    2: "header fields out of range",
    3: "sizes in the header exceed the tensor's changes or the buffer",
    4: "a counts table does not describe the tensor's changes",
    5: "escaped gaps do not match the escape symbols",
    6: "positions run past the tensor's end (or a gap is negative)",
    7: "extra bits of the values do not fill their section exactly",
}
_GAP_STREAM, _VALUE_STREAM = 10, 20


def max_nbytes(nnz: int) -> int:
    """The largest buffer ``nnz`` changes can need (bounds an untrusted spec before decoding)."""
    words = 2 * (2 * (nnz + FLUSH_WORDS))
    return FIXED + VARINT_MAX + TABLES_MAX + words + 8 * nnz + -(-nnz * MAX_K // 8) + -(-nnz * 63 // 8)


def encode(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """The packed buffer (uint8, host) of changes at sorted ``flat`` (int32 or int64) from ``old`` to ``new``."""
    bits = _bits_of(new.dtype)
    shift = 64 - 8 * new.element_size()
    return torch.from_numpy(_encode(_host(flat), _host(new.view(bits)), _host(old.view(bits)), shift))


def decode(buf: np.ndarray, nnz: int, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions and int64 ulp differences of ``nnz`` changes to a tensor of
    ``numel`` elements, from an untrusted packed buffer; ``ProtocolError`` if it is off."""
    flat = np.empty(nnz, dtype=np.int64)
    diffs = np.empty(nnz, dtype=np.int64)
    _check(_decode(_frozen(buf), numel, _NO_BASE, False, flat, diffs))
    return torch.from_numpy(flat), torch.from_numpy(diffs)


def decodes_onto(base: torch.Tensor) -> bool:
    """Whether ``decode_onto`` takes ``base``: a contiguous host tensor of 2, 4 or 8-byte
    elements (not complex)."""
    return base.device.type == "cpu" and base.is_contiguous() and base.element_size() in (2, 4, 8) and not base.dtype.is_complex


def decode_onto(buf: np.ndarray, nnz: int, base: torch.Tensor, *, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted flat positions and the new values of ``nnz`` changes to ``base`` (its values
    now, only read; ``decodes_onto``), from an untrusted packed buffer: ``decode`` and
    ``entropy.apply_differences`` in one call. ``fused``: add each difference as it
    decodes, or in a pass after (None: by ``FUSED_FROM``). ``ProtocolError`` if the buffer is off."""
    bits = base.view(_bits_of(base.dtype)).numpy().reshape(-1)
    if fused is None:
        fused = nnz >= FUSED_FROM * bits.shape[0]
    flat = np.empty(nnz, dtype=np.int64)
    values = np.empty(nnz, dtype=bits.dtype)
    _check(_decode(_frozen(buf), bits.shape[0], bits, fused, flat, values))
    return torch.from_numpy(flat), torch.from_numpy(values).view(base.dtype)


def _check(code: int) -> None:
    if code:
        raise ProtocolError(f"packed entry: {_message(code)}")


def layout(buf: np.ndarray, nnz: int) -> dict[str, int]:
    """The header's fields and each section's offset of a packed buffer of ``nnz`` changes
    (what its bytes are spent on, for tests and measurements); ``ProtocolError`` if it is off."""
    at = _layout(_frozen(buf), nnz, np.zeros(HIGH_SYMBOLS, dtype=np.int64), np.zeros(VALUE_SYMBOLS, dtype=np.int64))
    if at[_CODE]:
        raise ProtocolError(f"packed entry: {_message(int(at[_CODE]))}")
    names = ("k", "G", "V", "gap_words", "value_words", "escapes", "tables_at", "words_at", "value_at", "escapes_at", "low_at", "extra_at")
    return {name: int(at[i]) for i, name in enumerate(names, start=_K)}


def _message(code: int) -> str:
    if code >= _VALUE_STREAM:
        return f"value stream: {rans.ERRORS[_VALUE_STREAM - code]}"
    if code >= _GAP_STREAM:
        return f"gap stream: {rans.ERRORS[_GAP_STREAM - code]}"
    return ERRORS[code]


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().numpy()


# -- the kernels' signatures (protocol/codec/aot.py) ----------------------------------------
POSITIONS = (torch.int32, torch.int64)  # what ``encode`` and ``gaps_and_top`` are given (fastdiff.position_dtype, or torch's)
GAPS = (torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int64)  # raw GAPS buffers (positions), entropy.decode_gaps'


def _numpy(dtype: torch.dtype) -> np.dtype[Any]:
    return torch.empty(0, dtype=dtype).numpy().dtype


def _bits_numpy(dtype: torch.dtype) -> np.dtype[Any]:
    """The numpy dtype of ``dtype``'s bits as ``encode`` and ``decode_onto`` view them."""
    return _numpy(_bits_of(dtype))


def encode_signatures(dtypes: Iterable[torch.dtype]) -> list[Signature]:
    """What ``encode`` and ``positions.gaps_and_top`` hand the kernels, for changes to
    tensors of ``dtypes`` (the receivers')."""
    rows = [Signature(gaps_and_top, (array(_numpy(p)),)) for p in POSITIONS]
    for dtype in dict.fromkeys(_bits_of(d) for d in dtypes if d.itemsize in (1, 2, 4, 8)):
        bits = array(_numpy(dtype))
        rows += [Signature(_encode, (array(_numpy(p)), bits, bits, scalar(int))) for p in POSITIONS]
    return rows


def decode_signatures(dtypes: Iterable[torch.dtype]) -> list[Signature]:
    """What ``decode``, ``decode_onto`` (onto targets of ``dtypes``: those it takes,
    ``decodes_onto``) and raw gaps' positions hand the kernels."""
    int64 = array(np.int64)
    rows = [Signature(positions_into, (array(_numpy(g)), scalar(int), int64)) for g in GAPS]
    onto = [d for d in dtypes if decodes_onto(torch.empty(0, dtype=d))]
    for bits in dict.fromkeys([np.dtype(np.int64), *(_bits_numpy(d) for d in onto)]):  # int64: ``decode``'s differences
        rows.append(Signature(_decode, (array(np.uint8, readonly=True), scalar(int), array(bits), scalar(bool), int64, array(bits))))
    return rows


def _frozen(buf: np.ndarray) -> np.ndarray:
    """``buf``, read-only (a view where it is writable): a frame may be either (ZeroMQ's are
    writable, a copy's bytes are not), and numba compiles the decoder once for each layout
    it meets; this way, once (``decode_signatures``)."""
    if buf.flags.writeable:
        buf = buf.view()
        buf.flags.writeable = False
    return buf


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
def _used(counts):  # pragma: no cover - numba
    """Symbols up to the last counted one (at least one)."""
    n = counts.shape[0]
    while n > 1 and counts[n - 1] == 0:
        n -= 1
    return n


@numba.njit(cache=True, nogil=True)
def _stream(symbols, counts):  # pragma: no cover - numba
    """The rANS words of ``symbols`` under the table quantized from ``counts``."""
    freq = rans.quantize_into(counts)
    cum = np.zeros(freq.shape[0], dtype=np.uint32)
    for s in range(1, freq.shape[0]):
        cum[s] = cum[s - 1] + freq[s - 1]
    scratch = np.empty(symbols.shape[0] + FLUSH_WORDS, dtype=np.uint16)
    return scratch[rans.encode_into(symbols, freq, cum, scratch) :]


@numba.njit(cache=True, nogil=True, inline="always")
def _bit_length(x):  # pragma: no cover - numba
    """Bits of a non-negative int64 or a uint64 (0 for 0): six fixed steps, not a loop
    whose length is the answer."""
    z = np.uint64(x)
    n = 0
    for step in (32, 16, 8, 4, 2, 1):
        high = z >> np.uint64(step)
        if high != np.uint64(0):
            n += step
            z = high
    return n + (z != np.uint64(0))


@numba.njit(cache=True, nogil=True)
def _put_counts(counts, total, out, state):  # pragma: no cover - numba
    """Every count but the last (``total`` less the others): its bit length in as many bits as
    the bit length of what is left to count needs, then its bits below the leading one."""
    left = total
    for s in range(counts.shape[0] - 1):
        c = counts[s]
        length = _bit_length(c)
        entropy._put_wide(out, state, np.uint64(length), _bit_length(_bit_length(left)))
        if length > 1:
            entropy._put_wide(out, state, np.uint64(c), length - 1)
        left -= c


@numba.njit(cache=True, nogil=True)
def _put_varint(out, at, value):  # pragma: no cover - numba
    """LEB128 of non-negative ``value`` at ``at``; returns the offset after it."""
    v = np.uint64(value)
    while v >= np.uint64(0x80):
        out[at] = np.uint8((v & np.uint64(0x7F)) | np.uint64(0x80))
        v >>= np.uint64(7)
        at += 1
    out[at] = np.uint8(v)
    return at + 1


@numba.njit(cache=True, nogil=True)
def _sampled_gaps(flat, stride):  # pragma: no cover - numba
    """Every ``stride``-th zero-run length of sorted ``flat`` (what the Rice parameter is chosen on)."""
    out = np.empty((flat.shape[0] + stride - 1) // stride, dtype=np.int64)
    for j in range(out.shape[0]):
        i = j * stride
        out[j] = flat[i] - (flat[i - 1] if i > 0 else -1) - 1
    return out


@numba.njit(cache=True, nogil=True)
def _symbols(flat, new, old, shift, k, gap_symbols, value_symbols, low, escaped, gap_counts, value_counts, extra):  # pragma: no cover - numba
    """One pass over the changes: each gap's symbol, low bits and escape, each value's
    symbol and extra bits (the layout's sections, in ``entropy``'s bits), and both tables'
    counts; returns (escapes, extra bits).

    The low bits gather in a 64-bit word that stores 4 bytes whenever it holds 32 (a branch
    that repeats with the period of ``k``; ``entropy``'s writer stores a byte at a time, a
    branch a change); the counts go to four interleaved tables, so a run of one symbol does
    not wait on its own increments."""
    gap_lanes = np.zeros((COUNT_LANES, HIGH_SYMBOLS), dtype=np.int64)
    value_lanes = np.zeros((COUNT_LANES, VALUE_SYMBOLS), dtype=np.int64)
    uk = np.uint64(k)
    low_mask = (np.uint64(1) << uk) - np.uint64(1)
    narrow = k <= 32  # else the word could overflow: entropy's writer
    acc, held, at = np.uint64(0), np.uint64(0), 0
    low_state = np.zeros(3, dtype=np.uint64)
    extra_state = np.zeros(3, dtype=np.uint64)
    escapes, extra_bits, prev = 0, 0, -1
    for i in range(flat.shape[0]):
        gap = flat[i] - prev - 1
        prev = flat[i]
        high = np.uint64(gap) >> uk
        s = ESCAPE if high >= np.uint64(ESCAPE) else np.int64(high)
        gap_symbols[i] = s
        gap_lanes[np.uint64(i & (COUNT_LANES - 1)), np.uint64(s)] += 1
        if s == ESCAPE:
            escaped[np.uint64(escapes)] = gap
            escapes += 1
        if narrow:
            acc = (acc << uk) | (np.uint64(gap) & low_mask)
            held += uk
            if held >= np.uint64(32):
                held -= np.uint64(32)
                word = acc >> held
                for b in range(4):
                    low[np.uint64(at + b)] = np.uint8((word >> np.uint64(24 - 8 * b)) & np.uint64(0xFF))
                at += 4
                acc &= (np.uint64(1) << held) - np.uint64(1)
        else:
            entropy._put_wide(low, low_state, np.uint64(gap), k)
        d = np.int64(new[i]) - np.int64(old[i])
        z = entropy._zigzag((d << shift) >> shift)  # the difference wraps at the values' width
        if z < np.uint64(DIRECT):
            v = np.int64(z)
        else:
            width = _bit_length(z)
            v = DIRECT + width - DIRECT_BITS - 1
            entropy._put_wide(extra, extra_state, z, width - 1)  # the bits below the leading one
            extra_bits += width - 1
        value_symbols[i] = v
        value_lanes[np.uint64(i & (COUNT_LANES - 1)), np.uint64(v)] += 1
    if narrow:
        while held >= np.uint64(8):  # the whole bytes left, then the partial one
            held -= np.uint64(8)
            low[at] = np.uint8((acc >> held) & np.uint64(0xFF))
            at += 1
        low_state[0], low_state[1], low_state[2] = acc & ((np.uint64(1) << held) - np.uint64(1)), held, at
    entropy._flush(low, low_state)
    entropy._flush(extra, extra_state)
    for lane in range(COUNT_LANES):
        gap_counts += gap_lanes[lane]
        value_counts += value_lanes[lane]
    return escapes, extra_bits


@numba.njit(cache=True, nogil=True)
def _encode(flat, new, old, shift):  # pragma: no cover - numba
    n = flat.shape[0]
    k = entropy._choose_k(_sampled_gaps(flat, max(1, n // entropy.RICE_SAMPLE)), 1)
    gap_symbols, value_symbols = np.empty(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    low_bytes = (n * k + 7) // 8
    low = np.empty(low_bytes, dtype=np.uint8)
    escaped = np.empty(n, dtype=np.int64)  # room for every gap to escape; few do
    extra = np.empty((n * (64 - shift) + 7) // 8, dtype=np.uint8)  # room for the widest differences
    gap_counts = np.zeros(HIGH_SYMBOLS, dtype=np.int64)
    value_counts = np.zeros(VALUE_SYMBOLS, dtype=np.int64)
    escapes, extra_bits = _symbols(flat, new, old, shift, k, gap_symbols, value_symbols, low, escaped, gap_counts, value_counts, extra)
    extra_bytes = (extra_bits + 7) // 8
    g, v = _used(gap_counts), _used(value_counts)
    gap_words = _stream(gap_symbols, gap_counts[:g])
    value_words = _stream(value_symbols, value_counts[:v])
    head = np.zeros(FIXED + VARINT_MAX + TABLES_MAX, dtype=np.uint8)
    head[0], head[1], head[2] = k, g, v
    tables_at = _put_varint(head, FIXED, gap_words.shape[0])
    state = np.zeros(3, dtype=np.uint64)
    _put_counts(gap_counts[:g], n, head[tables_at:], state)
    _put_counts(value_counts[:v], n, head[tables_at:], state)
    entropy._flush(head[tables_at:], state)
    words_at = tables_at + np.int64(state[2]) + (state[1] > 0)
    words_at += words_at & 1  # the streams start even (the pad byte is zero)
    value_at = words_at + 2 * gap_words.shape[0]
    escapes_at = value_at + 2 * value_words.shape[0]
    low_at = escapes_at + 8 * escapes
    out = np.empty(low_at + low_bytes + extra_bytes, dtype=np.uint8)
    out[:words_at] = head[:words_at]
    out[words_at:value_at].view(np.uint16)[:] = gap_words
    out[value_at:escapes_at].view(np.uint16)[:] = value_words
    out[escapes_at:low_at].view(np.int64)[:] = escaped[:escapes]
    out[low_at : low_at + low_bytes] = low[:low_bytes]
    out[low_at + low_bytes :] = extra[:extra_bytes]
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
def _get_varint(buf, at, limit):  # pragma: no cover - numba
    """(value, offset after it) of a LEB128 at ``at`` of at most ``VARINT_MAX`` bytes;
    value -1 if it is cut off by the buffer's end, longer, or above ``limit``."""
    value, shift = np.uint64(0), np.uint64(0)
    for i in range(VARINT_MAX):
        if at + i >= buf.shape[0]:
            return -1, at
        b = np.uint64(buf[at + i])
        value |= (b & np.uint64(0x7F)) << shift
        if b < np.uint64(0x80):
            return (np.int64(value) if value <= np.uint64(limit) else -1), at + i + 1
        shift += np.uint64(7)
    return -1, at


@numba.njit(cache=True, nogil=True)
def _get_counts(buf, bit, total, out):  # pragma: no cover - numba
    """Counts coded by ``_put_counts`` into ``out``, from bit ``bit`` of ``buf`` (zeros past
    its end); the bit after them, or -1 if a field exceeds what is left of ``total``."""
    left = np.int64(total)
    for s in range(out.shape[0] - 1):
        room = _bit_length(left)
        width = _bit_length(room)
        length = np.int64(entropy._get_wide(buf, bit, width))
        bit += width
        if length > room:
            return -1
        c = np.int64(0)
        if length > 0:
            c = np.int64((np.uint64(1) << np.uint64(length - 1)) | entropy._get_wide(buf, bit, length - 1))
            bit += length - 1
        if c > left:
            return -1
        out[s] = c
        left -= c
    out[out.shape[0] - 1] = left
    return bit


# _layout's fields, in its returned int64 array
(_CODE, _K, _G, _V, _GAP_WORDS, _VALUE_WORDS, _ESCAPES, _TABLES_AT, _WORDS_AT, _VALUE_AT, _ESCAPES_AT, _LOW_AT, _EXTRA_AT,
 _LAYOUT_FIELDS) = range(14)


@numba.njit(cache=True, nogil=True)
def _layout(buf, n, gap_counts, value_counts):  # pragma: no cover - numba
    """Every section's offset and size of an untrusted buffer of ``n`` changes, checked
    against its length before anything past the counts is read; the counts into
    ``gap_counts`` and ``value_counts`` (full-size, the first G and V filled)."""
    out = np.zeros(_LAYOUT_FIELDS, dtype=np.int64)
    size = buf.shape[0]
    if size < FIXED + 1:
        out[_CODE] = 1
        return out
    k, g, v = np.int64(buf[0]), np.int64(buf[1]), np.int64(buf[2])
    if k > MAX_K or not 1 <= g <= HIGH_SYMBOLS or not 1 <= v <= VALUE_SYMBOLS:
        out[_CODE] = 2
        return out
    gap_words, tables_at = _get_varint(buf, FIXED, n + FLUSH_WORDS)
    if gap_words < 0:
        out[_CODE] = 3
        return out
    tables = buf[tables_at:]
    bit = _get_counts(tables, 0, n, gap_counts[:g])
    if bit >= 0:
        bit = _get_counts(tables, bit, n, value_counts[:v])
    if bit < 0 or entropy._get_wide(tables, bit, -bit % 8) != 0:  # the bits after the last count are zero
        out[_CODE] = 4
        return out
    words_at = tables_at + (bit + 7) // 8
    if words_at & 1:
        if words_at >= size or buf[words_at] != 0:
            out[_CODE] = 3
            return out
        words_at += 1
    escapes = gap_counts[ESCAPE] if g == HIGH_SYMBOLS else 0
    extra_bits = 0
    for s in range(DIRECT, v):
        extra_bits += value_counts[s] * (s - DIRECT + DIRECT_BITS)
    value_at = words_at + 2 * gap_words
    tail = 8 * escapes + (n * k + 7) // 8 + (extra_bits + 7) // 8
    rest = size - value_at - tail  # the value stream's bytes
    if rest < 0 or rest & 1 or rest // 2 > n + FLUSH_WORDS:
        out[_CODE] = 3
        return out
    out[_K], out[_G], out[_V], out[_GAP_WORDS], out[_VALUE_WORDS], out[_ESCAPES] = k, g, v, gap_words, rest // 2, escapes
    out[_TABLES_AT], out[_WORDS_AT], out[_VALUE_AT], out[_ESCAPES_AT] = tables_at, words_at, value_at, value_at + rest
    out[_LOW_AT] = value_at + rest + 8 * escapes
    out[_EXTRA_AT] = out[_LOW_AT] + (n * k + 7) // 8
    return out


@numba.njit(cache=True, nogil=True)
def _decode(buf, numel, base, fused, flat, out):  # pragma: no cover - numba
    """Decode into ``flat`` (its length is the change count) and ``out``: the int64 ulp
    differences, or (``base`` not empty: ``numel`` elements) ``base``'s values moved by
    them, in its dtype, added as they decode if ``fused`` (``FUSED_FROM``). An error code."""
    n = flat.shape[0]
    gap_counts = np.zeros(HIGH_SYMBOLS, dtype=np.int64)
    value_counts = np.zeros(VALUE_SYMBOLS, dtype=np.int64)
    at = _layout(buf, n, gap_counts, value_counts)
    if at[_CODE]:
        return at[_CODE]
    k, words_at, value_at, escapes_at, low_at, extra_at = at[_K], at[_WORDS_AT], at[_VALUE_AT], at[_ESCAPES_AT], at[_LOW_AT], at[_EXTRA_AT]
    gap_freq = rans.quantize_into(gap_counts[: at[_G]])
    value_freq = rans.quantize_into(value_counts[: at[_V]])
    gap_cum, gap_lut = _tables(gap_freq)
    value_cum, value_lut = _tables(value_freq)
    if gap_lut.shape[0] == 0 or value_lut.shape[0] == 0:
        return 4
    gap_symbols = np.empty(n, dtype=np.uint8)
    code = rans.decode_into(buf[words_at:value_at].view(np.uint16), gap_freq, gap_cum, gap_lut, gap_symbols)
    if code:
        return _GAP_STREAM - code
    value_symbols = np.empty(n, dtype=np.uint8)
    code = rans.decode_into(buf[value_at:escapes_at].view(np.uint16), value_freq, value_cum, value_lut, value_symbols)
    if code:
        return _VALUE_STREAM - code
    escapes = buf[escapes_at:low_at].view(np.int64)
    return _changes(gap_symbols, value_symbols, k, escapes, buf[low_at:extra_at], buf[extra_at:], numel, base, fused, flat, out)


@numba.njit(cache=True, nogil=True)
def _changes(gap_symbols, value_symbols, k, escapes, low, extra, numel, base, fused, flat, out):  # pragma: no cover - numba
    """Each change from its two symbols in one pass: its gap (high part, low bits or
    escape), position, ulp difference and (given a ``base``) new value, there or in a pass
    after; an error code. ``base`` is read only at positions checked first.

    A kernel of its own, over its arguments: written inside ``_decode``, over the array
    views it makes, the same loop ran 3x (inline) to 10x (an inlined helper) slower (the
    cause not pinned down; numba's reference counting of those views is the likely one)."""
    pos, e, bit = -1, 0, 0
    for i in range(flat.shape[0]):
        s = gap_symbols[i]
        if s == ESCAPE:
            if e >= escapes.shape[0]:
                return 5
            g = escapes[e]
            e += 1
        else:
            g = np.int64((np.uint64(s) << np.uint64(k)) | entropy._get_wide(low, i * k, k))
        if g < 0 or g >= numel or pos + g + 1 >= numel:  # an escape past int64 reads as negative
            return 6
        pos += g + 1
        flat[i] = pos
        s = value_symbols[i]
        if s < DIRECT:
            z = np.uint64(s)
        else:
            below = s - DIRECT + DIRECT_BITS  # width - 1
            z = (np.uint64(1) << np.uint64(below)) | entropy._get_wide(extra, bit, below)
            bit += below
        d = np.int64(z >> np.uint64(1)) ^ -np.int64(z & np.uint64(1))
        # Added wider and truncated to out's width on the store: the bits of the encoder's
        # wrapping difference (a difference stored alone first adds up to the same).
        out[i] = base[np.uint64(pos)] + d if fused else d
    if e != escapes.shape[0]:
        return 5
    if (bit + 7) // 8 != extra.shape[0]:
        return 7
    if base.shape[0] and not fused:
        for i in range(flat.shape[0]):
            out[i] = base[flat[i]] + out[i]
    return 0
