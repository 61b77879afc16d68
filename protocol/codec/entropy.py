"""Entropy coding of patches, close to the information floor.

Positions: the gaps between changed flat indices are split Rice-style into a high part
``gap >> k``, entropy coded under its empirical distribution (the counts travel along),
and ``k`` low bits packed at fixed width (they are close to uniform). Large high parts
escape to a raw side buffer.

Values: the change of each element as an integer difference of its bit pattern
(``new_bits - old_bits``, wrapping at the dtype's width; +-1 for a one-ulp move),
zigzag-mapped and entropy coded under its empirical distribution; large differences
are coded as their bit length, with the bits below the leading one in a side stream
(in element order). Exact for every bit pattern, NaN and infinities included, and
valid only on top of exactly the base version.

The coder is ``rans`` (numba); symbol mapping, bit packing and decoding run fused in
numba kernels that release the GIL. Decoders treat every buffer as hostile: table
sizes, escape counts, bit budgets and the streams' final states are all checked;
anything off raises ``ProtocolError``.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

from protocol.codec import rans
from protocol.codec.aot import Signature, array, scalar
from protocol.errors import ProtocolError
from protocol.wire.dtypes import bits_dtype

HIGH_SYMBOLS = 64  # gap high parts 0..62, 63 = escape
ESCAPE = HIGH_SYMBOLS - 1
MAX_K = 40
DIRECT_BITS = 4  # zigzag values below 16 are their own symbols
DIRECT = 1 << DIRECT_BITS
VALUE_SYMBOLS = DIRECT + 64 - DIRECT_BITS  # then one symbol per bit length 5..64
# Gaps the Rice parameter is chosen on (a strided sample): 2,048 decide it as well as all of
# them, and the choice costs ~4 ns a sampled gap (40 us at 10k gaps when it took 8,192).
RICE_SAMPLE = 2048


# -- bit streams (most significant bit first) ---------------------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _put(out, state, value, width):  # pragma: no cover - numba
    """Append ``width`` <= 32 bits; ``state`` is [accumulator, bits held, next byte]."""
    acc = (state[0] << np.uint64(width)) | (value & ((np.uint64(1) << np.uint64(width)) - np.uint64(1)))
    held = state[1] + np.uint64(width)
    o = state[2]
    while held >= np.uint64(8):
        held -= np.uint64(8)
        out[o] = np.uint8((acc >> held) & np.uint64(0xFF))
        o += np.uint64(1)
    state[0] = acc & ((np.uint64(1) << held) - np.uint64(1))
    state[1] = held
    state[2] = o


@numba.njit(cache=True, nogil=True, inline="always")
def _put_wide(out, state, value, width):  # pragma: no cover - numba
    if width > 32:
        _put(out, state, value >> np.uint64(32), width - 32)
        _put(out, state, value, 32)
    elif width > 0:
        _put(out, state, value, width)


@numba.njit(cache=True, nogil=True, inline="always")
def _flush(out, state):  # pragma: no cover - numba
    if state[1]:
        out[state[2]] = np.uint8((state[0] << (np.uint64(8) - state[1])) & np.uint64(0xFF))


@numba.njit(cache=True, nogil=True, inline="always")
def _get(buf, bit, width):  # pragma: no cover - numba
    """``width`` <= 32 bits at bit offset ``bit`` of ``buf`` (zero past its end)."""
    start = np.uint64(bit >> 3)
    window = np.uint64(0)
    for j in range(5):  # 40 bits cover any 32-bit field and its offset within a byte
        at = start + np.uint64(j)
        b = np.uint64(buf[at]) if at < np.uint64(buf.shape[0]) else np.uint64(0)
        window = (window << np.uint64(8)) | b
    return (window >> np.uint64(40 - (bit & 7) - width)) & ((np.uint64(1) << np.uint64(width)) - np.uint64(1))


@numba.njit(cache=True, nogil=True, inline="always")
def _get_wide(buf, bit, width):  # pragma: no cover - numba
    if width > 32:
        return (_get(buf, bit, width - 32) << np.uint64(32)) | _get(buf, bit + width - 32, 32)
    if width > 0:
        return _get(buf, bit, width)
    return np.uint64(0)


def encode_signatures() -> list[Signature]:
    """What ``encode_gaps`` and ``encode_values`` hand the kernels (``protocol/codec/aot.py``):
    int64 gaps and differences, whatever the tensor's dtype."""
    i64, u8 = array(np.int64), array(np.uint8)
    return [
        Signature(_choose_k, (i64, scalar(int))),
        Signature(_split_gaps, (i64, scalar(int), u8, u8, i64)),
        Signature(_value_symbols, (i64, u8, i64)),
        Signature(_value_extra, (i64, u8, u8)),
        *rans.encode_signatures(),
    ]


def decode_signatures() -> list[Signature]:
    """What ``decode_gaps`` and ``decode_values`` hand the kernels."""
    i64, u8 = array(np.int64), array(np.uint8)
    return [Signature(_join_gaps, (u8, scalar(int), u8, i64, i64)), Signature(_unzigzag, (u8, u8, i64)), *rans.decode_signatures()]


def _symbols(words: torch.Tensor, freq: np.ndarray, cum: np.ndarray, lut: np.ndarray, n: int, what: str) -> np.ndarray:
    symbols = np.empty(n, dtype=np.uint8)
    code = rans.decode_into(_words(words), freq, cum, lut, symbols)
    if code:
        raise ProtocolError(f"{what}: {rans.ERRORS[code]}")
    return symbols


def _words(t: torch.Tensor) -> np.ndarray:
    if t.dtype != torch.uint16 or t.dim() != 1:
        raise ProtocolError("entropy-coded stream must be a 1-D uint16 buffer")
    return t.contiguous().numpy()


def _counts(model: torch.Tensor, n: int, alphabet: int, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validated counts of an untrusted model, and the coder's tables derived from them."""
    if model.dtype != torch.int64 or model.dim() != 1 or not 0 < model.numel() <= alphabet:
        raise ProtocolError(f"{what} model is malformed")
    counts = model.numpy()
    if (counts < 0).any() or (counts > n).any() or int(counts.sum()) != n:  # bounded first: the sum cannot wrap
        raise ProtocolError(f"{what} model of {len(counts)} symbols does not describe {n} values")
    freq = rans.quantize(counts)
    cum, lut = rans.tables(freq)
    return counts, freq, cum, lut


# -- positions ----------------------------------------------------------------------------
def rice_parameter(gaps: torch.Tensor) -> int:
    """The split ``k`` that minimises ``k`` low bits plus the entropy of ``gap >> k``.

    Starts from the median (robust to a few huge gaps) and tries its neighbours, on a
    strided sample of the gaps: it decides as well, much cheaper. One numba call (the
    numpy version of the same arithmetic spent more in per-call overheads than in work).
    """
    if gaps.numel() == 0:
        return 0
    return int(_choose_k(gaps.numpy(), max(1, gaps.numel() // RICE_SAMPLE)))


@numba.njit(cache=True, nogil=True)
def _choose_k(gaps, stride):  # pragma: no cover - numba
    sample = gaps[::stride].copy()
    n = sample.shape[0]
    start = min(MAX_K, max(0, int(math.log2(np.median(sample) + 1.0))))  # gaps past 2**42: k stays in range
    lo, hi = max(0, start - 2), min(MAX_K, start + 2)
    # One histogram of gap >> lo serves every candidate: gap >> (lo + j) is its bucket >> j.
    # Buckets from ESCAPE << (hi - lo) on escape at every candidate, so they share one.
    top = ESCAPE << (hi - lo)
    hist = np.zeros(top + 1, dtype=np.int64)
    used = 0  # buckets below ``top`` in use
    for i in range(n):
        high = np.uint64(sample[i]) >> np.uint64(lo)
        bucket = top if high >= np.uint64(top) else np.int64(high)
        hist[bucket] += 1
        if bucket < top:
            used = max(used, bucket + 1)
    best_k, best_bits = lo, np.inf
    for j in range(hi - lo + 1):
        counts = np.zeros(HIGH_SYMBOLS, dtype=np.int64)
        for h in range(used):
            counts[min(h >> j, ESCAPE)] += hist[h]
        counts[ESCAPE] += hist[top]
        entropy_bits = 0.0
        for s in range(HIGH_SYMBOLS):
            if counts[s]:
                p = counts[s] / n
                entropy_bits -= p * math.log2(p)
        bits = n * ((lo + j) + entropy_bits) + 64 * counts[ESCAPE]
        if bits < best_bits:
            best_k, best_bits = lo + j, bits
    return best_k


@numba.njit(cache=True, nogil=True)
def _split_gaps(gaps, k, symbols, low, counts):  # pragma: no cover - numba
    """High parts as symbols (escaped when large), low bits packed; returns the escape count."""
    state = np.zeros(3, dtype=np.uint64)
    escapes = 0
    for i in range(gaps.shape[0]):
        g = np.uint64(gaps[i])
        high = g >> np.uint64(k)
        s = ESCAPE if high >= np.uint64(ESCAPE) else np.int64(high)
        escapes += s == ESCAPE
        symbols[i] = s
        counts[s] += 1
        _put_wide(low, state, g, k)
    _flush(low, state)
    return escapes


def encode_gaps(gaps: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy-coded gaps: ``words`` (uint16), ``low`` (uint8), ``model`` (int64: k, then
    the counts of the high parts), ``escapes`` (int64 raw gaps whose high part escaped)."""
    gaps = gaps.contiguous()
    k = rice_parameter(gaps)
    n = gaps.numel()
    symbols = np.empty(n, dtype=np.uint8)
    low = np.zeros(math.ceil(n * k / 8), dtype=np.uint8)
    counts = np.zeros(HIGH_SYMBOLS, dtype=np.int64)
    escaped = _split_gaps(gaps.numpy(), k, symbols, low, counts)
    counts = np.trim_zeros(counts, "b")
    escapes = gaps[gaps >> k >= ESCAPE] if escaped else torch.zeros(0, dtype=torch.int64)
    return {
        "words": torch.from_numpy(rans.encode(symbols, counts).view(np.int16)).view(torch.uint16),
        "low": torch.from_numpy(low),
        "model": torch.from_numpy(np.concatenate([[k], counts]).astype(np.int64)),
        "escapes": escapes,
    }


@numba.njit(cache=True, nogil=True)
def _join_gaps(symbols, k, low, escapes, out):  # pragma: no cover - numba
    """Gaps from decoded high parts, low bits and escapes; False if the escapes don't match."""
    e = 0
    for i in range(symbols.shape[0]):
        s = symbols[i]
        if s == ESCAPE:
            if e >= escapes.shape[0]:
                return False
            out[i] = escapes[e]
            e += 1
        else:
            out[i] = np.int64((np.uint64(s) << np.uint64(k)) | _get_wide(low, i * k, k))
    return e == escapes.shape[0]


def decode_gaps(words: torch.Tensor, low: torch.Tensor, model: torch.Tensor, escapes: torch.Tensor, n: int) -> torch.Tensor:
    if model.dtype != torch.int64 or model.dim() != 1 or model.numel() < 2:
        raise ProtocolError("gap model is malformed")
    k = int(model[0])
    if not 0 <= k <= MAX_K:
        raise ProtocolError(f"gap parameter k={k} out of range")
    _, freq, cum, lut = _counts(model[1:], n, HIGH_SYMBOLS, "gap")
    if low.dtype != torch.uint8 or low.numel() != math.ceil(n * k / 8):
        raise ProtocolError(f"{low.numel()} bytes of {k}-bit fields for {n} values")
    if escapes.dtype != torch.int64 or escapes.dim() != 1:
        raise ProtocolError("gap escapes must be a 1-D int64 buffer")
    symbols = _symbols(words, freq, cum, lut, n, "gap stream")
    gaps = np.empty(n, dtype=np.int64)
    if not _join_gaps(symbols, k, low.contiguous().numpy(), escapes.contiguous().numpy(), gaps):
        raise ProtocolError("gap escapes do not match the escape symbols")
    out = torch.from_numpy(gaps)
    if n and int(out.min()) < 0:
        raise ProtocolError("negative gap")
    return out


# -- values -------------------------------------------------------------------------------
def ulp_differences(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new_bits - old_bits`` wrapping at the dtype's width, as int64."""
    bits = bits_dtype(new.dtype)
    return (new.view(bits) - old.view(bits)).to(torch.int64)  # wraps in the narrow dtype


def apply_differences(old: torch.Tensor, diffs: torch.Tensor) -> torch.Tensor:
    bits = bits_dtype(old.dtype)
    return (old.view(bits) + diffs.to(bits)).view(old.dtype)


@numba.njit(cache=True, nogil=True, inline="always")
def _zigzag(d):  # pragma: no cover - numba
    return (np.uint64(d) << np.uint64(1)) ^ np.uint64(d >> 63)  # 0, -1, 1, -2 -> 0, 1, 2, 3


@numba.njit(cache=True, nogil=True)
def _value_symbols(diffs, symbols, counts):  # pragma: no cover - numba
    """Symbols of the zigzagged differences; returns the bits the side stream needs."""
    extra = 0
    for i in range(diffs.shape[0]):
        z = _zigzag(diffs[i])
        if z < np.uint64(DIRECT):
            s = np.int64(z)
        else:
            width = 0
            while width < 64 and (z >> np.uint64(width)) != np.uint64(0):
                width += 1
            s = DIRECT + width - DIRECT_BITS - 1
            extra += width - 1
        symbols[i] = s
        counts[s] += 1
    return extra


@numba.njit(cache=True, nogil=True)
def _value_extra(diffs, symbols, out):  # pragma: no cover - numba
    state = np.zeros(3, dtype=np.uint64)
    for i in range(diffs.shape[0]):
        s = symbols[i]
        if s >= DIRECT:
            _put_wide(out, state, _zigzag(diffs[i]), s - DIRECT + DIRECT_BITS)  # the bits below the leading one
    _flush(out, state)


def encode_values(diffs: torch.Tensor) -> dict[str, torch.Tensor]:
    """Entropy-coded ulp differences: ``words``, ``model`` (counts) and ``extra`` bits.

    Zigzag-mapped differences below ``DIRECT`` are symbols of their own; larger ones are
    coded as their bit length (Exp-Golomb style), the bits below the leading one going
    to ``extra`` in element order. Heavy tails stay cheap.
    """
    d = diffs.contiguous().numpy()
    symbols = np.empty(len(d), dtype=np.uint8)
    counts = np.zeros(VALUE_SYMBOLS, dtype=np.int64)
    extra = np.zeros(math.ceil(_value_symbols(d, symbols, counts) / 8), dtype=np.uint8)
    _value_extra(d, symbols, extra)
    counts = np.trim_zeros(counts, "b")
    return {
        "words": torch.from_numpy(rans.encode(symbols, counts).view(np.int16)).view(torch.uint16),
        "model": torch.from_numpy(counts),
        "extra": torch.from_numpy(extra),
    }


@numba.njit(cache=True, nogil=True)
def _unzigzag(symbols, extra, out):  # pragma: no cover - numba
    """Differences from their symbols and extra bits; returns the extra bits read."""
    bit = 0
    for i in range(symbols.shape[0]):
        s = symbols[i]
        if s < DIRECT:
            z = np.uint64(s)
        else:
            below = s - DIRECT + DIRECT_BITS  # width - 1
            z = (np.uint64(1) << np.uint64(below)) | _get_wide(extra, bit, below)
            bit += below
        out[i] = np.int64(z >> np.uint64(1)) ^ -np.int64(z & np.uint64(1))
    return bit


def decode_values(words: torch.Tensor, model: torch.Tensor, extra: torch.Tensor, n: int) -> torch.Tensor:
    counts, freq, cum, lut = _counts(model, n, VALUE_SYMBOLS, "value")
    below = np.arange(DIRECT, len(counts)) - DIRECT + DIRECT_BITS  # bits each large symbol carries in extra
    need = int((counts[DIRECT:] * below).sum())
    if extra.dtype != torch.uint8 or extra.numel() != math.ceil(need / 8):
        raise ProtocolError(f"value extra bits: {extra.numel()} bytes, the model needs {math.ceil(need / 8)}")
    symbols = _symbols(words, freq, cum, lut, n, "value stream")
    out = np.empty(n, dtype=np.int64)
    _unzigzag(symbols, extra.contiguous().numpy(), out)
    return torch.from_numpy(out)
