"""The device codec (protocol/codec/devicecodec.py), run on CPU tensors.

Round trips are bit-exact for every dtype a receiver holds, with the changes a bitwise
compare finds (NaN payloads, -0.0, infinities, subnormals); a hostile payload (flipped,
truncated, extended, lying widths or nnz, positions out of range or not increasing) gets a
False verdict, never an exception, and positions a scatter can use; and the structure that
matters on a GPU holds: a bounded number of host syncs per call whatever the size, no numba.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.opcount import SYNCING, OpCounter, blocking_transfer
from protocol.codec import devicecodec as dc
from protocol.errors import ProtocolError

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SPECIALS = (float("nan"), -0.0, 0.0, float("inf"), float("-inf"), 1e-40, -1e-45, 3.0e38)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view the library compares by (NaN and -0.0 compare by their bits)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def bitwise_changes(old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions where the bit patterns differ, and the old and new values there."""
    flat = torch.nonzero(bits(old) != bits(new)).squeeze(1)
    return flat, new.reshape(-1)[flat], old.reshape(-1)[flat]


def roundtrip(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, numel: int) -> torch.Tensor:
    """Encode, decode (verdict True) and apply; returns the payload."""
    encoded = dc.encode(flat, new, old)
    decoded = dc.decode(encoded.payload, flat.numel(), numel, new.dtype)
    assert bool(decoded.ok)
    assert torch.equal(decoded.flat, flat.to(torch.int64))
    assert torch.equal(bits(dc.apply_differences(old, decoded.diffs)), bits(new))
    assert int(encoded.checksum) == int(dc.checksum(encoded.payload[8:]))
    return encoded.payload


def float_pair(dtype: torch.dtype, numel: int, density: float, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A receiver's old and new values of an fp32 master stepped by ``lr`` on a ``density``
    share of elements, with special values (NaN, +-0, +-inf, subnormals) sprinkled in."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen) * 0.02
    specials = torch.tensor(SPECIALS)
    where = torch.randint(0, numel, (max(1, numel // 50),), generator=gen)
    master[where] = specials[torch.randint(0, len(SPECIALS), where.shape, generator=gen)]
    step = torch.randn(numel, generator=gen) * lr * (torch.rand(numel, generator=gen) < density)
    new = master + step
    moved = torch.randint(0, numel, (max(1, numel // 100),), generator=gen)
    new[moved] = specials[torch.randint(0, len(SPECIALS), moved.shape, generator=gen)]
    old, new = master.to(dtype), new.to(dtype)
    if numel > 2:  # a NaN whose sign moved and a signed zero: changes that != would miss
        old[:2], new[:2] = torch.tensor([float("nan"), 0.0]), torch.tensor([-float("nan"), -0.0])
    return old, new


def integer_pair(dtype: torch.dtype, numel: int, density: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Old and new integer buffers: a ``density`` share moved, by small steps or by anything (wrapping)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        old = torch.rand(numel, generator=gen) < 0.5
        return old, old ^ (torch.rand(numel, generator=gen) < density)
    info = torch.iinfo(dtype)
    old = torch.randint(info.min, info.max, (numel,), generator=gen, dtype=dtype)
    mask = torch.rand(numel, generator=gen) < density
    small = torch.randint(-3, 4, (numel,), generator=gen, dtype=torch.int64)
    anything = torch.randint(info.min, info.max, (numel,), generator=gen, dtype=dtype)
    new = torch.where(torch.rand(numel, generator=gen) < 0.8, (old.to(torch.int64) + small).to(dtype), anything)
    return old, torch.where(mask, new, old)


# -- round trips -------------------------------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(
    dtype=st.sampled_from(FLOATS),
    numel=st.integers(1, 3000),
    density=st.sampled_from([0.0, 0.001, 0.05, 0.5, 1.0]),
    lr=st.sampled_from([1e-6, 1e-5, 1e-3]),
    seed=st.integers(0, 2**16),
)
def test_float_receivers_of_an_fp32_master_round_trip_bit_exact(dtype: torch.dtype, numel: int, density: float, lr: float, seed: int) -> None:
    old, new = float_pair(dtype, numel, density, lr, seed)
    flat, new_at, old_at = bitwise_changes(old, new)
    roundtrip(flat, new_at, old_at, numel)
    decoded = dc.decode(dc.encode(flat, new_at, old_at).payload, flat.numel(), numel, dtype)
    target = old.clone()
    target[decoded.flat] = dc.apply_differences(target[decoded.flat], decoded.diffs)
    assert torch.equal(bits(target), bits(new))  # the changes are exactly what a bitwise compare finds


@settings(max_examples=150, deadline=None)
@given(dtype=st.sampled_from(INTEGERS), numel=st.integers(1, 3000), density=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**16))
def test_integer_buffers_round_trip_bit_exact(dtype: torch.dtype, numel: int, density: float, seed: int) -> None:
    old, new = integer_pair(dtype, numel, density, seed)
    roundtrip(*bitwise_changes(old, new), numel)


@pytest.mark.parametrize("dtype", FLOATS + INTEGERS)
def test_edges_empty_one_first_last_all(dtype: torch.dtype) -> None:
    numel = 1000
    old = torch.zeros(numel, dtype=dtype)
    new = torch.ones(numel, dtype=dtype)
    for flat in ([], [0], [numel - 1], [0, numel - 1], list(range(numel))):
        at = torch.tensor(flat, dtype=torch.int64)
        payload = roundtrip(at, new[at], old[at], numel)
        if not flat:
            assert payload.numel() == dc.HEADER
    assert roundtrip(torch.tensor([0]), new[:1], old[:1], 1).numel() <= dc.HEADER + dc.PLANES + old.element_size()


def test_extreme_differences_wrap_at_the_width() -> None:
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        info = torch.iinfo(dtype)
        old = torch.tensor([info.min, info.max, 0, -1, info.min], dtype=dtype)
        new = torch.tensor([info.max, info.min, -1, 0, info.min + 1], dtype=dtype)
        roundtrip(torch.arange(5), new, old, 5)
    # a quiet NaN to a negative one, a signalling NaN to another payload, a subnormal to its negative, -0.0 to 0.0
    old = torch.tensor([0x7FC00000, 0x7F800001, 0x00000001, 0x80000000 - 2**32], dtype=torch.int32).view(torch.float32)
    new = torch.tensor([0xFFC00000 - 2**32, 0x7FFFFFFF, 0x80000001 - 2**32, 0], dtype=torch.int32).view(torch.float32)
    roundtrip(torch.tensor([3, 9, 27, 81]), new, old, 100)


@settings(max_examples=60, deadline=None)
@given(nnz=st.integers(1, 600), log_numel=st.integers(33, 40), seed=st.integers(0, 2**16))
def test_huge_targets_and_gaps_past_32_bits(nnz: int, log_numel: int, seed: int) -> None:
    """Positions up to 2**40 (nothing of that size is allocated), gaps beyond 2**32."""
    numel = 1 << log_numel
    gen = torch.Generator().manual_seed(seed)
    inner = torch.randint(1, numel - 1, (nnz,), generator=gen, dtype=torch.int64)
    flat = torch.unique(torch.cat([torch.tensor([0, numel - 1]), inner]))
    values = torch.randint(-(2**15), 2**15 - 1, (flat.numel(),), generator=gen, dtype=torch.int64).to(torch.int16)
    roundtrip(flat, values + 1, values, numel)
    roundtrip(flat, values.view(torch.bfloat16), (values ^ 0x7FFF).view(torch.bfloat16), numel)


def test_block_boundaries_and_escapes() -> None:
    """Blocks one short of, exactly at and one past BLOCK; a block whose values all escape."""
    for nnz in (dc.BLOCK - 1, dc.BLOCK, dc.BLOCK + 1, 3 * dc.BLOCK + 7):
        flat = torch.arange(nnz) * 3 + (torch.arange(nnz) % 17 == 0) * 2
        old = torch.zeros(nnz, dtype=torch.int32)
        new = torch.where(torch.arange(nnz) % 5 == 0, 1 << 30, 1).to(torch.int32)
        roundtrip(flat, new, old, 4 * nnz)
        roundtrip(flat, torch.full((nnz,), -(2**31), dtype=torch.int32), old, 4 * nnz)


def test_a_plain_block_costs_its_widths_and_little_else() -> None:
    """All changed, +-1 ulp: positions cost nothing (every gap is 1), values one bit or two."""
    nnz = 100 * dc.BLOCK
    old = torch.zeros(nnz, dtype=torch.int16)
    new = (torch.arange(nnz) % 2 * 2 - 1).to(torch.int16)
    payload = roundtrip(torch.arange(nnz), new, old, nnz)
    assert payload.numel() <= dc.HEADER + dc.PLANES * 100 + nnz // 8 + 1


# -- hostile payloads --------------------------------------------------------------------------
def sample(nnz: int = 700, numel: int = 5000, seed: int = 0) -> tuple[torch.Tensor, int, int]:
    """A valid bf16 payload, its nnz and numel."""
    old, new = float_pair(torch.bfloat16, numel, nnz / numel, 1e-3, seed)
    flat, new_at, old_at = bitwise_changes(old, new)
    return dc.encode(flat, new_at, old_at).payload, flat.numel(), numel


def verdict(payload: torch.Tensor, nnz: int, numel: int, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Decode a hostile payload: never raises; positions always lie in [0, numel) (or are
    empty); a True verdict means strictly increasing positions too."""
    decoded = dc.decode(payload, nnz, numel, dtype)
    flat = decoded.flat
    assert flat.dtype == torch.int64 and decoded.ok.dim() == 0
    assert flat.numel() in (0, nnz) and decoded.diffs.shape == flat.shape
    assert bool(((flat >= 0) & (flat < numel)).all())
    ok = bool(decoded.ok)
    if ok:
        assert flat.numel() == nnz and bool((torch.diff(flat) > 0).all())
    return ok


def resealed(payload: torch.Tensor) -> torch.Tensor:
    """``payload`` with its checksum made right again, so the checks behind it are what judge."""
    dc.seal(payload)
    return payload


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**16), flips=st.integers(1, 8), reseal=st.booleans())
def test_flipped_bytes(seed: int, flips: int, reseal: bool) -> None:
    payload, nnz, numel = sample(seed=seed % 7)
    gen = torch.Generator().manual_seed(seed)
    at = torch.randint(0, payload.numel(), (flips,), generator=gen)
    bad = payload.clone()
    bad[at] ^= torch.randint(1, 256, (flips,), generator=gen, dtype=torch.uint8)
    if torch.equal(bad, payload):
        return
    if reseal:
        verdict(resealed(bad), nnz, numel)  # may decode to other valid changes: bounds still hold
    else:
        assert not verdict(bad, nnz, numel)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(1, 400), extra=st.integers(1, 64), reseal=st.booleans())
def test_truncated_and_extended(cut: int, extra: int, reseal: bool) -> None:
    payload, nnz, numel = sample()
    short = payload[: max(0, payload.numel() - cut)].clone()
    long = torch.cat([payload, torch.randint(0, 256, (extra,), dtype=torch.uint8)])
    assert not verdict(resealed(long) if reseal else long, nnz, numel)
    if reseal and short.numel() >= 8:
        verdict(resealed(short), nnz, numel)
    else:
        assert not verdict(short, nnz, numel)


def table(payload: torch.Tensor, nnz: int) -> torch.Tensor:
    """The payload's block table as [planes, blocks] (a view: edits land in the payload)."""
    blocks = -(-nnz // dc.BLOCK)
    return payload[dc.HEADER : dc.HEADER + dc.PLANES * blocks].view(dc.PLANES, blocks)


@pytest.mark.parametrize("plane", range(dc.PLANES))
@pytest.mark.parametrize("width", [65, 200, 255])
def test_widths_beyond_64(plane: int, width: int) -> None:
    payload, nnz, numel = sample()
    table(payload, nnz)[plane, 1] = width
    assert not verdict(resealed(payload), nnz, numel)


def test_widths_beyond_the_dtype_or_the_target() -> None:
    payload, nnz, numel = sample()
    bad = payload.clone()
    table(bad, nnz)[2, 0] = 17  # a bf16 difference has 16 bits
    assert not verdict(resealed(bad), nnz, numel)
    bad = payload.clone()
    table(bad, nnz)[1, 0] = numel.bit_length() + 1  # no gap is longer than the target
    assert not verdict(resealed(bad), nnz, numel)
    assert verdict(payload, nnz, numel)


@pytest.mark.parametrize("plane", [0, 2])
def test_a_table_that_does_not_add_up_to_the_payload(plane: int) -> None:
    """Every block claiming its widest low fields: more bits than the payload holds."""
    payload, nnz, numel = sample(nnz=2500)
    limit = numel.bit_length() if plane == 0 else 16
    assert nnz * limit > 8 * payload.numel()
    table(payload, nnz)[plane] = limit
    assert not verdict(resealed(payload), nnz, numel)


def test_header_fields_and_nnz_that_lie() -> None:
    payload, nnz, numel = sample()
    assert verdict(payload, nnz, numel)
    for lie in (nnz - 1, nnz + 1, nnz + dc.BLOCK, 0, numel + 1, -1):
        assert not verdict(payload, lie, numel)
    assert not verdict(payload, 2**40, 2**41)  # refused before anything 2**40 long is allocated
    for byte, value in ((8, 2), (9, 6), (10, 32), (11, 1), (16, 1), (23, 0x80)):
        bad = payload.clone()
        bad[byte] = value
        assert not verdict(resealed(bad), nnz, numel)
    assert not verdict(payload, nnz, numel, torch.float32)  # another width than the payload's
    with pytest.raises(ProtocolError):
        dc.decode(payload.view(torch.int8), nnz, numel, torch.bfloat16)


def test_positions_out_of_range_or_not_increasing() -> None:
    """Coded faithfully from positions no valid sender has, and refused by the decoder."""
    values = torch.ones(4, dtype=torch.int16)
    numel = 100
    for flat in ([3, 3, 7, 9], [10, 3, 50, 60], [1, 2, 3, 100], [0, 1, 2, 2**62], [-1, 0, 1, 2], [5, 4, 3, 2]):
        payload = dc.encode(torch.tensor(flat), values, values - 1).payload
        assert not verdict(payload, 4, numel, torch.int16)
    payload = dc.encode(torch.tensor([1, 2, 3, 99]), values, values - 1).payload
    assert verdict(payload, 4, numel, torch.int16)
    assert not verdict(payload, 4, 99, torch.int16)  # the same payload for a smaller target


def test_values_no_encoder_makes() -> None:
    """A zero difference (not a change) and a bool moved by more than one."""
    flat = torch.tensor([0, 1, 2])
    same = torch.tensor([5, 6, 7], dtype=torch.int8)
    assert not verdict(dc.encode(flat, same, same).payload, 3, 3, torch.int8)
    moved = dc.encode(flat, torch.tensor([3, 255, 1], dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8)).payload
    assert verdict(moved, 3, 3, torch.uint8) and not verdict(moved, 3, 3, torch.bool)
    assert torch.equal(dc.apply_differences(torch.zeros(3, dtype=torch.bool), torch.tensor([3, -1, 1])), torch.ones(3, dtype=torch.bool))


def test_raise_unless_ok() -> None:
    payload, nnz, numel = sample()
    dc.decode(payload, nnz, numel, torch.bfloat16).raise_unless_ok()
    payload[-1] ^= 1
    with pytest.raises(ProtocolError):
        dc.decode(payload, nnz, numel, torch.bfloat16).raise_unless_ok("tensor 3")


def test_checksum_catches_one_and_two_word_errors() -> None:
    data = torch.randint(0, 256, (999,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    total = int(dc.checksum(data))
    for i, j in ((0, 1), (10, 500), (997, 998), (2, 3)):
        bad = data.clone()
        bad[i], bad[j] = data[j], data[i]
        assert torch.equal(bad, data) or int(dc.checksum(bad)) != total
        bad[i] ^= 0xFF
        assert int(dc.checksum(bad)) != total
    assert int(dc.checksum(torch.cat([data, data.new_zeros(1)]))) != total  # length counts
    assert int(dc.checksum(data[1:])) == int(dc.checksum(data[1:].clone()))  # odd offsets read alike


# -- structure ---------------------------------------------------------------------------------
class SyncCounter(TorchDispatchMode):
    """Counts the operations that would wait for a CUDA device: nonzero, item/int()/tolist
    (``_local_scalar_dense``), masked_select, unique*, a tensor made from host data
    (``lift_fresh``: moved to the device by a blocking copy) and blocking copies between
    devices (``benchmarks.opcount`` names them), on this thread only."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs: Counter[str] = Counter()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        self.ops += 1
        if name.startswith(SYNCING) or (name in ("aten::_to_copy", "aten::copy_") and blocking_transfer(args, kwargs or {})):
            self.syncs[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("nnz", [10, 10_000, 1_000_000])
def test_host_syncs_are_bounded_whatever_the_size(nnz: int) -> None:
    """One sync to encode (the payload's size), none to decode, the same at every size."""
    gen = torch.Generator().manual_seed(nnz)
    flat = torch.randint(0, 64 * nnz, (nnz,), generator=gen).unique()
    old = torch.randint(-(2**15), 2**15 - 1, flat.shape, generator=gen, dtype=torch.int64).to(torch.int16)
    new = old + 1
    with OpCounter() as encoding:  # copies to the host count too (a sync on a GPU, whatever the source here)
        payload = dc.encode(flat, new.view(torch.bfloat16), old.view(torch.bfloat16)).payload
    with OpCounter() as decoding:
        decoded = dc.decode(payload, flat.numel(), 64 * nnz, torch.bfloat16)
        new_bits = dc.apply_differences(old, decoded.diffs)
    assert encoding.syncs == {"aten::_to_copy": 1}, encoding.syncs  # the size, read
    assert decoding.sync_count == 0, decoding.syncs
    assert encoding.total < 300 and decoding.total < 300  # kernels: a constant, not one a block
    assert bool(decoded.ok) and torch.equal(new_bits, new)


def test_the_op_count_does_not_grow_with_blocks() -> None:
    counts = []
    for nnz in (300, 30_000):
        flat = torch.arange(nnz) * 7
        values = torch.arange(nnz, dtype=torch.int32)
        with SyncCounter() as encoding:
            payload = dc.encode(flat, values + 3, values).payload
        with SyncCounter() as decoding:
            dc.decode(payload, nnz, 7 * nnz, torch.int32)
        counts.append(encoding.ops + decoding.ops)
    assert abs(counts[0] - counts[1]) <= 4  # the checksum pads a payload of odd length


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_same_bytes_and_a_decode_that_never_waits() -> None:
    """The payload is the same bytes on either device; CUDA's sync debug mode raises on any
    operation that would make the host wait, and decode and apply make none."""
    old, new = float_pair(torch.bfloat16, 200_000, 0.03, 1e-5, 0)
    flat, new_at, old_at = bitwise_changes(old, new)
    cuda = torch.device("cuda")
    payload = dc.encode(flat.to(cuda), new_at.to(cuda), old_at.to(cuda)).payload
    assert torch.equal(payload.cpu(), dc.encode(flat, new_at, old_at).payload)
    old_on_device = old_at.to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decoded = dc.decode(payload, flat.numel(), old.numel(), torch.bfloat16)
        new_bits = dc.apply_differences(old_on_device, decoded.diffs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(decoded.ok) and torch.equal(decoded.flat.cpu(), flat)
    assert torch.equal(bits(new_bits.cpu()), bits(new_at))


def test_importing_the_codec_loads_no_numba() -> None:
    code = "import sys, protocol.codec.devicecodec; assert 'numba' not in sys.modules, 'numba imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_benchmark_measures_a_small_workload() -> None:
    """``python -m benchmarks.device_codec`` on two small tensors: its figures are consistent."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import device_codec as bench
    from benchmarks.workloads import SyntheticWorkload

    changes, elements = bench.step_changes(SyntheticWorkload("small", 0.02, [(64, 64), (300,)], measured_steps=1))
    result = bench.measure("small", "synthetic", changes, elements, repeat=1)
    assert result["elements"] == 64 * 64 + 300 and 0 < result["changed"] < elements
    assert result["device_bytes"] == sum(dc.encode(c.flat, c.new, c.old).payload.numel() for c in changes)
    assert 1.0 < result["device_over_floor"] < 2.0 and result["host_bytes"] > 0


# -- a part's entries as one batch (``prepare`` / ``decode_many``) --------------------------------
def batch_of(entries: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """Entries of mixed dtypes and sizes (empty ones, one change, several blocks), as ``bitwise_changes`` finds them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(entries):
        dtype = (torch.bfloat16, torch.float32, torch.int8, torch.int64, torch.bool, torch.float16)[i % 6]
        numel = int(torch.randint(1, 3000, (1,), generator=gen))
        if dtype == torch.bool:
            old = torch.rand(numel, generator=gen) < 0.5
            new = old ^ (torch.rand(numel, generator=gen) < 0.2)
        elif dtype.is_floating_point:
            old = torch.randn(numel, generator=gen).to(dtype)
            new = torch.where(torch.rand(numel, generator=gen) < 0.1 * (i % 3), old.float() * 1.01, old.float()).to(dtype)
        else:
            info = torch.iinfo(dtype)
            old = torch.randint(info.min, info.max, (numel,), generator=gen, dtype=torch.int64).to(dtype)
            new = torch.where(torch.rand(numel, generator=gen) < 0.3, old ^ 5, old)
        flat, n, o = bitwise_changes(old, new)
        out.append((flat, n, o, numel))
    return out


Entry = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]  # positions, new and old values, the target's elements


def packed_batch(entries: list[Entry], check: bool = True) -> tuple[torch.Tensor, list[int], list[int]]:
    """Every entry coded in one batch, into one buffer: the buffer, starts and sizes (each
    payload's checksum checked, with ``check``)."""
    prepared = dc.prepare([e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries])
    sizes = prepared.sizes()
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at = dc.aligned(at + n)
    buffer = torch.zeros(at + dc.slack(), dtype=torch.uint8)
    sums = prepared.write(buffer, starts)
    if check:
        assert sums.tolist() == [int(dc.checksum(buffer[s + 8 : s + n])) for s, n in zip(starts, sizes)]
    return buffer, starts, sizes


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 14), st.integers(0, 2**31))
def test_a_batch_is_the_bytes_of_its_entries_coded_alone_and_decodes_bit_exact(entries: int, seed: int) -> None:
    batch = batch_of(entries, seed)
    buffer, starts, sizes = packed_batch(batch)
    for (flat, new, old, _), s, n in zip(batch, starts, sizes):
        assert torch.equal(buffer[s : s + n], dc.encode(flat, new, old).payload)
    targets = [dc.Target(flat.numel(), numel, new.dtype) for flat, new, _, numel in batch]
    for (flat, new, old, _), decoded in zip(batch, dc.decode_many(buffer, starts, sizes, targets)):
        assert bool(decoded.ok) and torch.equal(decoded.flat, flat)
        assert torch.equal(bits(dc.apply_differences(old, decoded.diffs)), bits(new))


def test_a_batch_in_any_order_of_widths_and_places() -> None:
    """Entries given in any order (the batch sorts them by width) land where the caller says, gaps between them too."""
    batch = batch_of(7, 3)[::-1]
    prepared = dc.prepare([e[0] for e in batch], [e[1] for e in batch], [e[2] for e in batch])
    sizes = prepared.sizes()
    starts, at = [], 64
    for n in reversed(sizes):  # the last entry first in the buffer
        starts.insert(0, at)
        at = dc.aligned(at + n) + 8
    buffer = torch.zeros(at + dc.slack(), dtype=torch.uint8)
    sums = prepared.write(buffer, starts)
    for (flat, new, old, _), s, n, total in zip(batch, starts, sizes, sums.tolist()):
        assert torch.equal(buffer[s : s + n], dc.encode(flat, new, old).payload) and total == int(dc.checksum(buffer[s + 8 : s + n]))


@pytest.mark.parametrize("fault", ["flip", "nnz", "numel", "short", "table"])
def test_one_bad_payload_of_a_batch_fails_alone(fault: str) -> None:
    """A fault in one payload makes its verdict False and no other's; what the host knows
    is wrong (too short for its table, more changes than elements) is refused before the device."""
    batch = [e for e in batch_of(8, 11) if e[0].numel() > 130]
    buffer, starts, sizes = packed_batch(batch)
    targets = [dc.Target(flat.numel(), numel, new.dtype) for flat, new, _, numel in batch]
    victim = len(batch) // 2
    t = targets[victim]
    if fault == "flip":
        buffer[starts[victim] + sizes[victim] - 1] ^= 0x10
    elif fault == "nnz":
        targets[victim] = dc.Target(t.nnz - 1, t.numel, t.dtype)
    elif fault == "numel":
        targets[victim] = dc.Target(t.nnz, t.nnz - 1, t.dtype)
    elif fault == "short":
        sizes[victim] = dc.min_nbytes(t.nnz) - 1
    else:
        buffer[starts[victim] + dc.HEADER] = 64  # the first block's gap width: past what the target needs
        dc.seal(buffer[starts[victim] : starts[victim] + sizes[victim]])
    verdicts = [bool(d.ok) for d in dc.decode_many(buffer, starts, sizes, targets)]
    assert verdicts == [i != victim for i in range(len(batch))]


def test_a_batch_costs_the_same_ops_whatever_its_entry_count() -> None:
    """Kernels to code and decode a batch: a constant, not one an entry (on a GPU each is a launch)."""
    counts = {}
    for entries in (6, 60):
        batch = batch_of(entries, 5)
        with OpCounter() as encoding:
            buffer, starts, sizes = packed_batch(batch, check=False)
        targets = [dc.Target(flat.numel(), numel, new.dtype) for flat, new, _, numel in batch]
        with OpCounter() as decoding:
            decoded = dc.decode_many(buffer, starts, sizes, targets)
        assert all(bool(d.ok) for d in decoded)
        assert encoding.syncs == {"aten::_to_copy": 1} and decoding.sync_count == 0, (encoding.syncs, decoding.syncs)  # the sizes
        counts[entries] = (encoding.total, decoding.total)
    assert counts[60] == counts[6], counts  # six dtypes in each: a subtraction (and its casts) a width
    assert counts[60][0] <= 250 and counts[60][1] <= 300, counts  # 218 and 279 measured


def test_join_reads_one_storage_in_place_and_copies_scattered_payloads_once() -> None:
    payloads = [dc.encode(flat, new, old).payload for flat, new, old, _ in batch_of(4, 9)]
    staged = torch.zeros(sum(dc.aligned(p.numel()) + 64 for p in payloads) + 64, dtype=torch.uint8)
    views, at = [], 0
    for p in payloads:
        staged[at : at + p.numel()] = p
        views.append(staged[at : at + p.numel()])
        at = dc.aligned(at + p.numel()) + 64
    buffer, starts = dc.join(views)
    assert buffer.data_ptr() == staged.data_ptr() and starts == [v.storage_offset() for v in views]
    with OpCounter() as copies:
        buffer, starts = dc.join(payloads)
    assert copies.total <= 2 and all(torch.equal(buffer[s : s + p.numel()], p) for s, p in zip(starts, payloads))
