"""The packed entry (protocol/codec/packed.py): ANS_GAPS positions and ULP values in one buffer.

Round trips are bit-exact for every dtype and difference; a hostile buffer (truncated,
flipped, lying header fields or tables) is a ProtocolError or, where the corruption is in
bits no check can see, decodes in bounds; the layout is never larger than the separate
buffers it replaced.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import entropy, packed
from protocol.codec.positions import gaps_of
from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse
from protocol.errors import ProtocolError
from protocol.wire.dtypes import bits_dtype
from protocol.wire.framing import Encoding, Message, MessageType, Role, ValueEncoding, decode_message, encode_message

NUMEL = 1 << 16


def changes(nnz: int, dtype: torch.dtype, spread: int, seed: int, numel: int = NUMEL) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sorted positions and old/new values whose bit patterns differ by up to ``spread`` (and a few extremes)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randperm(numel, generator=gen)[:nnz].sort().values
    bits = bits_dtype(dtype)
    info = torch.iinfo(bits)
    old = torch.randint(info.min, info.max, (nnz,), generator=gen, dtype=torch.int64).to(bits)
    step = torch.randint(-spread, spread + 1, (nnz,), generator=gen, dtype=torch.int64)
    step[: min(nnz, 3)] = torch.tensor([info.max, info.min, 1])[: min(nnz, 3)]  # wrap at the dtype's width
    new = (old.to(torch.int64) + step).to(bits)
    return flat, new.view(dtype), old.view(dtype)


def roundtrip(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, numel: int = NUMEL) -> None:
    buf = packed.encode(flat, new, old).numpy()
    got_flat, diffs = packed.decode(buf, flat.numel(), numel)
    assert torch.equal(got_flat, flat)
    bits = bits_dtype(new.dtype)
    assert torch.equal(entropy.apply_differences(old, diffs).view(bits), new.view(bits))
    if numel <= NUMEL:  # and straight onto a target holding ``old`` at ``flat``
        base = torch.randint(-100, 100, (numel,), generator=torch.Generator().manual_seed(numel), dtype=torch.int64).to(bits).view(new.dtype)
        base[flat] = old
        if packed.decodes_onto(base):
            before = base.clone()
            for fused in (None, True, False):  # as FUSED_FROM picks; added as they decode; in a pass after
                onto_flat, values = packed.decode_onto(buf, flat.numel(), base, fused=fused)
                assert torch.equal(onto_flat, flat) and values.dtype == new.dtype
                assert torch.equal(values.view(bits), new.view(bits))
            assert torch.equal(base.view(bits), before.view(bits))  # only read


@settings(max_examples=40, deadline=None)
@given(
    nnz=st.integers(1, 3000),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64, torch.uint8, torch.int32]),
    spread=st.sampled_from([1, 2, 40, 5000, 1 << 40]),
    seed=st.integers(0, 2**16),
)
def test_roundtrip_is_bit_exact(nnz: int, dtype: torch.dtype, spread: int, seed: int) -> None:
    roundtrip(*changes(nnz, dtype, spread, seed))


def test_huge_gaps_escape_and_come_back() -> None:
    numel = 1 << 50  # gaps past the table: escaped, carried raw
    flat = torch.tensor([0, 5, 1 << 45, (1 << 45) + 1, (1 << 49) + 7] * 1 + list(range((1 << 49) + 8, (1 << 49) + 2000)))
    old = torch.zeros(flat.numel(), dtype=torch.bfloat16)
    buf = packed.encode(flat, old + 1, old).numpy()
    assert packed.layout(buf, flat.numel())["escapes"] > 0  # some gaps escaped
    roundtrip(flat, old + 1, old, numel)


@pytest.mark.parametrize("gap_bits", [3, 31, 33, 38])
def test_low_bits_of_any_width_come_back(gap_bits: int) -> None:
    """The encoder packs up to 32 low bits a gap in a word of its own and wider ones
    through ``entropy``'s writer: both read back through the decoder's."""
    gen = torch.Generator().manual_seed(gap_bits)
    gaps = torch.randint(1 << (gap_bits - 1), 1 << gap_bits, (2001,), generator=gen)
    flat = torch.cumsum(gaps, 0) - 1
    old = torch.randint(-100, 100, (flat.numel(),), generator=gen).to(torch.bfloat16)
    new = (old.view(torch.int16) + torch.randint(-300, 300, (flat.numel(),), generator=gen).to(torch.int16)).view(torch.bfloat16)
    k = int(packed.encode(flat, new, old)[0])
    assert (k > 32) == (gap_bits > 33)
    roundtrip(flat, new, old, int(flat[-1]) + 1)


def test_not_larger_than_the_separate_buffers_it_replaced() -> None:
    for nnz in (512, 5000, 30000):
        flat, new, old = changes(nnz, torch.bfloat16, 2, nnz, numel=1 << 20)
        gaps = entropy.encode_gaps(gaps_of(flat))
        values = entropy.encode_values(entropy.ulp_differences(new, old))
        separate = sum(t.numel() * t.element_size() for t in (*gaps.values(), *values.values()))
        assert packed.encode(flat, new, old).numel() <= separate


def test_an_entry_is_one_uncompressed_values_buffer_and_decodes_through_decode_entry() -> None:
    flat, new, old = changes(2000, torch.bfloat16, 3, 1)
    entry = encode_sparse(4, flat, new, old, (NUMEL,), PatchOptions())
    assert (entry.encoding, entry.values) == (Encoding.ANS_GAPS, ValueEncoding.ULP)
    ((spec, _),) = entry.buffers
    assert spec.role is Role.VALUES and spec.dtype == 9 and int(spec.codec) == 0  # uint8, Codec.NONE
    specs, frames = assemble([entry])
    msg = decode_message(encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames)))
    decoded = decode_entry(msg.tensors[0], msg.frames, (NUMEL,), torch.bfloat16, torch.device("cpu"))
    assert decoded.flat is not None and torch.equal(decoded.flat, flat)
    assert torch.equal(decoded.new_values(old).view(torch.int16), new.view(torch.int16))
    with pytest.raises(ProtocolError, match="changes for a tensor"):  # checked against the target before decoding
        decode_entry(msg.tensors[0], msg.frames, (1500,), torch.bfloat16, torch.device("cpu"))
    # Given the target, it decodes onto it: the new values themselves, RAW.
    target = torch.zeros(NUMEL, dtype=torch.bfloat16)
    target[flat] = old
    onto = decode_entry(msg.tensors[0], msg.frames, (NUMEL,), torch.bfloat16, torch.device("cpu"), base=target)
    assert onto.encoding is ValueEncoding.RAW and onto.flat is not None and torch.equal(onto.flat, flat)
    assert torch.equal(onto.values.view(torch.int16), new.view(torch.int16))
    with pytest.raises(ValueError, match="base"):  # a caller's mistake, not the sender's
        decode_entry(msg.tensors[0], msg.frames, (NUMEL,), torch.bfloat16, torch.device("cpu"), base=target.float())
    bools = torch.zeros(NUMEL, dtype=torch.bool)  # a base it does not take: decoded as differences
    assert decode_entry(msg.tensors[0], msg.frames, (NUMEL,), torch.bfloat16, torch.device("cpu"), base=bools).encoding is ValueEncoding.ULP


def test_decodes_onto_contiguous_host_tensors_of_2_4_or_8_byte_elements() -> None:
    for dtype in (torch.bfloat16, torch.float16, torch.int16, torch.float32, torch.int32, torch.float64, torch.int64):
        assert packed.decodes_onto(torch.zeros(8, dtype=dtype))
    for t in (torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.bool), torch.zeros(4, 4)[:, 1], torch.zeros(8, dtype=torch.complex64)):
        assert not packed.decodes_onto(t)


def good_buffer() -> tuple[np.ndarray, int]:
    flat, new, old = changes(700, torch.float32, 300, 7)
    return packed.encode(flat, new, old).numpy(), flat.numel()


BASE = torch.arange(NUMEL, dtype=torch.int32).view(torch.float32)  # good_buffer's target


def onto_both_ways(buf: np.ndarray, nnz: int) -> list[tuple[torch.Tensor, torch.Tensor] | ProtocolError]:
    """``decode_onto``'s result (or error) adding the differences as they decode and in a pass after."""
    results: list[tuple[torch.Tensor, torch.Tensor] | ProtocolError] = []
    for fused in (True, False):
        try:
            results.append(packed.decode_onto(buf, nnz, BASE, fused=fused))
        except ProtocolError as e:
            results.append(e)
    return results


def decodes_in_bounds_or_refuses(buf: np.ndarray, nnz: int) -> None:
    """Refused, or decoded in bounds; decoding onto a target (either way) refuses the same
    buffers and otherwise gives the values ``decode``'s differences make, reading the target only."""
    onto = onto_both_ways(buf, nnz)
    assert torch.equal(BASE.view(torch.int32), torch.arange(NUMEL, dtype=torch.int32))
    try:
        flat, diffs = packed.decode(buf, nnz, NUMEL)
    except ProtocolError:
        assert all(isinstance(r, ProtocolError) for r in onto)
        return
    assert flat.numel() == nnz and (nnz == 0 or (int(flat[0]) >= 0 and int(flat[-1]) < NUMEL))
    assert nnz < 2 or bool((flat[1:] > flat[:-1]).all())
    want = entropy.apply_differences(BASE[flat], diffs).view(torch.int32)
    for r in onto:
        assert not isinstance(r, ProtocolError)
        assert torch.equal(r[0], flat) and torch.equal(r[1].view(torch.int32), want)


def test_every_truncation_and_extension_is_refused() -> None:
    buf, nnz = good_buffer()
    for cut in range(len(buf)):
        with pytest.raises(ProtocolError):
            packed.decode(buf[:cut].copy(), nnz, NUMEL)
        assert all(isinstance(r, ProtocolError) for r in onto_both_ways(buf[:cut].copy(), nnz))
    with pytest.raises(ProtocolError):
        packed.decode(np.concatenate([buf, np.zeros(1, np.uint8)]), nnz, NUMEL)


def test_bit_flips_anywhere_are_refused_or_stay_in_bounds() -> None:
    buf, nnz = good_buffer()
    rng = np.random.default_rng(3)
    for at in rng.integers(0, len(buf), 600):
        bad = buf.copy()
        bad[at] ^= np.uint8(1 << int(rng.integers(0, 8)))
        decodes_in_bounds_or_refuses(bad, nnz)


@pytest.mark.parametrize(
    "field,value",
    [(0, entropy.MAX_K + 1), (1, 0), (1, entropy.HIGH_SYMBOLS + 1), (2, 0), (2, entropy.VALUE_SYMBOLS + 1)],
)
def test_header_bytes_out_of_range_are_refused(field: int, value: int) -> None:
    buf, nnz = good_buffer()
    buf[field] = value
    with pytest.raises(ProtocolError, match="header"):
        packed.decode(buf, nnz, NUMEL)


def leb128(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def with_gap_words(buf: np.ndarray, nnz: int, field: bytes) -> np.ndarray:
    """``buf`` with its gap-words field (the LEB128 at byte 3) replaced by ``field``."""
    tables_at = packed.layout(buf, nnz)["tables_at"]
    return np.concatenate([buf[:3], np.frombuffer(field, np.uint8), buf[tables_at:]])


@pytest.mark.parametrize("lie", [lambda w: 2**64 - 1, lambda w: 2**63, lambda w: 10**6, lambda w: 0, lambda w: w - 1, lambda w: w + 1])
def test_lying_gap_word_counts_are_refused_before_anything_is_read(lie: Callable[[int], int]) -> None:
    buf, nnz = good_buffer()
    bad = with_gap_words(buf, nnz, leb128(lie(packed.layout(buf, nnz)["gap_words"])))
    decodes_in_bounds_or_refuses(bad, nnz)
    with pytest.raises(ProtocolError):
        packed.decode(bad, nnz, NUMEL)


@pytest.mark.parametrize("field", [b"\x80" * 10 + b"\x01", b"\xff" * 3])
def test_an_overlong_or_unterminated_gap_word_count_is_refused(field: bytes) -> None:
    buf, nnz = good_buffer()
    with pytest.raises(ProtocolError, match="sizes"):
        packed.decode(with_gap_words(buf, nnz, field)[: 3 + len(field)], nnz, NUMEL)
    with pytest.raises(ProtocolError):
        packed.decode(with_gap_words(buf, nnz, field), nnz, NUMEL)


def test_bits_of_the_counts_tables_flipped_are_refused_or_stay_in_bounds() -> None:
    """A count changed moves the sizes it implies (escapes, extra bits, the value stream's
    length) and the coder's tables: refused, or (where only slots the streams never visit
    moved) decoded in bounds; never read past the buffer. The bits after the last count are zero."""
    buf, nnz = good_buffer()
    bits = range(8 * packed.layout(buf, nnz)["tables_at"], 8 * packed.layout(buf, nnz)["words_at"])
    refused = 0
    for bit in bits:
        bad = buf.copy()
        bad[bit // 8] ^= np.uint8(1 << (bit % 8))
        decodes_in_bounds_or_refuses(bad, nnz)
        try:
            packed.decode(bad, nnz, NUMEL)
        except ProtocolError:
            refused += 1
    assert refused >= 0.95 * len(bits)


def test_a_count_past_the_changes_left_is_refused() -> None:
    buf, nnz = good_buffer()  # 700 changes: the first count's length field is 4 bits, at most 10
    buf[packed.layout(buf, nnz)["tables_at"]] |= 0xF0
    with pytest.raises(ProtocolError, match="counts table"):
        packed.decode(buf, nnz, NUMEL)


def test_counts_tables_cost_a_few_bits_a_symbol() -> None:
    """What the counts replaced: a 16-bit frequency a symbol up to the last used one (on the
    real workloads of ``python -m benchmarks --suite quick`` they cost ~3 bits a symbol; these
    changes, uniform gaps and a few extreme values, are a harder case)."""
    for nnz in (40, 700, 30000):
        flat, new, old = changes(nnz, torch.bfloat16, 3, nnz, numel=1 << 20)
        buf = packed.encode(flat, new, old).numpy()
        at = packed.layout(buf, nnz)
        assert 8 * (at["words_at"] - at["tables_at"]) <= 10 * (at["G"] + at["V"]) + 16
        roundtrip(flat, new, old, 1 << 20)


def test_positions_past_the_target_are_refused() -> None:
    flat, new, old = changes(600, torch.bfloat16, 2, 9)
    buf = packed.encode(flat, new, old).numpy()
    with pytest.raises(ProtocolError, match="past the tensor"):
        packed.decode(buf, flat.numel(), int(flat[-1]))  # the last position is one too many
    with pytest.raises(ProtocolError):
        packed.decode(buf, flat.numel() + 1, NUMEL)  # more changes than were coded
