"""Tensor codecs: bit-exact round trips through the real wire path, and the pieces they are built of.

The round trip is the receiver's path: encode_sparse / encode_dense -> assemble -> Message ->
encode_message -> bytes copies (as a socket delivers them) -> decode_message -> decode_entry ->
apply to a copy of the old tensor, which must then equal the new tensor bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.codec.compress import Codec, compress, decompress, parse_compression, shuffle, unshuffle
from protocol.codec.coo import coo_shape, delta_decode, delta_encode, split_rows_cols
from protocol.codec.positions import decode_positions, downscale, encode_positions
from protocol.codec.tensorcodec import (
    ZSTD_MIN_BYTES,
    DecodedTensor,
    PatchOptions,
    assemble,
    decode_entry,
    encode_dense,
    encode_sparse,
    pack_buffer,
    sparse_buffers,
)
from protocol.errors import ConfigError, ProtocolError
from protocol.wire.dtypes import bits_dtype, dtype_code, itemsize, smallest_unsigned
from protocol.wire.framing import Encoding, Message, MessageType, Role, ValueEncoding, decode_message, encode_message

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float8_e4m3fn]  # fp8: an fp8 rollout's weights
POSITIONS = [Encoding.COO, Encoding.COO_DELTA, Encoding.GAPS, Encoding.BITMAP, Encoding.ANS_GAPS, None]
VALUES = list(ValueEncoding)
CODECS = [Codec.NONE, Codec.LZ4, Codec.ZSTD]
POSITION_BUFFERS = {Encoding.DENSE: 0, Encoding.COO: 2, Encoding.COO_DELTA: 2, Encoding.GAPS: 1, Encoding.BITMAP: 1, Encoding.ANS_GAPS: 4}
VALUE_BUFFERS = {ValueEncoding.RAW: 1, ValueEncoding.XOR: 1, ValueEncoding.ULP: 3}
SPECIALS = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1.0, -1.0]


# --------------------------------------------------------------------------- helpers


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for bitwise comparison (NaN payloads and -0.0 count)."""
    return t.view(bits_dtype(t.dtype))


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(bits(got.contiguous()), bits(want.contiguous()))


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Uniformly random bit patterns (so floats include NaNs of any payload, infs, subnormals, -0.0)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.uint8).to(torch.bool)
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize(dtype),), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def make_pair(shape: tuple[int, ...], dtype: torch.dtype, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(old, new) where about ``density`` of the elements differ bitwise, with NaN/-0.0 cases for floats."""
    gen = torch.Generator().manual_seed(seed)
    old = random_tensor(shape, dtype, gen)
    numel = old.numel()
    mask = torch.rand(numel, generator=gen) < density
    if dtype == torch.bool:
        new = (old.reshape(-1) ^ mask).reshape(shape)
        return old, new
    ob = bits(old).reshape(-1)
    if dtype.is_floating_point:
        special = bits(torch.tensor(SPECIALS, dtype=dtype))
        inject = torch.rand(numel, generator=gen) < 0.25
        ob[inject] = special[torch.randint(0, len(SPECIALS), (numel,), generator=gen)][inject]
        # Some zeros/NaNs in old, so that flips between 0.0 and -0.0 and between NaN payloads occur.
    candidates = [
        bits(random_tensor(shape, dtype, gen)).reshape(-1),  # anything
        ob ^ 1,  # one ulp / lowest bit
    ]
    if dtype.is_floating_point:
        candidates.append(special[torch.randint(0, len(SPECIALS), (numel,), generator=gen)])
    choice = torch.randint(0, len(candidates), (numel,), generator=gen)
    nb = ob.clone()
    for i, c in enumerate(candidates):
        sel = mask & (choice == i)
        nb[sel] = c[sel]
    return old, nb.view(dtype).reshape(shape)


def changed_flat(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Sorted int64 flat indices where ``old`` and ``new`` differ bitwise."""
    return torch.nonzero(bits(old).reshape(-1) != bits(new).reshape(-1)).squeeze(1)


def buffer_count(encoding: Encoding, values: ValueEncoding) -> int:
    """Buffers an entry travels in: entropy-coded gaps with ulp values are one (protocol/codec/packed.py)."""
    if encoding is Encoding.ANS_GAPS and values is ValueEncoding.ULP:
        return 1
    return POSITION_BUFFERS[encoding] + VALUE_BUFFERS[values]


def wire(entries: list) -> Message:
    """Encode ``entries`` as one PATCH message, copy every frame to bytes, decode it again."""
    tensors, frames = assemble(entries)
    msg = Message(MessageType.PATCH, session="s-1", seq=5, version=8, base_version=7, tensors=tensors, frames=frames)
    encoded = encode_message(msg)
    assert len(encoded) == 1 + sum(buffer_count(e.encoding, e.values) for e in entries)
    return decode_message([bytes(f) for f in encoded])


def apply(target: torch.Tensor, decoded: DecodedTensor) -> None:
    if decoded.flat is None:
        target.copy_(decoded.values)
        return
    view = target.view(-1)
    view[decoded.flat] = decoded.new_values(view[decoded.flat])


def roundtrip_sparse(old: torch.Tensor, new: torch.Tensor, options: PatchOptions) -> tuple[torch.Tensor, Encoding | None]:
    """``old`` with the patch from old to new applied after a trip over the wire; the encoding used."""
    shape = tuple(old.shape)
    flat = changed_flat(old, new)
    target = old.clone()
    if flat.numel() == 0:  # nothing changed: the sender sends no entry (decode_entry rejects nnz 0)
        msg = wire([])
        assert msg.tensors == []
        return target, None
    entry = encode_sparse(3, flat, new.reshape(-1)[flat], old.reshape(-1)[flat], shape, options)
    assert entry.nnz == flat.numel()
    msg = wire([entry])
    (te,) = msg.tensors
    # ULP falls back to XOR for fewer changes than a counts table is worth, and goes plain
    # (raw gaps and values) where that is estimated faster (PatchOptions.goes_plain).
    allowed = {options.values, ValueEncoding.XOR, ValueEncoding.RAW} if options.values is ValueEncoding.ULP else {options.values}
    assert te.key == 3 and te.encoding is entry.encoding and te.values is entry.values and te.values in allowed
    assert te.nnz == flat.numel()
    decoded = decode_entry(te, msg.frames, shape, old.dtype, CPU)
    assert decoded.flat is not None and torch.equal(decoded.flat, flat)
    apply(target, decoded)
    return target, entry.encoding


# --------------------------------------------------------------------------- round-trip properties

small_shapes = st.lists(st.integers(0, 9), min_size=0, max_size=4).map(tuple)
# Shapes whose indices need uint16 or uint32 (more than 255 / 65535 elements per row or gap).
wide_shapes = st.sampled_from([(300,), (17, 31), (2, 3, 50), (4, 1, 257), (1, 70000), (70000,)])
shapes = st.one_of(small_shapes, small_shapes, wide_shapes)
densities = st.one_of(st.sampled_from([0.0, 1.0, 0.001, 0.5]), st.floats(0.0, 1.0))
seeds = st.integers(0, 2**31 - 1)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    density=densities,
    positions=st.sampled_from(POSITIONS),
    values=st.sampled_from(VALUES),
    codec=st.sampled_from(CODECS),
    seed=seeds,
)
def test_sparse_roundtrip_is_bit_exact(shape, dtype, density, positions, values, codec, seed):
    old, new = make_pair(shape, dtype, density, seed)
    got, encoding = roundtrip_sparse(old, new, PatchOptions(positions, values, codec))
    assert_bit_equal(got, new)
    if encoding is not None and positions is not None:
        assert encoding is positions
    elif encoding is not None:
        assert encoding in (Encoding.GAPS, Encoding.BITMAP, Encoding.ANS_GAPS)


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(shape=shapes, dtype=st.sampled_from(DTYPES), codec=st.sampled_from(CODECS), seed=seeds)
def test_dense_roundtrip_is_bit_exact(shape, dtype, codec, seed):
    _, new = make_pair(shape, dtype, 0.5, seed)
    msg = wire([encode_dense(0, new, codec)])
    (te,) = msg.tensors
    assert te.encoding is Encoding.DENSE and te.values is ValueEncoding.RAW and te.nnz == new.numel()
    decoded = decode_entry(te, msg.frames, tuple(shape), dtype, CPU)
    assert decoded.flat is None
    target = torch.zeros(shape, dtype=dtype)
    apply(target, decoded)
    assert_bit_equal(target, new)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.name)
@pytest.mark.parametrize("positions", POSITIONS, ids=lambda p: "AUTO" if p is None else p.name)
def test_every_encoding_combination(positions, values, codec, dtype):
    """The whole cross product once, on a 3-D tensor, with a dense entry in the same message."""
    old, new = make_pair((3, 4, 20), dtype, 0.3, seed=1234)
    flat = changed_flat(old, new)
    assert 0 < flat.numel() < new.numel()
    options = PatchOptions(positions, values, codec)
    sparse = encode_sparse(0, flat, new.reshape(-1)[flat], old.reshape(-1)[flat], (3, 4, 20), options)
    dense = encode_dense(1, new, codec)
    msg = wire([sparse, dense])
    got_sparse, got_dense = old.clone(), torch.empty_like(old)
    apply(got_sparse, decode_entry(msg.tensors[0], msg.frames, (3, 4, 20), dtype, CPU))
    apply(got_dense, decode_entry(msg.tensors[1], msg.frames, (3, 4, 20), dtype, CPU))
    assert_bit_equal(got_sparse, new)
    assert_bit_equal(got_dense, new)


@pytest.mark.parametrize("nnz", [5, 300, 5000])
@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.name)
@pytest.mark.parametrize("positions", POSITIONS, ids=lambda p: "AUTO" if p is None else p.name)
def test_int32_positions_code_exactly_as_int64(positions, values, nnz):
    """The sender's compare collects positions as int32 where they fit (``fastdiff.position_dtype``):
    every encoding must give the same buffers from them as from int64, past the packed
    format's threshold too."""
    g = torch.Generator().manual_seed(nnz)
    shape = (3000, 700)
    # clustered, then one far off: a gap the entropy coder's high part escapes (a raw gap of its own)
    near = torch.randperm(3 * nnz, generator=g)[: nnz - 1].sort().values
    flat = torch.cat([near, torch.tensor([shape[0] * shape[1] - 1])])
    old = torch.randn(nnz, generator=g).to(torch.bfloat16)
    new = (old.float() * 1.01).to(torch.bfloat16)
    options = PatchOptions(positions, values, Codec.NONE)
    wide = sparse_buffers(flat, new, old, shape, options)
    narrow = sparse_buffers(flat.to(torch.int32), new, old, shape, options)
    assert narrow[:2] == wide[:2] and narrow[2].keys() == wide[2].keys()
    for role, buf in wide[2].items():
        assert narrow[2][role].dtype == buf.dtype and torch.equal(narrow[2][role], buf), role


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("positions", POSITIONS, ids=lambda p: "AUTO" if p is None else p.name)
@pytest.mark.parametrize("values", VALUES, ids=lambda v: v.name)
def test_nan_and_signed_zero_changes_travel(dtype, positions, values):
    """0.0 -> -0.0 and NaN -> NaN with another payload are changes (== would miss both)."""
    old = torch.tensor([0.0, float("nan"), 1.0, -0.0, 2.0], dtype=dtype)
    new = old.clone()
    nb = bits(new)
    nb[0] = bits(torch.tensor(-0.0, dtype=dtype))
    nb[1] = nb[1] ^ 1  # another NaN payload
    nb[3] = bits(torch.tensor(0.0, dtype=dtype))
    assert torch.equal(changed_flat(old, new), torch.tensor([0, 1, 3]))
    got, _ = roundtrip_sparse(old, new, PatchOptions(positions, values, Codec.NONE))
    assert_bit_equal(got, new)


def test_auto_positions_pick_the_smaller_encoding():
    numel = 4096
    sparse = torch.tensor([5, 1000, 4000])  # 3 gaps of uint16 = 6 bytes < 512-byte bitmap
    entry = encode_sparse(0, sparse, torch.ones(3), torch.zeros(3), (numel,), PatchOptions(None, ValueEncoding.RAW))
    assert entry.encoding is Encoding.GAPS
    few = torch.arange(0, 400, 4)  # 100 one-byte gaps > a 50-byte bitmap, too few for a counts table
    entry = encode_sparse(0, few, torch.ones(100), torch.zeros(100), (400,), PatchOptions(None, ValueEncoding.RAW))
    assert entry.encoding is Encoding.BITMAP
    many = torch.arange(0, numel, 2)  # enough changes for entropy coding
    n = many.numel()
    entry = encode_sparse(0, many, torch.ones(n), torch.zeros(n), (numel,), PatchOptions(None, ValueEncoding.RAW))
    assert entry.encoding is Encoding.ANS_GAPS


# --------------------------------------------------------------------------- wide index dtypes


@pytest.mark.parametrize(
    ("encoding", "shape", "flat"),
    [
        (Encoding.GAPS, (300,), [299]),  # gap 299: uint16
        (Encoding.GAPS, (70000,), [3, 69999]),  # gap 69995: uint32
        (Encoding.COO, (2, 300), [10, 599]),  # col 299: uint16
        (Encoding.COO_DELTA, (2, 300), [10, 599]),
        (Encoding.COO, (70000, 1), [69999]),  # row 69999: uint32
        (Encoding.COO_DELTA, (1, 70000), [1, 69999]),  # col delta 69998: uint32
    ],
)
def test_decode_positions_accepts_wide_index_dtypes(encoding, shape, flat):
    """Index buffers downscaled to uint16/uint32 must decode (torch has no max() for those on CPU)."""
    flat_t = torch.tensor(flat)
    buffers = encode_positions(flat_t, shape, encoding)
    assert any(t.dtype in (torch.uint16, torch.uint32) for t in buffers.values())
    assert torch.equal(decode_positions(buffers, shape, encoding, len(flat)), flat_t)


# --------------------------------------------------------------------------- COO view and delta encoding


@pytest.mark.parametrize(
    ("shape", "expected"),
    [((), (1, 1)), ((7,), (1, 7)), ((0,), (1, 0)), ((3, 4), (3, 4)), ((2, 3, 4, 5), (2, 60)), ((3, 0, 2), (3, 0)), ((5, 2, 1), (5, 2))],
)
def test_coo_shape(shape, expected):
    assert coo_shape(shape) == expected
    assert coo_shape(torch.Size(shape)) == expected



def test_delta_encoding_hand_worked_example():
    # A 4 x 10 view with changes at (0,3) (0,7) (2,1) (2,4) (3,9).
    flat = torch.tensor([3, 7, 21, 24, 39])
    rows, cols = split_rows_cols(flat, (4, 10))
    assert rows.tolist() == [0, 0, 2, 2, 3] and cols.tolist() == [3, 7, 1, 4, 9]
    drows, dcols = delta_encode(rows, cols)
    # rows: difference to the previous row, the first relative to row 0.
    assert drows.tolist() == [0, 0, 2, 0, 1]
    # cols: difference within a row; the absolute column when a new row starts (including the first).
    assert dcols.tolist() == [3, 4, 1, 3, 9]
    r, c = delta_decode(drows, dcols)
    assert r.tolist() == rows.tolist() and c.tolist() == cols.tolist()

    bufs = encode_positions(flat, (4, 10), Encoding.COO_DELTA)
    assert bufs[Role.ROWS].dtype == torch.uint8 and bufs[Role.ROWS].tolist() == [0, 0, 2, 0, 1]
    assert bufs[Role.COLS].dtype == torch.uint8 and bufs[Role.COLS].tolist() == [3, 4, 1, 3, 9]
    plain = encode_positions(flat, (4, 10), Encoding.COO)
    assert plain[Role.ROWS].tolist() == [0, 0, 2, 2, 3] and plain[Role.COLS].tolist() == [3, 7, 1, 4, 9]


def test_delta_encoding_first_row_not_zero_and_nd_view():
    # (2, 3, 2) is viewed as 2 x 6: flat 1 -> (0,1), 5 -> (0,5), 6 -> (1,0), 11 -> (1,5)
    flat = torch.tensor([1, 5, 6, 11])
    bufs = encode_positions(flat, (2, 3, 2), Encoding.COO_DELTA)
    assert bufs[Role.ROWS].tolist() == [0, 0, 1, 0]
    assert bufs[Role.COLS].tolist() == [1, 4, 0, 5]
    # 5 x 6 matrix, first change in row 1: the first row delta is relative to row 0.
    bufs = encode_positions(torch.tensor([8, 9, 11, 26]), (5, 6), Encoding.COO_DELTA)
    assert bufs[Role.ROWS].tolist() == [1, 0, 0, 3]
    assert bufs[Role.COLS].tolist() == [2, 1, 2, 2]


def test_gaps_and_bitmap_hand_worked():
    flat = torch.tensor([0, 3, 4, 9])
    gaps = encode_positions(flat, (10,), Encoding.GAPS)[Role.POSITIONS]
    assert gaps.dtype == torch.uint8 and gaps.tolist() == [0, 2, 0, 4]
    bitmap = encode_positions(flat, (10,), Encoding.BITMAP)[Role.POSITIONS]
    # LSB-first: bits 0,3,4 in byte 0 (1+8+16), bit 9 -> bit 1 of byte 1.
    assert bitmap.dtype == torch.uint8 and bitmap.tolist() == [25, 2]
    for enc, buf in ((Encoding.GAPS, gaps), (Encoding.BITMAP, bitmap)):
        assert decode_positions({Role.POSITIONS: buf}, (10,), enc, 4).tolist() == [0, 3, 4, 9]


@settings(max_examples=100, deadline=None, database=None)
@given(
    shape=st.lists(st.integers(1, 12), min_size=0, max_size=4).map(tuple),
    data=st.data(),
)
def test_delta_encode_decode_inverse(shape, data):
    numel = math.prod(shape)
    flat = sorted(data.draw(st.sets(st.integers(0, numel - 1), min_size=1, max_size=numel)))
    flat_t = torch.tensor(flat)
    rows, cols = split_rows_cols(flat_t, shape)
    drows, dcols = delta_encode(rows, cols)
    assert bool((drows >= 0).all()) and bool((dcols >= 0).all())
    r, c = delta_decode(drows, dcols)
    assert torch.equal(r, rows) and torch.equal(c, cols)


def test_delta_decode_rejects_a_repeated_position():
    with pytest.raises(ProtocolError):
        delta_decode(torch.tensor([0, 0], dtype=torch.uint8), torch.tensor([3, 0], dtype=torch.uint8))


# --------------------------------------------------------------------------- index downscaling


@pytest.mark.parametrize(
    ("top", "dtype"),
    [
        (0, torch.uint8), (255, torch.uint8), (256, torch.uint16), (65535, torch.uint16),
        (65536, torch.uint32), (2**32 - 1, torch.uint32), (2**32, torch.uint64), (2**63 - 1, torch.uint64),
    ],
)
def test_downscale_boundaries(top, dtype):
    assert smallest_unsigned(top) == dtype
    t = torch.tensor([0, 1, top], dtype=torch.int64)
    d = downscale(t)
    assert d.dtype == dtype
    assert d.to(torch.int64).tolist() == [0, 1, top]


def test_downscale_empty_and_overflow():
    assert downscale(torch.zeros(0, dtype=torch.int64)).dtype == torch.uint8
    with pytest.raises(ProtocolError):
        smallest_unsigned(2**64)


@pytest.mark.parametrize(
    ("encoding", "shape", "flat", "role", "dtype"),
    [
        (Encoding.GAPS, (1000,), [255], Role.POSITIONS, torch.uint8),
        (Encoding.GAPS, (1000,), [256], Role.POSITIONS, torch.uint16),
        (Encoding.GAPS, (70000,), [65535], Role.POSITIONS, torch.uint16),
        (Encoding.GAPS, (70000,), [65536], Role.POSITIONS, torch.uint32),
        (Encoding.COO, (1, 70000), [255], Role.COLS, torch.uint8),
        (Encoding.COO, (1, 70000), [256], Role.COLS, torch.uint16),
        (Encoding.COO, (1, 70000), [65535], Role.COLS, torch.uint16),
        (Encoding.COO, (1, 70000), [65536], Role.COLS, torch.uint32),
        (Encoding.COO, (70000, 1), [65536], Role.ROWS, torch.uint32),
        (Encoding.COO, (70000, 1), [65536], Role.COLS, torch.uint8),
        (Encoding.COO_DELTA, (1, 70000), [100, 355], Role.COLS, torch.uint8),  # deltas 100, 255 (absolute 355)
        (Encoding.COO_DELTA, (1, 70000), [100, 356], Role.COLS, torch.uint16),  # deltas 100, 256
    ],
)
def test_encode_positions_downscales(encoding, shape, flat, role, dtype):
    bufs = encode_positions(torch.tensor(flat), shape, encoding)
    assert bufs[role].dtype == dtype


def test_entry_buffer_dtypes_on_the_wire_are_downscaled():
    flat = torch.tensor([2, 300])
    entry = encode_sparse(0, flat, torch.ones(2), torch.zeros(2), (400,), PatchOptions(Encoding.GAPS, ValueEncoding.RAW))
    spec = next(s for s, _ in entry.buffers if s.role is Role.POSITIONS)
    assert spec.dtype == dtype_code(torch.uint16) and spec.shape == (2,) and spec.nbytes == 4


# --------------------------------------------------------------------------- shuffle and compressors


def test_shuffle_hand_worked():
    data = torch.arange(12, dtype=torch.uint8)
    assert shuffle(data, 4).tolist() == [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]
    assert shuffle(data, 2).tolist() == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]
    assert shuffle(data, 1).tolist() == data.tolist()
    assert shuffle(torch.zeros(0, dtype=torch.uint8), 4).numel() == 0


@settings(max_examples=100, deadline=None, database=None)
@given(itemsize_=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 64), data=st.data())
def test_shuffle_unshuffle_inverse(itemsize_, n, data):
    raw = data.draw(st.binary(min_size=n * itemsize_, max_size=n * itemsize_))
    t = torch.tensor(list(raw), dtype=torch.uint8)
    s = shuffle(t, itemsize_)
    assert sorted(s.tolist()) == sorted(t.tolist())
    assert torch.equal(unshuffle(s, itemsize_), t)


@settings(max_examples=100, deadline=None, database=None)
@given(codec=st.sampled_from([Codec.LZ4, Codec.ZSTD]), raw=st.binary(min_size=1, max_size=4096), repeat=st.integers(1, 50))
def test_compressors_roundtrip(codec, raw, repeat):
    data = torch.tensor(list(raw * repeat), dtype=torch.uint8)
    packed = compress(data, codec)
    out = decompress(bytes(packed), codec, data.numel(), CPU)
    assert torch.equal(out, data)


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.ZSTD], ids=lambda c: c.name)
def test_pack_buffer_compresses_when_it_pays(codec):
    spec, w = pack_buffer(Role.VALUES, torch.zeros(1024, dtype=torch.float32), codec)
    assert spec.codec is codec and spec.shuffle and spec.nbytes == 4096 and spec.wire_nbytes == len(w) < 4096
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=gen)
    spec, w = pack_buffer(Role.VALUES, noise, codec)
    assert spec.codec is Codec.NONE and not spec.shuffle and len(w) == 4096  # incompressible: sent as is
    spec, w = pack_buffer(Role.VALUES, torch.zeros(0), codec)
    assert spec.codec is Codec.NONE and len(w) == 0


def test_zstd_skips_buffers_under_its_minimum():
    """A zstd call costs more than it can save on a few hundred bytes: those go raw."""
    small = torch.zeros(ZSTD_MIN_BYTES // 4 - 1, dtype=torch.float32)  # 4092 bytes of zeros, very compressible
    spec, w = pack_buffer(Role.VALUES, small, Codec.ZSTD)
    assert spec.codec is Codec.NONE and not spec.shuffle and len(w) == small.numel() * 4
    spec, _ = pack_buffer(Role.VALUES, small, Codec.LZ4)  # lz4 is cheap: still used
    assert spec.codec is Codec.LZ4
    options = PatchOptions(Encoding.GAPS, ValueEncoding.RAW, Codec.ZSTD)
    entry = encode_sparse(0, torch.tensor([1, 5, 9]), torch.ones(3), torch.zeros(3), (10,), options)
    assert {s.codec for s, _ in entry.buffers} == {Codec.NONE}
    tensors, frames = assemble([entry])
    msg = decode_message(encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=tensors, frames=frames)))
    decoded = decode_entry(msg.tensors[0], msg.frames, (10,), torch.float32, CPU)
    assert decoded.flat is not None and decoded.flat.tolist() == [1, 5, 9] and torch.equal(decoded.values, torch.ones(3))


def test_zstd_contexts_are_per_thread():
    """zstandard's compressor and decompressor objects must not be used by two threads at
    once: each thread gets its own, reused across its calls, and concurrent use round-trips."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from protocol.codec import compress as compress_module

    zstd = compress_module._CPU[Codec.ZSTD]
    assert zstd._compressor() is zstd._compressor()  # reused within a thread
    seen: dict[int, object] = {}

    def round_trip(seed: int) -> bool:
        seen[threading.get_ident()] = zstd._compressor()
        data = torch.randint(0, 4, (50_000 + seed,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        return all(torch.equal(decompress(bytes(compress(data, Codec.ZSTD)), Codec.ZSTD, data.numel(), CPU), data) for _ in range(5))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(round_trip, range(32)))
    assert len({id(c) for c in seen.values()}) == len(seen)  # no two threads shared one


@pytest.mark.parametrize(("name", "codec"), [("none", Codec.NONE), ("lz4", Codec.LZ4), ("zstd", Codec.ZSTD)])
def test_parse_compression_cpu_codecs(name, codec):
    assert parse_compression(name) is codec
    assert parse_compression(name, "cuda") is codec


def test_parse_compression_unknown():
    with pytest.raises(ConfigError, match="gzip"):
        parse_compression("gzip")


def test_an_unknown_compression_in_a_config_names_its_key():
    """``zstandard`` for ``zstd``: the error names the setting to fix (it named only the value)."""
    from protocol.config import load_config

    with pytest.raises(ConfigError, match=r"^patch\.compression: unknown compression 'zstandard'; choose one of"):
        load_config({"weight_syncer": {"type": "patch", "patch": {"compression": "zstandard"}}})


def test_nvcomp_needs_transport_device_cuda():
    with pytest.raises(ConfigError, match="transport_device"):
        parse_compression("nvcomp_lz4", "cpu")


def _nvcomp_usable() -> bool:
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(_nvcomp_usable(), reason="nvidia-nvcomp-cu12 and CUDA are both available here")
def test_nvcomp_names_what_is_missing():
    with pytest.raises(ConfigError) as err:
        parse_compression("nvcomp_lz4", "cuda")
    message = str(err.value)
    # nvCOMP missing: both packages and both extras are named (CUDA 12 and CUDA 13 torch builds)
    assert all(name in message for name in ("nvidia-nvcomp-cu12", "nvidia-nvcomp-cu13", "[gpu]", "[gpu-cu13]")) or "CUDA device" in message


def test_codec_pool_knob(monkeypatch):
    """Any number of codec threads gives the plain loop's results, in order, and its first error."""
    from protocol.codec import parallel

    for workers in (1, 2, 3):
        monkeypatch.setattr(parallel, "WORKERS", workers)
        assert parallel.map_ordered(lambda x: x * x, list(range(20))) == [x * x for x in range(20)]
        with pytest.raises(ZeroDivisionError):
            parallel.map_ordered(lambda x: 1 // (x - 7), list(range(20)))
    monkeypatch.setenv(parallel.ENV, "1")
    assert parallel._from_env() == 1
    monkeypatch.setenv(parallel.ENV, "")
    assert parallel._from_env() == parallel.DEFAULT_WORKERS
    for bad in ("0", "two"):
        monkeypatch.setenv(parallel.ENV, bad)
        with pytest.raises(ValueError, match=parallel.ENV):
            parallel._from_env()
