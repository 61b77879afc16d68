"""Malformed and adversarial input: decoding raises a typed WeightSyncError, never anything else,
never allocates what a header merely claims, and never yields a silently different update."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import resource
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
from channel import Channel
from coded import judged
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_framing import header_of, reseal
from test_spans import at_base, frames_of, recv_of

import receiver
import sender
from protocol.codec import devicecodec
from protocol.codec.compress import Codec, compress
from protocol.codec.spans import encode_dense_span, encode_span
from protocol.codec.tensorcodec import (
    EncodedTensor,
    PatchOptions,
    assemble,
    decode_entry,
    encode_dense,
    encode_sparse,
    pack_entry,
)
from protocol.errors import IntegrityError, LimitError, ProtocolError, WeightSyncError
from protocol.wire.checksum import checksum
from protocol.wire.dtypes import dtype_code
from protocol.wire.framing import (
    BufferSpec,
    Encoding,
    Message,
    MessageType,
    Role,
    ValueEncoding,
    decode_message,
    encode_message,
)
from protocol.wire.span import Span
from receiver.apply import checks
from receiver.apply.checks import MAX_SPANS

CPU = torch.device("cpu")
Targets = dict[int, tuple[tuple[int, ...], torch.dtype]]


def message(entries: list[EncodedTensor], mtype: MessageType = MessageType.PATCH) -> list[bytes]:
    tensors, payload = assemble(entries)
    msg = Message(mtype, session="s", seq=1, version=2, base_version=1, tensors=tensors, frames=payload)
    return [bytes(f) for f in encode_message(msg)]


def decode_all(frames: list[bytes], targets: Targets) -> list:
    """What a receiver does with a message: parse and validate it, then decode every entry
    (and read the verdicts of the device-coded ones as the receiver does: ``coded.judged``)."""
    msg = decode_message(frames)
    out = []
    for entry in msg.tensors:
        if entry.key not in targets:
            raise AssertionError(f"decoded an entry for unknown key {entry.key}")
        shape, dtype = targets[entry.key]
        out.append(decode_entry(entry, msg.frames, shape, dtype, CPU))
    judged(out, targets)
    return out



@contextlib.contextmanager
def bounded_memory(limit: int = 256 << 20) -> Iterator[None]:
    """Hostile sizes must be rejected before anything is allocated from them: the peak
    resident memory of this process may not grow by more than ``limit`` bytes."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert grown < limit, f"peak memory grew by {grown} bytes"

def mutate(frames: list[bytes], edit: Callable[[dict], None]) -> list[bytes]:
    """``frames`` with the header edited and re-checksummed: only semantic checks can catch it."""
    header = header_of(frames)
    edit(header)
    return [reseal(header), *frames[1:]]


def sparse(key: int, shape: tuple[int, ...], dtype: torch.dtype, flat: list[int], options: PatchOptions) -> EncodedTensor:
    gen = torch.Generator().manual_seed(key)
    n = len(flat)
    new = torch.randn(n, generator=gen).to(dtype)
    old = torch.randn(n, generator=gen).to(dtype)
    return encode_sparse(key, torch.tensor(flat), new, old, shape, options)


def small_message() -> tuple[list[bytes], Targets]:
    entries = [
        sparse(0, (3, 5), torch.float32, [1, 7, 14], PatchOptions(Encoding.GAPS, ValueEncoding.RAW)),
        sparse(1, (4, 6), torch.bfloat16, [0, 5, 6, 23], PatchOptions(Encoding.COO_DELTA, ValueEncoding.XOR)),
        sparse(2, (2, 2, 3), torch.float16, [2, 11], PatchOptions(Encoding.BITMAP, ValueEncoding.XOR)),
        encode_dense(3, torch.tensor([7, -1], dtype=torch.int64), Codec.NONE),
        encode_dense(4, torch.zeros(64), Codec.LZ4),  # a compressed frame
    ]
    assert entries[4].buffers[0][0].codec is Codec.LZ4
    targets = {0: ((3, 5), torch.float32), 1: ((4, 6), torch.bfloat16), 2: ((2, 2, 3), torch.float16),
               3: ((2,), torch.int64), 4: ((64,), torch.float32)}
    return message(entries), targets


def big_message() -> tuple[list[bytes], Targets]:
    entries = [
        sparse(0, (64, 50), torch.float32, list(range(0, 3200, 3)), PatchOptions(Encoding.COO_DELTA, ValueEncoding.XOR, Codec.LZ4)),
        encode_dense(1, torch.arange(200, dtype=torch.bfloat16), Codec.ZSTD),
        sparse(2, (100,), torch.float16, list(range(0, 100, 7)), PatchOptions(Encoding.BITMAP, ValueEncoding.RAW, Codec.ZSTD)),
        ulp_sparse(3, (40, 50), list(range(0, 2000, 3))),  # entropy-coded positions and values
    ]
    targets = {0: ((64, 50), torch.float32), 1: ((200,), torch.bfloat16), 2: ((100,), torch.float16), 3: ((40, 50), torch.bfloat16)}
    return message(entries), targets


def ulp_sparse(key: int, shape: tuple[int, ...], flat: list[int]) -> EncodedTensor:
    """bf16 changes of one or two ulps: what ANS_GAPS + ULP encode in the wild."""
    gen = torch.Generator().manual_seed(key)
    old = torch.randn(len(flat), generator=gen).to(torch.bfloat16)
    step = torch.randint(1, 3, (len(flat),), generator=gen, dtype=torch.int16)
    new = (old.view(torch.int16) + step).view(torch.bfloat16)
    entry = encode_sparse(key, torch.tensor(flat), new, old, shape, PatchOptions(Encoding.ANS_GAPS, ValueEncoding.ULP))
    assert entry.values is ValueEncoding.ULP
    return entry


def same(a: list, b: list) -> bool:
    def key(d):
        return (d.key, None if d.flat is None else d.flat.tolist(), d.values.dtype, d.values.contiguous().view(torch.uint8).tolist())
    return [key(d) for d in a] == [key(d) for d in b]


def check_rejected(frames: list[bytes], targets: Targets, baseline: list, original: list[bytes] | None = None) -> str | None:
    """None when decoding raises a WeightSyncError, or when the flip changed no information:
    the header unpacks to exactly what it was (msgpack has several encodings of one integer,
    e.g. uint16 0xcd and int16 0xd1 of 1067) and the update is the same. Otherwise what went wrong."""
    try:
        got = decode_all(frames, targets)
    except WeightSyncError:
        return None
    except Exception as e:  # the point is to catch anything untyped
        return f"raised {type(e).__name__}: {e}"
    if not same(got, baseline):
        return "decoded to a DIFFERENT update"
    if original is not None and frames[1:] == original[1:] and _unpacked(frames[0]) == _unpacked(original[0]):
        return None  # the same message, spelled another way
    return "decoded to the same update without error"


def _unpacked(header: bytes) -> object:
    return msgpack.unpackb(header, raw=True, strict_map_key=False)


def expect_protocol_error(frames: list[bytes], targets: Targets | None = None) -> ProtocolError:
    with bounded_memory():
        with pytest.raises(ProtocolError) as err:
            decode_all(frames, targets or {})
    return err.value


# --------------------------------------------------------------------------- byte flips


def test_baselines_decode():
    for frames, targets in (small_message(), big_message()):
        assert len(decode_all(frames, targets)) == len(targets)


def test_every_single_byte_flip_is_rejected():
    frames, targets = small_message()
    baseline = decode_all(frames, targets)
    failures = []
    for i, frame in enumerate(frames):
        for pos in range(len(frame)):
            for mask in (0x01, 0x80, 0xFF):
                bad = bytearray(frame)
                bad[pos] ^= mask
                problem = check_rejected([*frames[:i], bytes(bad), *frames[i + 1:]], targets, baseline)
                if problem:
                    failures.append(f"frame {i} byte {pos} ^{mask:#x}: {problem}")
    assert sum(len(f) for f in frames) > 200
    assert not failures, "\n".join(failures[:20])


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_sampled_byte_flips_in_a_big_message_are_rejected(data):
    frames, targets = BIG
    i = data.draw(st.sampled_from([j for j, f in enumerate(frames) if f]))  # empty frames have no byte to flip
    pos = data.draw(st.integers(0, len(frames[i]) - 1))
    mask = data.draw(st.integers(1, 255))
    bad = bytearray(frames[i])
    bad[pos] ^= mask
    assert check_rejected([*frames[:i], bytes(bad), *frames[i + 1:]], targets, BIG_BASELINE, frames) is None


BIG = big_message()
BIG_BASELINE = decode_all(*BIG)


# --------------------------------------------------------------------------- frames


def test_truncated_and_extended_frames():
    frames, targets = small_message()
    for i, frame in enumerate(frames):
        for bad in (frame[:-1], frame[: len(frame) // 2], b"", frame + b"\x00"):
            with pytest.raises(ProtocolError):
                decode_all([*frames[:i], bad, *frames[i + 1:]], targets)


def test_missing_frames():
    frames, targets = small_message()
    for i in range(1, len(frames)):
        with pytest.raises(ProtocolError, match="payload frames"):
            decode_all(frames[:i] + frames[i + 1:], targets)
    with pytest.raises(ProtocolError):
        decode_all(frames[1:], targets)  # no header
    with pytest.raises(ProtocolError):
        decode_all(frames[:1], targets)  # header only


def test_extra_frames():
    frames, targets = small_message()
    for extra in (b"", frames[1], b"\x00" * 16):
        with pytest.raises(ProtocolError, match="payload frames"):
            decode_all([*frames, extra], targets)


def test_swapped_frames():
    frames, targets = small_message()
    baseline = decode_all(frames, targets)
    failures = []
    for i in range(len(frames)):
        for j in range(i + 1, len(frames)):
            if frames[i] == frames[j]:
                continue
            swapped = list(frames)
            swapped[i], swapped[j] = swapped[j], swapped[i]
            problem = check_rejected(swapped, targets, baseline)
            if problem:
                failures.append(f"frames {i}<->{j}: {problem}")
    assert not failures, "\n".join(failures)
    rotated = [*frames[1:], frames[0]]
    assert check_rejected(rotated, targets, baseline) is None


def test_equal_length_frames_swapped_fail_the_checksum():
    # COO rows and cols of the same length and dtype: sizes agree, only checksums can tell.
    entry = sparse(0, (8, 8), torch.float32, [1, 10, 20], PatchOptions(Encoding.COO, ValueEncoding.RAW))
    frames = message([entry])
    assert len(frames[1]) == len(frames[2]) and frames[1] != frames[2]
    with pytest.raises(IntegrityError):
        decode_message([frames[0], frames[2], frames[1], frames[3]])


def test_empty_message():
    with pytest.raises(ProtocolError, match="empty"):
        decode_message([])


@pytest.mark.parametrize(
    "header",
    [
        b"",
        b"\xc1",  # never used in msgpack
        b"\x92\x01",  # array of 2 with one element
        b"\x81\xa1a",  # map missing its value
        b"\xdd\xff\xff\xff\xff",  # array32 claiming 4G elements
        b"\xdb\xff\xff\xff\xff\x00",  # str32 claiming 4 GB
        b"\xc6\xff\xff\xff\xff\x00",  # bin32 claiming 4 GB
        b"\x91" * 100_000 + b"\xc0",  # nesting far past any sane depth
        b"\xff" * 64,
        b"\x80\x80",  # two maps: trailing data
    ],
)
def test_header_not_msgpack(header):
    with bounded_memory():
        with pytest.raises(ProtocolError):
            decode_message([header])


@pytest.mark.parametrize(
    "value",
    [[1, 2, 3], [], 7, "type", None, True, 1.5, b"bytes"],
    ids=["list", "empty-list", "int", "str", "nil", "bool", "float", "bin"],
)
def test_header_not_a_map(value):
    with pytest.raises(ProtocolError):
        decode_message([msgpack.packb(value, use_bin_type=True)])


def test_header_as_a_list_of_the_right_values():
    frames = message([])
    header = header_of(frames)
    with pytest.raises(ProtocolError):
        decode_message([msgpack.packb(list(header.values()), use_bin_type=True)])


def test_header_without_or_with_bad_checksum():
    header = header_of(message([]))
    del header["hsum"]
    with pytest.raises(ProtocolError, match="checksum"):
        decode_message([msgpack.packb(header)])
    for hsum in ("123", 1.0, None, True):
        header["hsum"] = hsum
        with pytest.raises(ProtocolError):
            decode_message([msgpack.packb(header)])


def test_header_with_non_string_keys():
    with pytest.raises(ProtocolError):
        decode_message([msgpack.packb({1: 2, "hsum": 0})])


@pytest.mark.parametrize("field", ["type", "proto", "session", "seq", "part", "last", "tensors", "body"])
def test_header_missing_field(field):
    frames = mutate(message([]), lambda h: h.pop(field))
    with pytest.raises(ProtocolError, match=repr(field)):
        decode_message(frames)


# --------------------------------------------------------------------------- manifest values


def spec_edit(tensor: int, buffer: int, index: int, value) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h["tensors"][tensor][4][buffer][index] = value
    return edit


def entry_edit(tensor: int, index: int, value) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h["tensors"][tensor][index] = value
    return edit


def field_edit(name: str, value) -> Callable[[dict], None]:
    def edit(h: dict) -> None:
        h[name] = value
    return edit


# buffer = [frame, role, dtype, shape, nbytes, codec, shuffle, wire_nbytes, checksum]
FRAME, ROLE, DTYPE, SHAPE, NBYTES, CODEC, SHUFFLE, WIRE, CSUM = range(9)
HOSTILE_EDITS = {
    # negative numbers
    "seq<0": field_edit("seq", -1),
    "part<0": field_edit("part", -1),
    "last=1": field_edit("last", 1),
    "key<0": entry_edit(0, 0, -1),
    "nnz<0": entry_edit(0, 3, -3),
    "frame<0": spec_edit(0, 0, FRAME, -1),
    "dim<0": spec_edit(0, 0, SHAPE, [-3]),
    "nbytes<0": spec_edit(0, 0, NBYTES, -3),
    "wire<0": spec_edit(0, 0, WIRE, -3),
    # wrong types
    "seq-str": field_edit("seq", "1"),
    "version-str": field_edit("version", "2"),
    "base-float": field_edit("base", 1.0),
    "session-int": field_edit("session", 5),
    "body-list": field_edit("body", []),
    "tensors-map": field_edit("tensors", {"0": 1}),
    "entry-not-list": field_edit("tensors", [5]),
    "entry-short": lambda h: h["tensors"][0].pop(),
    "buffers-nil": entry_edit(0, 4, None),
    "buffer-short": lambda h: h["tensors"][0][4][0].pop(),
    "key-str": entry_edit(0, 0, "0"),
    "key-bool": entry_edit(0, 0, False),
    "encoding-str": entry_edit(0, 1, "GAPS"),
    "encoding-unknown": entry_edit(0, 1, 9),
    "values-unknown": entry_edit(0, 2, 7),
    "nnz-float": entry_edit(0, 3, 3.0),
    "buffers-map": entry_edit(0, 4, {}),
    "buffer-not-list": entry_edit(0, 4, [7, 8]),
    "frame-str": spec_edit(0, 0, FRAME, "1"),
    "frame-float": spec_edit(0, 0, FRAME, 1.0),
    "frame-out-of-range": spec_edit(0, 0, FRAME, 99),
    "role-unknown": spec_edit(0, 0, ROLE, 9),
    "role-str": spec_edit(0, 0, ROLE, "values"),
    "dtype-str": spec_edit(0, 0, DTYPE, "float32"),
    "shape-str": spec_edit(0, 0, SHAPE, "3"),
    "shape-float-dim": spec_edit(0, 0, SHAPE, [3.0]),
    "shape-str-dim": spec_edit(0, 0, SHAPE, ["3"]),
    "shape-100-dims": spec_edit(0, 0, SHAPE, [3] + [1] * 99),  # sizes agree: only the dims limit refutes it
    "shape-9-dims": spec_edit(0, 0, SHAPE, [3] + [1] * 8),
    "nbytes-str": spec_edit(0, 0, NBYTES, "3"),
    "codec-unknown": spec_edit(0, 0, CODEC, 77),
    "codec-nil": spec_edit(0, 0, CODEC, None),
    "shuffle-int": spec_edit(0, 0, SHUFFLE, 1),
    "wire-bool": spec_edit(0, 0, WIRE, True),
    "checksum-str": spec_edit(0, 0, CSUM, "abc"),
    # dtype codes outside the allowlist
    "dtype-0": spec_edit(0, 0, DTYPE, 0),
    "dtype-16": spec_edit(0, 0, DTYPE, 16),
    "dtype-99": spec_edit(0, 0, DTYPE, 99),
    "dtype-neg": spec_edit(0, 0, DTYPE, -1),
    "dtype-2**32": spec_edit(0, 0, DTYPE, 2**32),
    "dtype-bool": spec_edit(0, 0, DTYPE, True),
    # sizes that do not add up
    "nbytes-off-by-one": spec_edit(0, 0, NBYTES, 4),
    "huge-nbytes": lambda h: (spec_edit(0, 0, SHAPE, [2**38])(h), spec_edit(0, 0, NBYTES, 2**40)(h)),
    "huge-wire": spec_edit(0, 0, WIRE, 2**40),
    "shape-overflow": lambda h: spec_edit(0, 0, SHAPE, [2**63, 2**63])(h),
    "duplicate-role": lambda h: h["tensors"][0][4].append(list(h["tensors"][0][4][0])),
    "duplicate-frame": spec_edit(0, 1, FRAME, 1),
    "last-not-bool": field_edit("last", "yes"),
    # grouped entries (a sixth item: the ordinals, the key first)
    "group-nil": lambda h: h["tensors"][0].append(None),
    "group-of-one": lambda h: h["tensors"][0].append([0]),
    "group-not-starting-with-key": lambda h: h["tensors"][0].append([1, 0]),
    "group-repeats-an-ordinal": lambda h: h["tensors"][0].append([0, 1, 1]),
    "group-negative-ordinal": lambda h: h["tensors"][0].append([0, -1]),
    "group-str-ordinal": lambda h: h["tensors"][0].append([0, "1"]),
    "group-bool-ordinal": lambda h: h["tensors"][0].append([0, True]),
    "entry-of-seven": lambda h: h["tensors"][0].extend([[0, 1], [2]]),
    # span entries (a last item {"s": [lo, hi]})
    "span-empty": lambda h: h["tensors"][0].append({"s": [3, 3]}),
    "span-reversed": lambda h: h["tensors"][0].append({"s": [9, 3]}),
    "span-negative": lambda h: h["tensors"][0].append({"s": [-1, 3]}),
    "span-str": lambda h: h["tensors"][0].append({"s": ["0", 3]}),
    "span-bool": lambda h: h["tensors"][0].append({"s": [False, 3]}),
    "span-float": lambda h: h["tensors"][0].append({"s": [0, 3.0]}),
    "span-of-three": lambda h: h["tensors"][0].append({"s": [0, 1, 2]}),
    "span-of-one": lambda h: h["tensors"][0].append({"s": [3]}),
    "span-nil": lambda h: h["tensors"][0].append({"s": None}),
    "span-under-another-key": lambda h: h["tensors"][0].append({"t": [0, 3]}),
    "span-with-another-key": lambda h: h["tensors"][0].append({"s": [0, 3], "x": 1}),
    "span-map-empty": lambda h: h["tensors"][0].append({}),
    "span-on-a-group": lambda h: h["tensors"][0].extend([[0, 1], {"s": [0, 3]}]),
    "span-before-a-group": lambda h: h["tensors"][0].extend([{"s": [0, 3]}, [0, 1]]),
    "two-spans": lambda h: h["tensors"][0].extend([{"s": [0, 3]}, {"s": [3, 6]}]),
}


@pytest.mark.parametrize("name", list(HOSTILE_EDITS))
def test_hostile_manifest_is_a_protocol_error(name):
    # One GAPS entry: buffer 0 is the positions (3 x uint8), buffer 1 the values (3 x float32).
    entry = sparse(0, (3, 5), torch.float32, [1, 7, 14], PatchOptions(Encoding.GAPS, ValueEncoding.RAW))
    frames = message([entry])
    assert len(frames) == 3 and len(frames[1]) == 3
    bad = mutate(frames, HOSTILE_EDITS[name])
    with bounded_memory():
        with pytest.raises(ProtocolError):  # structure, types and sizes: checked without the target
            decode_message(bad)


def test_a_group_longer_than_the_tensor_limit_is_a_limit_error():
    from protocol.errors import LimitError
    from protocol.wire.limits import Limits

    frames = message([sparse(0, (3, 5), torch.float32, [1, 7, 14], PatchOptions(Encoding.GAPS, ValueEncoding.RAW))])
    bad = mutate(frames, lambda h: h["tensors"][0].append(list(range(5))))
    with pytest.raises(LimitError, match="group size 5"):
        decode_message(bad, Limits(tensors=4))
    assert decode_message(mutate(frames, lambda h: h["tensors"][0].append(list(range(4)))), Limits(tensors=4)).tensors[0].group == (0, 1, 2, 3)


def test_huge_nbytes_behind_a_compressed_frame_is_refused_before_decompressing():
    """A compressed frame's announced size is only bounded by the target: 2**40 bytes must not be tried."""
    frames = message([encode_dense(0, torch.zeros(256), Codec.LZ4)])
    edit = lambda h: (spec_edit(0, 0, SHAPE, [2**38])(h), spec_edit(0, 0, NBYTES, 2**40)(h))  # noqa: E731
    bad = mutate(frames, edit)
    decode_message(bad)  # consistent with itself: only the target can bound it
    expect_protocol_error(bad, {0: ((256,), torch.float32)})
    # The same lie in a sparse entry's values and in each of its index buffers.
    flat = torch.arange(0, 3200, 2)
    ones = torch.ones(flat.numel())
    entry = encode_sparse(0, flat, ones, ones * 0, (64, 50), PatchOptions(Encoding.COO, ValueEncoding.RAW, Codec.LZ4))
    frames = message([entry])
    buffers = header_of(frames)["tensors"][0][4]
    assert [b[CODEC] for b in buffers] == [int(Codec.LZ4)] * 3
    for b, spec in enumerate(buffers):
        claim = 2**40 // (spec[NBYTES] // 1600)  # elements of 2**40 bytes in this buffer's dtype
        bad = mutate(frames, lambda h, b=b, claim=claim: (spec_edit(0, b, SHAPE, [claim])(h), spec_edit(0, b, NBYTES, 2**40)(h)))
        decode_message(bad)
        expect_protocol_error(bad, {0: ((64, 50), torch.float32)})


# --------------------------------------------------------------------------- adversarial but checksummed

U8 = torch.uint8


def crafted(encoding: Encoding, nnz: int, buffers: dict[Role, torch.Tensor], values: ValueEncoding = ValueEncoding.RAW,
            codec: Codec = Codec.NONE) -> list[bytes]:
    """A message built by the real packers: every size and checksum is consistent."""
    return message([pack_entry(0, encoding, values, nnz, buffers, codec)])


def vals(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(1, n + 1).to(dtype)


def u8(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=U8)


ADVERSARIAL = {
    # COO on a 4 x 10 view
    "coo-row-oob": (Encoding.COO, 2, {Role.ROWS: u8(0, 4), Role.COLS: u8(1, 2), Role.VALUES: vals(2)}),
    "coo-col-oob": (Encoding.COO, 2, {Role.ROWS: u8(0, 1), Role.COLS: u8(1, 10), Role.VALUES: vals(2)}),
    "coo-repeated": (Encoding.COO, 2, {Role.ROWS: u8(1, 1), Role.COLS: u8(2, 2), Role.VALUES: vals(2)}),
    "coo-decreasing-rows": (Encoding.COO, 2, {Role.ROWS: u8(2, 1), Role.COLS: u8(0, 0), Role.VALUES: vals(2)}),
    "coo-decreasing-cols": (Encoding.COO, 2, {Role.ROWS: u8(1, 1), Role.COLS: u8(5, 2), Role.VALUES: vals(2)}),
    "coo-signed-index": (Encoding.COO, 2, {Role.ROWS: torch.tensor([0, 1], dtype=torch.int8), Role.COLS: u8(1, 2),
                                           Role.VALUES: vals(2)}),
    "coo-2d-index": (Encoding.COO, 2, {Role.ROWS: u8(0, 1).reshape(2, 1), Role.COLS: u8(1, 2), Role.VALUES: vals(2)}),
    "coo-short-cols": (Encoding.COO, 2, {Role.ROWS: u8(0, 1), Role.COLS: u8(1), Role.VALUES: vals(2)}),
    "coo-missing-cols": (Encoding.COO, 2, {Role.ROWS: u8(0, 1), Role.VALUES: vals(2)}),
    "coo-uint64-top-bit": (Encoding.COO, 1, {Role.ROWS: torch.tensor([-1], dtype=torch.int64).view(torch.uint64),
                                             Role.COLS: u8(1), Role.VALUES: vals(1)}),
    # COO_DELTA: each entry in range, the running sums not
    "delta-rows-sum-oob": (Encoding.COO_DELTA, 2, {Role.ROWS: u8(3, 3), Role.COLS: u8(0, 0), Role.VALUES: vals(2)}),
    "delta-cols-sum-oob": (Encoding.COO_DELTA, 2, {Role.ROWS: u8(0, 0), Role.COLS: u8(6, 6), Role.VALUES: vals(2)}),
    "delta-repeated": (Encoding.COO_DELTA, 2, {Role.ROWS: u8(1, 0), Role.COLS: u8(2, 0), Role.VALUES: vals(2)}),
    # GAPS on 40 elements
    "gaps-oob": (Encoding.GAPS, 1, {Role.POSITIONS: u8(40), Role.VALUES: vals(1)}),
    "gaps-sum-oob": (Encoding.GAPS, 2, {Role.POSITIONS: u8(20, 20), Role.VALUES: vals(2)}),
    "gaps-signed": (Encoding.GAPS, 2, {Role.POSITIONS: torch.tensor([1, 2], dtype=torch.int16), Role.VALUES: vals(2)}),
    "gaps-uint64-top-bit": (Encoding.GAPS, 1, {Role.POSITIONS: torch.tensor([-5], dtype=torch.int64).view(torch.uint64),
                                               Role.VALUES: vals(1)}),
    "gaps-longer-than-nnz": (Encoding.GAPS, 2, {Role.POSITIONS: u8(0, 0, 0), Role.VALUES: vals(2)}),
    "gaps-with-rows": (Encoding.GAPS, 1, {Role.ROWS: u8(0), Role.POSITIONS: u8(0), Role.VALUES: vals(1)}),
    # BITMAP on 40 elements: 5 bytes
    "bitmap-short": (Encoding.BITMAP, 1, {Role.POSITIONS: u8(1, 0, 0, 0), Role.VALUES: vals(1)}),
    "bitmap-long": (Encoding.BITMAP, 1, {Role.POSITIONS: u8(1, 0, 0, 0, 0, 0), Role.VALUES: vals(1)}),
    "bitmap-count": (Encoding.BITMAP, 3, {Role.POSITIONS: u8(3, 0, 0, 0, 0), Role.VALUES: vals(3)}),
    "bitmap-uint16": (Encoding.BITMAP, 1, {Role.POSITIONS: torch.tensor([1, 0, 0, 0, 0], dtype=torch.uint16),
                                           Role.VALUES: vals(1)}),
    # nnz
    "nnz-zero": (Encoding.GAPS, 0, {Role.POSITIONS: u8(), Role.VALUES: vals(0)}),
    "nnz-above-numel": (Encoding.GAPS, 41, {Role.POSITIONS: torch.zeros(41, dtype=U8), Role.VALUES: vals(41)}),
    "nnz-above-numel-bitmap": (Encoding.BITMAP, 41, {Role.POSITIONS: u8(255, 255, 255, 255, 255), Role.VALUES: vals(41)}),
    # values
    "values-dtype-raw": (Encoding.GAPS, 1, {Role.POSITIONS: u8(0), Role.VALUES: vals(1, torch.float16)}),
    "values-bits-as-raw": (Encoding.GAPS, 1, {Role.POSITIONS: u8(0), Role.VALUES: vals(1, torch.int32)}),
    "values-too-many": (Encoding.GAPS, 1, {Role.POSITIONS: u8(0), Role.VALUES: vals(2)}),
    "values-2d": (Encoding.GAPS, 2, {Role.POSITIONS: u8(0, 0), Role.VALUES: vals(2).reshape(2, 1)}),
    "values-missing": (Encoding.GAPS, 1, {Role.POSITIONS: u8(0)}),
}


@pytest.mark.parametrize("name", list(ADVERSARIAL))
def test_adversarial_sparse_entry_is_a_protocol_error(name):
    encoding, nnz, buffers = ADVERSARIAL[name]
    frames = crafted(encoding, nnz, buffers)
    decode_message(frames)  # well-formed and checksummed: only the target can refute it
    expect_protocol_error(frames, {0: ((4, 10), torch.float32)})


def test_bitmap_padding_bits_are_a_protocol_error():
    # 10 elements -> 2 bytes, bits 10..15 are padding.
    for pad_bit in range(10, 16):
        packed = u8(0b101, 1 << (pad_bit - 8))
        frames = crafted(Encoding.BITMAP, 3, {Role.POSITIONS: packed, Role.VALUES: vals(3)})
        with pytest.raises(ProtocolError, match="past the tensor"):
            decode_all(frames, {0: ((10,), torch.float32)})
    good = crafted(Encoding.BITMAP, 3, {Role.POSITIONS: u8(0b101, 0b10), Role.VALUES: vals(3)})
    assert decode_all(good, {0: ((10,), torch.float32)})[0].flat.tolist() == [0, 2, 9]


@pytest.mark.parametrize(
    ("values", "dtype", "target"),
    [
        (ValueEncoding.XOR, torch.int32, torch.bfloat16),  # bf16 XOR bits are int16
        (ValueEncoding.XOR, torch.float32, torch.float32),  # XOR bits must be integers
        (ValueEncoding.RAW, torch.int16, torch.bfloat16),
        (ValueEncoding.RAW, torch.float32, torch.int64),
        (ValueEncoding.XOR, torch.int32, torch.int64),
    ],
)
def test_values_of_the_wrong_dtype(values, dtype, target):
    frames = crafted(Encoding.GAPS, 2, {Role.POSITIONS: u8(0, 3), Role.VALUES: vals(2, dtype)}, values)
    expect_protocol_error(frames, {0: ((10,), target)})


def test_adversarial_dense_entries():
    target = {0: ((4, 10), torch.float32)}
    cases = [
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 40, {Role.VALUES: torch.zeros(40)}, Codec.NONE),  # flat shape
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 40, {Role.VALUES: torch.zeros(4, 10, dtype=torch.float64)}, Codec.NONE),
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 40, {Role.VALUES: torch.zeros(4, 10, dtype=torch.int32)}, Codec.NONE),
        pack_entry(0, Encoding.DENSE, ValueEncoding.XOR, 40, {Role.VALUES: torch.zeros(4, 10)}, Codec.NONE),
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 39, {Role.VALUES: torch.zeros(4, 10)}, Codec.NONE),
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 40, {Role.VALUES: torch.zeros(4, 10), Role.POSITIONS: u8(0)}, Codec.NONE),
        pack_entry(0, Encoding.DENSE, ValueEncoding.RAW, 40, {Role.VALUES: torch.zeros(4, 11)}, Codec.NONE),
    ]
    for entry in cases:
        expect_protocol_error(message([entry]), target)
    # float -> float conversion is only for buckets (exact_dtype=False), never into integers
    msg = decode_message(message([cases[1]]))
    assert decode_entry(msg.tensors[0], msg.frames, (4, 10), torch.float32, CPU, exact_dtype=False).values.dtype == torch.float64
    msg = decode_message(message([cases[2]]))
    with pytest.raises(ProtocolError):
        decode_entry(msg.tensors[0], msg.frames, (4, 10), torch.float32, CPU, exact_dtype=False)


def lying_entry(codec: Codec, wire: bytes, nbytes: int) -> EncodedTensor:
    """A dense float32 entry whose frame is ``wire`` and whose header says it decodes to ``nbytes``."""
    spec = BufferSpec(0, Role.VALUES, dtype_code(torch.float32), (nbytes // 4,), nbytes, codec, False, len(wire), checksum(wire))
    return EncodedTensor(0, Encoding.DENSE, ValueEncoding.RAW, nbytes // 4, [(spec, wire)])


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
def test_compressed_frame_that_decodes_to_another_size(codec):
    wire = bytes(compress(torch.zeros(400, dtype=U8), codec))  # 400 bytes = 100 floats
    for announced in (396, 404, 4000):
        frames = message([lying_entry(codec, wire, announced)])
        with pytest.raises(IntegrityError):
            decode_all(frames, {0: ((announced // 4,), torch.float32)})


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
def test_compressed_frame_of_garbage(codec):
    frames = message([lying_entry(codec, b"\x00\xff" * 20 + b"garbage!", 400)])
    with pytest.raises(IntegrityError):
        decode_all(frames, {0: ((100,), torch.float32)})


def test_zstd_bomb_is_bounded_by_the_announced_size():
    wire = bytes(compress(torch.zeros(64 << 20, dtype=U8), Codec.ZSTD))  # 64 MiB of zeros, a few KiB on the wire
    assert len(wire) < 64 << 10
    frames = message([lying_entry(Codec.ZSTD, wire, 400)])
    with bounded_memory():
        with pytest.raises(IntegrityError):
            decode_all(frames, {0: ((100,), torch.float32)})


def test_gpu_codec_on_a_cpu_receiver_is_a_typed_error():
    wire = b"\x00" * 16
    spec = BufferSpec(0, Role.VALUES, dtype_code(torch.float32), (100,), 400, Codec.NVCOMP_LZ4, False, len(wire), checksum(wire))
    frames = message([EncodedTensor(0, Encoding.DENSE, ValueEncoding.RAW, 100, [(spec, wire)])])
    with pytest.raises(WeightSyncError):
        decode_all(frames, {0: ((100,), torch.float32)})


@pytest.mark.parametrize("values", [ValueEncoding.RAW, ValueEncoding.XOR, ValueEncoding.ULP])
def test_bool_tensor_never_gets_bytes_other_than_0_and_1(values: ValueEncoding) -> None:
    """Raw, XOR and ulp values can all make a bool byte 2..255, which torch would hold as an
    invalid bool: refused while staging, before anything is written."""
    from receiver.apply.commit import StagedUpdate

    target = torch.zeros(4096, dtype=torch.bool)
    flat = torch.arange(0, 4096, 4)
    new = torch.full((flat.numel(),), 2, dtype=torch.uint8).view(torch.bool)  # byte 2: not a bool
    old = torch.zeros(flat.numel(), dtype=torch.bool)
    entry = encode_sparse(0, flat, new, old, (4096,), PatchOptions(Encoding.GAPS, values))
    specs, frames = assemble([entry])
    decoded = decode_entry(specs[0], frames, (4096,), torch.bool, torch.device("cpu"))
    with pytest.raises(ProtocolError, match="bool"):
        StagedUpdate.stage(decoded, target)
    assert not target.any()


# --------------------------------------------------------------------------- device-coded entries

BF16 = torch.bfloat16
DEVICE_TARGET = {0: ((50, 100), BF16)}


def blocks(payload: torch.Tensor, nnz: int, values: ValueEncoding = ValueEncoding.ULP) -> list[bytes]:
    """A message of one device-coded entry carrying ``payload`` as it is, framed by the real
    packers: the frame's size and checksum are right, so the decoder must judge it."""
    return message([pack_entry(0, Encoding.BLOCKS, values, nnz, {Role.VALUES: payload}, Codec.NONE)])


def device_changes(flat: list[int], seed: int = 0) -> torch.Tensor:
    """The device codec's payload of bf16 changes at ``flat`` (coded faithfully, valid or not)."""
    gen = torch.Generator().manual_seed(seed)
    old = torch.randn(len(flat), generator=gen).to(BF16)
    new = (old.view(torch.int16) + torch.randint(1, 4, (len(flat),), generator=gen, dtype=torch.int16)).view(BF16)
    return devicecodec.encode(torch.tensor(flat, dtype=torch.int64), new, old).payload


VALID_FLAT = sorted(set(range(0, 5000, 7)) | {1, 2, 4999})


def resealed(payload: torch.Tensor) -> torch.Tensor:
    """``payload`` with its own checksum recomputed: what is wrong must be found by the rest."""
    devicecodec.seal(payload)
    return payload


def lying_widths() -> torch.Tensor:
    payload = device_changes(VALID_FLAT)
    payload[devicecodec.HEADER + 1] = 64  # the second block's gap width: far past what 5000 elements need
    return resealed(payload)


def a_flipped_byte(at: int) -> torch.Tensor:
    payload = device_changes(VALID_FLAT)
    payload[at] ^= 0x5A
    return payload


def compressed_blocks(codec: Codec) -> list[bytes]:
    """A valid device payload, compressed (which no sender does: the wire says never) and
    framed with a right checksum: refused by its codec before anything decompresses it (so
    nvCOMP's label, on LZ4's bytes, needs no GPU here)."""
    payload = device_changes(VALID_FLAT)
    wire = compress(payload, Codec.LZ4)
    spec = BufferSpec(0, Role.VALUES, dtype_code(U8), (payload.numel(),), payload.numel(), codec, False, len(wire), checksum(wire))
    return message([EncodedTensor(0, Encoding.BLOCKS, ValueEncoding.ULP, len(VALID_FLAT), [(spec, wire)])])


VALID_NNZ = len(VALID_FLAT)
DEVICE_HOSTILE: dict[str, tuple[Callable[[], list[bytes]], type[WeightSyncError]]] = {
    "out-of-range": (lambda: blocks(device_changes([3, 70, 4999, 5000]), 4), ProtocolError),
    "far-out-of-range": (lambda: blocks(device_changes([3, 70, 2**40]), 3), ProtocolError),
    "repeated": (lambda: blocks(device_changes([3, 3, 70]), 3), ProtocolError),
    "decreasing": (lambda: blocks(device_changes([70, 3, 1]), 3), ProtocolError),
    "negative": (lambda: blocks(device_changes([-1, 3, 70]), 3), ProtocolError),
    "truncated": (lambda: blocks(device_changes(VALID_FLAT)[:-3].clone(), VALID_NNZ), IntegrityError),
    "truncated-resealed": (lambda: blocks(resealed(device_changes(VALID_FLAT)[:-3].clone()), VALID_NNZ), ProtocolError),
    "truncated-to-its-table": (lambda: blocks(device_changes(VALID_FLAT)[: devicecodec.min_nbytes(VALID_NNZ) - 1].clone(), VALID_NNZ), ProtocolError),
    "extended-resealed": (lambda: blocks(resealed(torch.cat([device_changes(VALID_FLAT), torch.zeros(9, dtype=U8)])), VALID_NNZ), ProtocolError),
    "lying-widths": (lambda: blocks(lying_widths(), VALID_NNZ), ProtocolError),
    "bad-checksum": (lambda: blocks(a_flipped_byte(3), VALID_NNZ), IntegrityError),
    "a-stream-byte-unsealed": (lambda: blocks(a_flipped_byte(-5), VALID_NNZ), IntegrityError),
    "lying-nnz": (lambda: blocks(device_changes(VALID_FLAT), VALID_NNZ + 1), ProtocolError),
    "another-dtype": (lambda: blocks(devicecodec.encode(torch.tensor([1, 2]), torch.ones(2), torch.zeros(2)).payload, 2), ProtocolError),
    "not-ulp": (lambda: blocks(device_changes(VALID_FLAT), VALID_NNZ, ValueEncoding.RAW), ProtocolError),
    "past-the-bound": (lambda: blocks(torch.zeros(devicecodec.max_nbytes(1, 5000, BF16) + 1, dtype=U8), 1), ProtocolError),
    "compressed-lz4": (lambda: compressed_blocks(Codec.LZ4), ProtocolError),
    "compressed-nvcomp": (lambda: compressed_blocks(Codec.NVCOMP_LZ4), ProtocolError),
}


@pytest.mark.parametrize("name", list(DEVICE_HOSTILE))
def test_hostile_device_coded_entries_are_typed_errors(name: str) -> None:
    """Out-of-range and non-increasing positions, truncated or extended payloads, lying
    widths or nnz, a bad checksum: framed with valid frame checksums, so the device
    decoder's verdict (or the entry's size rules), not the framing, must refuse them."""
    build, error = DEVICE_HOSTILE[name]
    frames = build()
    decode_message(frames)  # well-formed and checksummed as a frame
    with bounded_memory(), pytest.raises(error) as caught:
        decode_all(frames, DEVICE_TARGET)
    assert type(caught.value) is error, repr(caught.value)  # exactly: a damaged checksum is not a refused structure
    assert decode_all(blocks(device_changes(VALID_FLAT), VALID_NNZ), DEVICE_TARGET)[0].flat.tolist() == VALID_FLAT


@pytest.mark.parametrize("name", ["out-of-range", "decreasing", "truncated", "lying-widths", "bad-checksum"])
async def test_a_hostile_device_coded_patch_leaves_the_receiver_untouched(name: str) -> None:
    """The same payloads in a PATCH to a real receiver at its base version, beside a valid
    device-coded entry: a typed error, no tensor written, the version unchanged."""
    config = {"type": "patch", "patch": {"codec": "device", "group_numel": 0}}
    gen = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(50, 100, generator=gen).to(BF16), "b": torch.randn(300, generator=gen).to(BF16)}
    model = {k: torch.zeros_like(v) for k, v in state.items()}
    s, r = sender.make_sender(config), receiver.make_receiver(config)
    ch = Channel()
    await asyncio.wait_for(
        asyncio.gather(s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv, version=0),
                       r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send)),
        timeout=60,
    )
    before = {k: v.clone() for k, v in model.items()}
    hostile = decode_message(DEVICE_HOSTILE[name][0]())
    old = model["b"][::3].clone()
    good = encode_sparse(1, torch.arange(0, 300, 3), (old.view(torch.int16) + 1).view(BF16), old, (300,), PatchOptions(device_codec=True))
    specs, frames = assemble([good])
    entries = [*specs, dataclasses.replace(hostile.tensors[0], buffers=tuple(
        dataclasses.replace(b, frame=b.frame + len(frames)) for b in hostile.tensors[0].buffers))]
    patch = Message(MessageType.PATCH, session=r.session, seq=99, version=1, base_version=0, tensors=entries,
                        frames=[*frames, *hostile.frames])
    wire = [bytes(f) for f in encode_message(patch)]

    async def recv() -> list[bytes]:
        return wire

    with pytest.raises(DEVICE_HOSTILE[name][1]):
        await r.apply(model, recv)
    assert r.version == 0 and not r.torn
    assert all(torch.equal(model[k].view(torch.int16), before[k].view(torch.int16)) for k in model)


# --------------------------------------------------------------------------- span entries (protocols 6 and 7)

SPAN_NUMEL = 5000  # tensor 0: bf16 (50, 100); tensor 1: bf16 (300,)


def span_of(lo: int, hi: int, options: PatchOptions | None = None, key: int = 0, every: int = 7) -> EncodedTensor:
    """Changes at every ``every``-th element of [lo, hi) of tensor ``key``, a span entry of
    them (one-ulp moves of made-up old values: what they are relative to is not the point)."""
    local = torch.arange(0, hi - lo, every)
    gen = torch.Generator().manual_seed(lo)
    old = torch.randn(local.numel(), generator=gen).to(BF16)
    new = (old.view(torch.int16) + 1).view(BF16)
    return encode_span(key, Span.range(lo, hi), local, new, old, options or PatchOptions(dense_above=1.0, device_codec=False))


def columns_of(c0: int, c1: int, options: PatchOptions | None = None, every: int = 7, rows: int = 50) -> EncodedTensor:
    """Changes at every ``every``-th element of columns [c0, c1) of the first ``rows`` rows of
    tensor 0 (bf16 (50, 100)): a strided span entry, as a tensor-parallel rank holding that
    column block would send it."""
    span = Span(c0, c1 - c0, rows, 100)
    local = torch.arange(0, span.numel, every)
    gen = torch.Generator().manual_seed(c0)
    old = torch.randn(local.numel(), generator=gen).to(BF16)
    new = (old.view(torch.int16) + 1).view(BF16)
    return encode_span(0, span, local, new, old, options or PatchOptions(dense_above=1.0, device_codec=False))


class RawSpan:
    """A span entry's wire form as a hostile sender writes it (a ``Span`` refuses to be one)."""

    def __init__(self, *raw: int) -> None:
        self.raw = list(raw)

    def to_wire(self) -> list[int]:
        return self.raw


def many_spans(count: int) -> list[list[EncodedTensor]]:
    """``count`` one-element spans of tensor 0, every fourth element, in four parts."""
    entries = [encode_dense_span(0, Span.range(4 * i, 4 * i + 1), torch.ones(1, dtype=BF16), Codec.NONE) for i in range(count)]
    return [entries[i::4] for i in range(4)]


def whole_of(key: int = 0, numel: int = SPAN_NUMEL) -> EncodedTensor:
    flat = torch.arange(0, numel, 11)
    old = torch.zeros(flat.numel(), dtype=BF16)
    shape = (numel,) if key else (50, 100)
    return encode_sparse(key, flat, torch.ones(flat.numel(), dtype=BF16), old, shape, PatchOptions(Encoding.GAPS, ValueEncoding.RAW))


def spanned(entry: EncodedTensor, **change: Any) -> EncodedTensor:
    return dataclasses.replace(entry, **change)


def flipped_device_span() -> EncodedTensor:
    entry = span_of(1000, 3000, PatchOptions(dense_above=1.0, device_codec=True))
    (spec, wire), = entry.buffers
    payload = bytearray(wire)
    payload[3] ^= 0x5A  # inside the device payload's own checksum: the frame's is recomputed
    data = bytes(payload)
    return spanned(entry, buffers=[(dataclasses.replace(spec, checksum=checksum(data)), data)])


GAPS_RAW = PatchOptions(Encoding.GAPS, ValueEncoding.RAW, dense_above=1.0)
DEVICE_SPAN = PatchOptions(dense_above=1.0, device_codec=True)
# name -> (the version's parts after a good entry for tensor 1, the message type, the error)
SPAN_HOSTILE: dict[str, tuple[Callable[[], list[list[EncodedTensor]]], MessageType, type[WeightSyncError]]] = {
    "overlapping": (lambda: [[span_of(0, 3000), span_of(2000, 5000)]], MessageType.PATCH, ProtocolError),
    "overlapping-descending": (lambda: [[span_of(3000, 5000), span_of(0, 3001)]], MessageType.PATCH, ProtocolError),
    "the-same-span-twice": (lambda: [[span_of(0, 3000), span_of(0, 3000)]], MessageType.PATCH, ProtocolError),
    "overlapping-across-parts": (lambda: [[span_of(0, 3000)], [span_of(2999, 5000)]], MessageType.PATCH, ProtocolError),
    "inside-an-earlier-across-parts": (lambda: [[span_of(1000, 4000)], [span_of(2000, 2100, DEVICE_SPAN)]], MessageType.PATCH, ProtocolError),
    "out-of-range": (lambda: [[span_of(4000, 5001)]], MessageType.PATCH, ProtocolError),
    "out-of-range-in-a-later-part": (lambda: [[span_of(0, 3000)], [spanned(span_of(3000, 5000), span=Span.range(3000, 2**40))]],
                                     MessageType.PATCH, ProtocolError),
    "empty": (lambda: [[spanned(span_of(7, 100), span=RawSpan(7, 7))]], MessageType.PATCH, ProtocolError),
    "reversed": (lambda: [[spanned(span_of(7, 100), span=RawSpan(100, 7))]], MessageType.PATCH, ProtocolError),
    "negative": (lambda: [[spanned(span_of(0, 100), span=RawSpan(-1, 99))]], MessageType.PATCH, ProtocolError),
    # strided spans (protocol 7): column blocks of tensor 0, (50, 100)
    "columns-overlapping-columns": (lambda: [[columns_of(0, 60), columns_of(50, 100)]], MessageType.PATCH, ProtocolError),
    "columns-overlapping-later-columns": (lambda: [[columns_of(50, 100)], [columns_of(0, 51, DEVICE_SPAN)]], MessageType.PATCH, ProtocolError),
    "columns-overlapping-a-range": (lambda: [[columns_of(0, 50)], [span_of(4940, 4941)]], MessageType.PATCH, ProtocolError),
    "a-range-inside-later-columns": (lambda: [[span_of(120, 130)], [columns_of(0, 50, rows=2)]], MessageType.PATCH, ProtocolError),
    "columns-runs-not-ending-at-hi": (lambda: [[spanned(columns_of(0, 50), span=RawSpan(0, 4940, 50, 100))]], MessageType.PATCH, ProtocolError),
    "columns-stride-below-length": (lambda: [[spanned(columns_of(0, 50), span=RawSpan(0, 2500, 100, 50))]], MessageType.PATCH, ProtocolError),
    "columns-of-one-run-in-four-items": (lambda: [[spanned(span_of(0, 50), span=RawSpan(0, 50, 50, 100))]], MessageType.PATCH, ProtocolError),
    "columns-past-numel": (lambda: [[spanned(columns_of(0, 50), span=Span(60, 50, 50, 100))]], MessageType.PATCH, ProtocolError),
    "columns-positions-past-the-span": (lambda: [[spanned(columns_of(0, 60), span=Span(0, 50, 50, 100))]], MessageType.PATCH, ProtocolError),
    "columns-device-positions-past-the-span": (lambda: [[spanned(columns_of(0, 60, DEVICE_SPAN), span=Span(0, 50, 50, 100))]],
                                               MessageType.PATCH, ProtocolError),
    "columns-dense-values-not-the-span": (
        lambda: [[spanned(encode_dense_span(0, Span(0, 60, 50, 100), torch.ones(3000, dtype=BF16), Codec.NONE), span=Span(0, 50, 50, 100))]],
        MessageType.PATCH, ProtocolError),
    "columns-in-a-bootstrap": (lambda: [[encode_dense_span(0, Span(0, 50, 50, 100), torch.ones(2500, dtype=BF16), Codec.NONE)]],
                               MessageType.BOOTSTRAP, ProtocolError),
    "too-many-spans-of-a-tensor": (lambda: many_spans(MAX_SPANS + 1), MessageType.PATCH, LimitError),
    "on-a-group": (lambda: [[spanned(span_of(0, 100), group=(0, 1))]], MessageType.PATCH, ProtocolError),
    "spanless-then-span": (lambda: [[whole_of(), span_of(0, 3000)]], MessageType.PATCH, ProtocolError),
    "span-then-spanless": (lambda: [[span_of(0, 3000)], [whole_of()]], MessageType.PATCH, ProtocolError),
    "span-beside-its-group": (lambda: [[span_of(0, 3000)], [spanned(whole_of(1, 300), key=0, group=(0, 1))]], MessageType.PATCH, ProtocolError),
    "dense-beyond-numel": (lambda: [[encode_dense_span(0, Span.range(4900, 5100), torch.ones(200, dtype=BF16), Codec.NONE)]],
                           MessageType.PATCH, ProtocolError),
    "dense-values-not-the-span": (
        lambda: [[spanned(encode_dense_span(0, Span.range(0, 100), torch.ones(100, dtype=BF16), Codec.NONE), span=Span.range(0, 50))]],
        MessageType.PATCH, ProtocolError),
    "packed-positions-past-the-span": (lambda: [[spanned(span_of(1000, 1200, every=3), span=Span.range(1000, 1100))]],
                                       MessageType.PATCH, ProtocolError),
    "bitmap-positions-past-the-span": (lambda: [[spanned(span_of(1000, 1200), span=Span.range(1000, 1100))]], MessageType.PATCH, ProtocolError),
    "gaps-positions-past-the-span": (lambda: [[spanned(span_of(1000, 1200, GAPS_RAW), span=Span.range(1000, 1100))]],
                                     MessageType.PATCH, ProtocolError),
    "device-positions-past-the-span": (lambda: [[spanned(span_of(1000, 1200, DEVICE_SPAN), span=Span.range(1000, 1100))]],
                                       MessageType.PATCH, ProtocolError),
    "device-checksum": (lambda: [[span_of(0, 1000), flipped_device_span()]], MessageType.PATCH, IntegrityError),
    "in-a-bootstrap": (lambda: [[encode_dense_span(0, Span.range(0, 100), torch.ones(100, dtype=BF16), Codec.NONE)]],
                       MessageType.BOOTSTRAP, ProtocolError),
}


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
async def test_interleaved_spans_past_the_work_bound_are_refused(staged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Disjoint column blocks arriving in descending order each test every earlier one: past
    the version's bound on those tests (made small here) a ``LimitError``, nothing written;
    the same blocks within it apply."""
    monkeypatch.setattr(checks, "MAX_SPAN_WORK", 40)
    monkeypatch.setattr(checks, "SPAN_WORK_PER_SPAN", 1)  # 40 tests, and one more a span claimed
    r, model = await span_receiver(staged)
    before = {k: v.clone() for k, v in model.items()}
    blocks = [[columns_of(c, c + 5, every=3)] for c in range(95, -1, -5)]  # 20 blocks, descending: 190 tests
    with pytest.raises(LimitError):
        await r.apply(model, recv_of(frames_of(r, blocks)))
    assert r.version == 0 and not r.torn
    assert all(torch.equal(model[k].view(torch.int16), before[k].view(torch.int16)) for k in model)
    assert await r.apply(model, recv_of(frames_of(r, blocks[:9]))) == 1  # 36 tests, 48 allowed
    assert not torch.equal(model["a"][:, 55:].view(torch.int16), before["a"][:, 55:].view(torch.int16))
    assert torch.equal(model["a"][:, :55].view(torch.int16), before["a"][:, :55].view(torch.int16))


async def span_receiver(staged: bool) -> tuple[Any, dict[str, torch.Tensor]]:
    """A patch receiver at v0 of two bf16 tensors (``SPAN_NUMEL`` and 300 elements)."""
    gen = torch.Generator().manual_seed(5)
    state = {"a": torch.randn(50, 100, generator=gen).to(BF16), "b": torch.randn(300, generator=gen).to(BF16)}
    model = {k: torch.zeros_like(v) for k, v in state.items()}
    return await at_base(state, model, staged), model


@pytest.mark.parametrize("staged", [False, True], ids=["frames", "staged"])
@pytest.mark.parametrize("name", list(SPAN_HOSTILE))
async def test_hostile_spans_write_nothing(name: str, staged: bool) -> None:
    """Overlapping spans (within a part and across parts, in either order), out-of-range,
    empty, negative spans; strided ones (column blocks) overlapping another's columns or a
    range, whose runs do not end at hi, whose stride is below their length, of one run in the
    four-item form, past the tensor, in a bootstrap; more spans of a tensor than a version
    may carry; a span on a group, a tensor in a whole entry and in span entries, a dense span
    past the tensor or of the wrong length, positions past a span's end (packed, raw gaps,
    device coded; of a column block too), a device payload's damaged checksum, a span in a
    bootstrap: after a good entry of the other tensor, framed with valid checksums, so the
    receiver's rules must refuse them: exactly that error, no tensor written, the version
    unchanged and unpublished; then a good split version (column blocks and a range, in
    descending order) still applies."""
    build, mtype, error = SPAN_HOSTILE[name]
    r, model = await span_receiver(staged)
    before = {k: v.clone() for k, v in model.items()}
    parts = build()
    parts[0] = [whole_of(1, 300), *parts[0]]
    with pytest.raises(WeightSyncError) as caught:
        await r.apply(model, recv_of(frames_of(r, parts, 1 if mtype is MessageType.PATCH else 5, mtype)))
    assert type(caught.value) is error, repr(caught.value)
    assert r.version == 0 and not r.torn
    assert all(torch.equal(model[k].view(torch.int16), before[k].view(torch.int16)) for k in model)
    # the genuine article: tensor 0 in three spans (a gap between two), over two parts, in
    # descending order: columns 30-99 (strided), row 0's columns 0-29 (a range), then rows
    # 1-39's columns 0-29 (strided); rows 40-49's columns 0-29 left out
    old = model["a"].reshape(-1)
    new = old.clone()
    new[::13] = (old[::13].view(torch.int16) + 3).view(BF16)
    spans = []
    plan = ((Span(30, 70, 50, 100), DEVICE_SPAN), (Span.range(0, 30), GAPS_RAW), (Span(100, 30, 39, 100), PatchOptions(dense_above=1.0)))
    for span, options in plan:
        mine_old, mine_new = span.of(old).reshape(-1), span.of(new).reshape(-1)
        local = torch.nonzero(mine_old.view(torch.int16) != mine_new.view(torch.int16)).squeeze(1)
        spans.append(encode_span(0, span, local, mine_new[local], mine_old[local], options))
    new.view(50, 100)[40:, :30] = before["a"][40:, :30]  # left out: unchanged
    assert await r.apply(model, recv_of(frames_of(r, [[whole_of(1, 300), spans[0]], spans[1:]]))) == 1
    assert torch.equal(model["a"].reshape(-1).view(torch.int16), new.view(torch.int16))
