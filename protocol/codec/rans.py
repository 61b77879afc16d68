"""Static-model rANS over small alphabets, in numba: the entropy coder of patches.

Four interleaved 32-bit states emitting 16-bit words (the decoder's four chains are
independent, so a core overlaps them). Probabilities are quantized to ``PROB_BITS``
from the symbol counts that travel with each stream, by the same integer arithmetic on
both sides. Every kernel releases the GIL, so streams of different tensors code in
parallel threads.

A stream decodes only if it is consumed exactly: every word read, and each state back
at its initial value. Truncated, padded or bit-flipped streams fail that check (or an
explicit bound) rather than reading out of range.

Computed indices are cast to unsigned where they cannot be negative (here, in ``packed``
and in ``entropy``'s reader): numba adds a negative-index fixup to each signed one that it
cannot prove non-negative. On real patches that made encoding 3-4% and decoding 3-9% faster.
"""

from __future__ import annotations

import numba
import numpy as np

from protocol.codec.aot import Signature, array

PROB_BITS = 15
PROB_SCALE = 1 << PROB_BITS
LANES = 4  # interleaved states
STATE_LOW = 1 << 16  # states live in [STATE_LOW, 2**32); words are 16 bits
FLUSH_WORDS = 2 * LANES  # each final state is flushed as two words
# From this many bits a symbol the decoder renormalises without a branch: below, the branch
# is predicted well and faster. ns a symbol, one core, branchy against branchless: at 0.06
# bits 1.05 and 1.71, at 1.29 bits 1.72 and 1.70, at 2.41 bits 2.30 and 1.70; the real lr 1e-5
# workload's gap stream (3.4 bits) 2.74 and 1.85 (docs/performance.md).
BRANCHLESS_FROM = 1.2

# Decoder error codes (0 is success); ``decode`` turns them into messages.
ERRORS = {
    -1: "stream shorter than its final states",
    -2: "a final state is out of range",
    -3: "stream ends before its symbols do",
    -4: "words left over after the last symbol",
    -5: "stream does not return to its initial state (corrupted)",
}


def quantize(counts: np.ndarray) -> np.ndarray:
    """Frequencies summing to ``PROB_SCALE``, at least 1 for every counted symbol.

    Integer-only and deterministic: encoder and decoder derive the same table from the
    counts. The largest symbol absorbs the rounding (it keeps at least
    ``PROB_SCALE / len(counts) - len(counts)``, positive for alphabets below 181)."""
    return quantize_into(np.ascontiguousarray(counts, dtype=np.int64))


@numba.njit(cache=True, nogil=True)
def quantize_into(counts):  # pragma: no cover - numba
    """``quantize`` as a kernel, for encoders that run whole in numba (``packed``)."""
    total = max(counts.sum(), 1)
    freq = np.empty(counts.shape[0], dtype=np.uint32)
    top, assigned = 0, 0
    for s in range(counts.shape[0]):
        f = counts[s] * PROB_SCALE // total
        if counts[s] > 0 and f == 0:
            f = 1
        freq[s] = f
        assigned += f
        if counts[s] > counts[top]:
            top = s
    freq[top] += PROB_SCALE - assigned
    return freq


def tables(freq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative frequencies and the slot -> symbol lookup of a quantized table."""
    cum = np.zeros(len(freq), dtype=np.uint32)
    np.cumsum(freq[:-1], out=cum[1:])
    lut = np.repeat(np.arange(len(freq), dtype=np.uint8), freq)
    return cum, lut


@numba.njit(cache=True, nogil=True, inline="always")
def _put(symbols, i, freq, cum, out, pos, x):  # pragma: no cover - numba
    """Symbol ``i`` onto state ``x``: (new state, new start of the stream in ``out``).

    Without a branch: the low word is written below the stream every time and kept only
    when the state must shed it (the next word written overwrites it otherwise). On
    high-entropy streams the branch was mispredicted often enough to cost more than the
    write, and on low-entropy ones the write costs about what the branch did."""
    s = symbols[i]
    f = np.uint64(freq[s])
    emit = np.int64(x >= f << np.uint64(32 - PROB_BITS))  # one 16-bit word always suffices
    out[np.uint64(pos - 1)] = np.uint16(x & np.uint64(0xFFFF))
    pos -= emit
    x >>= np.uint64(emit << 4)
    return ((x // f) << np.uint64(PROB_BITS)) + (x % f) + np.uint64(cum[s]), pos


@numba.njit(cache=True, nogil=True)
def encode_into(symbols, freq, cum, out):  # pragma: no cover - numba
    """rANS-code ``symbols`` backwards into the end of ``out`` (uint16, at least
    ``len(symbols) + FLUSH_WORDS`` long: ``_put`` writes one word below the stream);
    returns where the stream starts. Symbol ``i`` goes to lane ``i % LANES``; the lanes
    are scalars unrolled in one loop, as in ``decode_into``."""
    x0 = x1 = x2 = x3 = np.uint64(STATE_LOW)
    pos = out.shape[0]
    i = symbols.shape[0] - 1
    while i >= 0 and (i & 3) != 3:  # the last, partial group of lanes
        if (i & 3) == 2:
            x2, pos = _put(symbols, i, freq, cum, out, pos, x2)
        elif (i & 3) == 1:
            x1, pos = _put(symbols, i, freq, cum, out, pos, x1)
        else:
            x0, pos = _put(symbols, i, freq, cum, out, pos, x0)
        i -= 1
    while i >= 3:
        x3, pos = _put(symbols, i, freq, cum, out, pos, x3)
        x2, pos = _put(symbols, i - 1, freq, cum, out, pos, x2)
        x1, pos = _put(symbols, i - 2, freq, cum, out, pos, x1)
        x0, pos = _put(symbols, i - 3, freq, cum, out, pos, x0)
        i -= 4
    for x in (x3, x2, x1, x0):  # each final state as two words, lane 0's first in the stream
        pos -= 1
        out[pos] = np.uint16(x & np.uint64(0xFFFF))
        pos -= 1
        out[pos] = np.uint16(x >> np.uint64(16))
    return pos


@numba.njit(cache=True, nogil=True, inline="always")
def _step(words, pos, x, freq, cum, lut, branchless):  # pragma: no cover - numba
    """One symbol from state ``x``: (symbol, new state, next word). Past the stream's end
    the next word is -1 from then on, or (``branchless``) beyond ``len(words)``.

    ``branchless`` reads a word every time (the last one once past the end) and keeps
    it only when the state needs it: on high-entropy streams the branch is mispredicted
    often enough to cost more than the read (``BRANCHLESS_FROM``)."""
    slot = x & np.uint64(PROB_SCALE - 1)
    s = lut[slot]
    x = np.uint64(freq[s]) * (x >> np.uint64(PROB_BITS)) + slot - np.uint64(cum[s])
    if branchless:
        need = np.int64(x < STATE_LOW)
        word = np.uint64(words[np.uint64(min(pos, words.shape[0] - 1))])
        return s, (x << np.uint64(need << 4)) | (word & np.uint64(-need)), pos + need
    if x < STATE_LOW:
        if pos >= words.shape[0] or pos < 0:
            return s, x, -1
        x = (x << np.uint64(16)) | np.uint64(words[pos])
        pos += 1
    return s, x, pos


@numba.njit(cache=True, nogil=True)
def entropy_bits(freq):  # pragma: no cover - numba
    """Bits a symbol of a quantized table (summing to ``PROB_SCALE``) carries on average."""
    bits = 0.0
    for s in range(freq.shape[0]):
        if freq[s]:
            p = freq[s] / PROB_SCALE
            bits -= p * np.log2(p)
    return bits


@numba.njit(cache=True, nogil=True)
def decode_into(words, freq, cum, lut, out):  # pragma: no cover - numba
    """Symbols into ``out`` (its length is the count); returns an error code.

    The four lanes are scalars unrolled in one loop, so their chains overlap."""
    return decode_lanes(words, freq, cum, lut, out, entropy_bits(freq) >= BRANCHLESS_FROM)


@numba.njit(cache=True, nogil=True)
def decode_lanes(words, freq, cum, lut, out, branchless):  # pragma: no cover - numba
    """``decode_into`` with the renormalisation chosen (``_step``): both give the same
    symbols and the same error code for any words."""
    if words.shape[0] < FLUSH_WORDS:
        return -1
    x0 = (np.uint64(words[0]) << np.uint64(16)) | np.uint64(words[1])
    x1 = (np.uint64(words[2]) << np.uint64(16)) | np.uint64(words[3])
    x2 = (np.uint64(words[4]) << np.uint64(16)) | np.uint64(words[5])
    x3 = (np.uint64(words[6]) << np.uint64(16)) | np.uint64(words[7])
    if x0 < STATE_LOW or x1 < STATE_LOW or x2 < STATE_LOW or x3 < STATE_LOW:
        return -2
    pos = FLUSH_WORDS
    n = out.shape[0]
    whole = n - (n & (LANES - 1))
    for i in range(0, whole, LANES):
        out[i], x0, pos = _step(words, pos, x0, freq, cum, lut, branchless)
        out[i + 1], x1, pos = _step(words, pos, x1, freq, cum, lut, branchless)
        out[i + 2], x2, pos = _step(words, pos, x2, freq, cum, lut, branchless)
        out[i + 3], x3, pos = _step(words, pos, x3, freq, cum, lut, branchless)
    if whole < n:
        out[whole], x0, pos = _step(words, pos, x0, freq, cum, lut, branchless)
    if whole + 1 < n:
        out[whole + 1], x1, pos = _step(words, pos, x1, freq, cum, lut, branchless)
    if whole + 2 < n:
        out[whole + 2], x2, pos = _step(words, pos, x2, freq, cum, lut, branchless)
    if pos < 0 or pos > words.shape[0]:  # a word was wanted past the end
        return -3
    if pos != words.shape[0]:
        return -4
    if x0 != STATE_LOW or x1 != STATE_LOW or x2 != STATE_LOW or x3 != STATE_LOW:
        return -5
    return 0


def encode(symbols: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The rANS words (uint16) of ``symbols`` (uint8) whose histogram is ``counts``."""
    freq = quantize(counts)
    cum, _ = tables(freq)
    out = np.empty(len(symbols) + FLUSH_WORDS, dtype=np.uint16)
    start = encode_into(symbols, freq, cum, out)
    return out[start:].copy()


def encode_signatures() -> list[Signature]:
    """What ``quantize`` and ``encode`` hand the kernels (``protocol/codec/aot.py``)."""
    u32 = array(np.uint32)
    return [Signature(quantize_into, (array(np.int64),)), Signature(encode_into, (array(np.uint8), u32, u32, array(np.uint16)))]


def decode_signatures() -> list[Signature]:
    """What ``quantize`` and ``entropy``'s decoders hand the kernels."""
    u8, u32 = array(np.uint8), array(np.uint32)
    return [Signature(quantize_into, (array(np.int64),)), Signature(decode_into, (array(np.uint16), u32, u32, u8, u8))]
