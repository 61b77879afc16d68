"""The rANS coder on its own: exact round trips, and corrupted streams always caught."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import rans


def roundtrip(symbols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    counts = np.bincount(symbols).astype(np.int64)
    words = rans.encode(symbols, counts)
    return words, counts, decode(words, counts, len(symbols))[1]


def decode(words: np.ndarray, counts: np.ndarray, n: int) -> tuple[int, np.ndarray]:
    freq = rans.quantize(counts)
    cum, lut = rans.tables(freq)
    out = np.zeros(n, dtype=np.uint8)
    return rans.decode_into(words, freq, cum, lut, out), out


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 5000),
    alphabet=st.integers(1, 76),
    skew=st.floats(0.0, 8.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_is_exact(n: int, alphabet: int, skew: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    weights = np.exp(-skew * np.arange(alphabet))
    symbols = rng.choice(alphabet, size=n, p=weights / weights.sum()).astype(np.uint8)
    words, counts, _ = roundtrip(symbols)
    code, out = decode(words, counts, n)
    assert code == 0 and np.array_equal(out, symbols)
    assert len(words) <= n + rans.FLUSH_WORDS


def test_size_is_close_to_the_entropy() -> None:
    rng = np.random.default_rng(0)
    p = np.array([0.6, 0.25, 0.1, 0.04, 0.01])
    symbols = rng.choice(len(p), size=200_000, p=p).astype(np.uint8)
    words, counts, _ = roundtrip(symbols)
    q = counts / counts.sum()
    floor_bits = -(counts * np.log2(q)).sum()
    assert floor_bits <= len(words) * 16 <= 1.01 * floor_bits + 16 * rans.FLUSH_WORDS


def test_one_symbol_stream_costs_only_the_states() -> None:
    words, _, _ = roundtrip(np.full(10_000, 3, dtype=np.uint8))
    assert len(words) == rans.FLUSH_WORDS


def test_quantize_is_a_valid_table() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        counts = rng.integers(0, 10**rng.integers(1, 9), size=rng.integers(1, 77)) * (rng.random(1) < 0.9)
        if counts.sum() == 0:
            counts[0] = 1
        freq = rans.quantize(counts)
        assert int(freq.sum()) == rans.PROB_SCALE
        assert ((freq > 0) == (counts > 0)).all()


@pytest.mark.parametrize("damage", ["truncate", "append", "flip", "head"])
def test_damaged_streams_are_rejected(damage: str) -> None:
    rng = np.random.default_rng(2)
    symbols = rng.choice(8, size=20_000, p=[0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.03, 0.02]).astype(np.uint8)
    words, counts, _ = roundtrip(symbols)
    bad = words.copy()
    if damage == "truncate":
        bad = bad[:-3]
    elif damage == "append":
        bad = np.concatenate([bad, np.array([7], dtype=np.uint16)])
    elif damage == "flip":
        bad[len(bad) // 2] ^= 0x0100
    else:
        bad = bad[:5]
    code, _ = decode(bad, counts, len(symbols))
    assert code in rans.ERRORS


def reference_encode(symbols: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The stream format in plain Python: lane ``i % 4`` takes symbol ``i``, coded last to
    first; a state sheds its low word when the symbol would overflow it; the final states
    lead the stream, lane 0's first, high word first."""
    freq = rans.quantize(counts)
    cum, _ = rans.tables(freq)
    states, words = [rans.STATE_LOW] * rans.LANES, []
    for i in range(len(symbols) - 1, -1, -1):
        s, x = int(symbols[i]), states[i % rans.LANES]
        f = int(freq[s])
        if x >= f << (32 - rans.PROB_BITS):
            words.append(x & 0xFFFF)
            x >>= 16
        states[i % rans.LANES] = (x // f << rans.PROB_BITS) + x % f + int(cum[s])
    for x in reversed(states):
        words += [x & 0xFFFF, x >> 16]
    return np.array(words[::-1], dtype=np.uint16)


@settings(max_examples=80, deadline=None)
@given(n=st.integers(0, 300), alphabet=st.integers(1, 64), skew=st.floats(0.0, 4.0), seed=st.integers(0, 2**32 - 1))
def test_the_encoder_writes_the_reference_stream(n: int, alphabet: int, skew: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    weights = np.exp(-skew * np.arange(alphabet))
    symbols = rng.choice(alphabet, size=n, p=weights / weights.sum()).astype(np.uint8)
    counts = np.bincount(symbols, minlength=alphabet).astype(np.int64) if n else np.ones(1, dtype=np.int64)
    assert np.array_equal(rans.encode(symbols, counts), reference_encode(symbols, counts))


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(1, 3000),
    alphabet=st.integers(1, 40),
    skew=st.floats(0.0, 6.0),
    damage=st.sampled_from(["none", "truncate", "append", "flip", "random"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_both_renormalisations_decode_alike(n: int, alphabet: int, skew: float, damage: str, seed: int) -> None:
    """Branchy and branchless decoding (``decode_into`` picks one by the table's entropy)
    give the same code for any words, and the same symbols when the code is 0."""
    rng = np.random.default_rng(seed)
    weights = np.exp(-skew * np.arange(alphabet))
    symbols = rng.choice(alphabet, size=n, p=weights / weights.sum()).astype(np.uint8)
    counts = np.bincount(symbols).astype(np.int64)
    words = rans.encode(symbols, counts)
    if damage == "truncate":
        words = words[: int(rng.integers(0, len(words)))]
    elif damage == "append":
        words = np.concatenate([words, rng.integers(0, 1 << 16, size=int(rng.integers(1, 4)), dtype=np.uint16)])
    elif damage == "flip":
        words = words.copy()
        words[int(rng.integers(0, len(words)))] ^= np.uint16(1 << int(rng.integers(0, 16)))
    elif damage == "random":
        words = rng.integers(0, 1 << 16, size=len(words), dtype=np.uint16)
    freq = rans.quantize(counts)
    cum, lut = rans.tables(freq)
    outs = [np.zeros(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)]
    codes = [rans.decode_lanes(words, freq, cum, lut, out, branchless) for out, branchless in zip(outs, (False, True))]
    assert codes[0] == codes[1]
    if codes[0] == 0:
        assert np.array_equal(outs[0], outs[1])
    if damage == "none":
        assert codes[0] == 0 and np.array_equal(outs[0], symbols)


def test_entropy_bits_of_a_table_and_the_renormalisation_threshold() -> None:
    assert rans.entropy_bits(rans.quantize(np.array([5], dtype=np.int64))) == 0.0
    assert rans.entropy_bits(rans.quantize(np.ones(8, dtype=np.int64))) == pytest.approx(3.0)
    assert 0 < rans.BRANCHLESS_FROM < 3.0


def rice_reference(gaps: np.ndarray) -> int:
    """``entropy.rice_parameter`` as plain numpy: the median's neighbourhood, each
    candidate ``k`` costed as k low bits plus the entropy of ``gap >> k`` (escapes at 64 bits)."""
    from protocol.codec.entropy import ESCAPE, HIGH_SYMBOLS, MAX_K, RICE_SAMPLE

    if len(gaps) == 0:
        return 0
    sample = gaps[:: max(1, len(gaps) // RICE_SAMPLE)]
    start = min(MAX_K, max(0, int(np.log2(float(np.median(sample)) + 1))))
    ks = np.arange(max(0, start - 2), min(MAX_K, start + 2) + 1)
    counts = np.zeros((len(ks), HIGH_SYMBOLS), dtype=np.int64)
    for j, k in enumerate(ks):
        np.add.at(counts[j], np.minimum(sample >> k, ESCAPE), 1)
    p = counts / len(sample)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy_bits = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return int(ks[int(np.argmin(len(sample) * (ks + entropy_bits) + 64 * counts[:, ESCAPE]))])


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 40_000), p=st.floats(1e-4, 0.95), wide=st.integers(0, 42), huge=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_rice_parameter_matches_its_numpy_reference(n: int, p: float, wide: int, huge: int, seed: int) -> None:
    import torch

    from protocol.codec import entropy

    rng = np.random.default_rng(seed)
    gaps = (rng.geometric(p, n) - 1) << min(wide, 20) if n else np.zeros(0, dtype=np.int64)
    gaps = np.concatenate([gaps.astype(np.int64), np.full(huge, 1 << (20 + wide), dtype=np.int64)])
    k = entropy.rice_parameter(torch.from_numpy(gaps))
    assert k == rice_reference(gaps)
    if len(gaps):  # and it codes: the chosen split round-trips
        coded = entropy.encode_gaps(torch.from_numpy(gaps))
        assert int(coded["model"][0]) == k
        out = entropy.decode_gaps(coded["words"], coded["low"], coded["model"], coded["escapes"], len(gaps))
        assert np.array_equal(out.numpy(), gaps)
