"""The fused CPU diff agrees bit for bit with the torch path it replaces."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sender.diff import fastdiff

ROOT = Path(__file__).resolve().parent.parent

SPECIALS = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 3.4e38, 1.0]
BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference(cur: torch.Tensor, snapshot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cast = cur.to(snapshot.dtype).reshape(-1)
    bits = BITS[snapshot.element_size()]
    flat = torch.nonzero(cast.view(bits) != snapshot.reshape(-1).view(bits)).squeeze(1)
    return flat, cast[flat], snapshot.reshape(-1)[flat]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = BITS[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 70_000),  # across the 65536-element chunk boundary
    pair=st.sampled_from([(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.int64, torch.int64)]),
    density=st.floats(0, 1),
    seed=st.integers(0, 2**16),
    specials=st.booleans(),
    expect=st.one_of(st.none(), st.integers(0, 80_000)),  # the serial one pass: changes that fit its room, and that do not
)
def test_fused_diff_matches_torch(
    n: int, pair: tuple[torch.dtype, torch.dtype], density: float, seed: int, specials: bool, expect: int | None
) -> None:
    state_dtype, receiver_dtype = pair
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(n, generator=g) * 0.02) if state_dtype.is_floating_point else torch.randint(-9, 9, (n,), generator=g).double()
    if specials and n:
        picks = torch.randint(0, len(SPECIALS), (n,), generator=g)
        chosen = torch.rand(n, generator=g) < 0.1
        base[chosen] = torch.tensor(SPECIALS, dtype=base.dtype)[picks[chosen]]
    cur = base.to(state_dtype)
    snapshot = cur.to(receiver_dtype).clone()
    moved = torch.rand(n, generator=g) < density
    step = (torch.randn(n, generator=g) * 1e-3).to(base.dtype) if state_dtype.is_floating_point else torch.ones(n).double()
    cur = torch.where(moved, (base + step).to(state_dtype), cur)
    assert fastdiff.supported(cur, snapshot)
    expect_flat, expect_new, expect_old = reference(cur, snapshot)
    expected_snapshot = cur.to(receiver_dtype)
    changed, flat, new, old = fastdiff.diff_and_update(cur, snapshot, expect=expect)
    assert changed == expect_flat.numel()
    assert flat is not None and new is not None and old is not None
    assert flat.dtype == torch.int32 and torch.equal(flat.long(), expect_flat)  # 8 bytes a bf16 change held, not 12
    assert same_bits(new, expect_new) and same_bits(old, expect_old)
    assert same_bits(snapshot, expected_snapshot)  # moved to the new version in place


def test_positions_are_int32_where_they_fit() -> None:
    assert fastdiff.position_dtype(2**31 - 1) is np.int32
    assert fastdiff.position_dtype(2**31) is np.int64


def test_unsupported_pairs_take_the_torch_path() -> None:
    assert not fastdiff.supported(torch.zeros(4), torch.zeros(4, dtype=torch.float16))  # fp32 -> fp16: not fused
    assert not fastdiff.supported(torch.zeros(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool))
    assert not fastdiff.supported(torch.zeros(4, 4).t(), torch.zeros(4, 4).t())  # a non-contiguous snapshot


@pytest.mark.parametrize("shape", [(3, 5, 7), (1,), ()])
def test_any_shape(shape: tuple[int, ...]) -> None:
    cur = torch.randn(shape)
    snapshot = torch.zeros(shape, dtype=torch.bfloat16)
    _, flat, new, _ = fastdiff.diff_and_update(cur, snapshot)
    assert flat is not None and new is not None
    assert same_bits(snapshot, cur.to(torch.bfloat16))
    assert same_bits(new, cur.to(torch.bfloat16).reshape(-1)[flat])


@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_past_dense_above_only_counts_and_moves_the_snapshot(pair: tuple[torch.dtype, torch.dtype]) -> None:
    g = torch.Generator().manual_seed(3)
    cur = torch.randn(70_001, generator=g).to(pair[0])
    snapshot = cur.to(pair[1]).clone()
    cur[::3] += 1.0  # a third of the elements
    expect = reference(cur, snapshot)[0].numel()
    assert fastdiff.diff_and_update(cur, snapshot.clone(), dense_above=0.5).flat is not None
    changed, flat, new, old = fastdiff.diff_and_update(cur, snapshot, dense_above=0.25)
    assert changed == expect and flat is None and new is None and old is None
    assert same_bits(snapshot, cur.to(pair[1]))


@pytest.mark.parametrize("expect", [None, 0, 30_000, 50_000], ids=["two-passes", "all-spill", "some-spill", "one-pass"])
@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_large_tensors_take_the_threaded_kernels(pair: tuple[torch.dtype, torch.dtype], expect: int | None) -> None:
    n = fastdiff.PARALLEL_MIN + 77  # and a partial last word
    g = torch.Generator().manual_seed(4)
    cur = torch.randn(n, generator=g).to(pair[0])
    snapshot = cur.to(pair[1]).clone()
    cur[torch.rand(n, generator=g) < 0.01] += 0.5  # ~42k changes, ~650 a chunk
    cur[: 1 << 16] += 0.5  # and one chunk changed everywhere: it spills whatever the room
    expect_flat, expect_new, expect_old = reference(cur, snapshot)
    changed, flat, new, old = fastdiff.diff_and_update(cur, snapshot, expect=expect)
    assert changed == expect_flat.numel() and flat is not None and new is not None and old is not None
    assert torch.equal(flat, expect_flat) and same_bits(new, expect_new) and same_bits(old, expect_old)
    assert same_bits(snapshot, cur.to(pair[1]))


@pytest.mark.parametrize("room", ["none", "some", "all"])
@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_the_serial_one_pass_collects_what_overflows_its_room(pair: tuple[torch.dtype, torch.dtype], room: str) -> None:
    """Below ``PARALLEL_MIN`` the pass collects into room for 1.5x ``expect``: the changes
    past it come from the marks after, in order, and the snapshot ends where it would."""
    n = 200_003  # a partial last word
    g = torch.Generator().manual_seed(9)
    cur = torch.randn(n, generator=g).to(pair[0])
    snapshot = cur.to(pair[1]).clone()
    cur[torch.rand(n, generator=g) < 0.05] += 0.5
    expect_flat, expect_new, expect_old = reference(cur, snapshot)
    expect = {"none": 0, "some": expect_flat.numel() // 3, "all": expect_flat.numel()}[room]
    changed, flat, new, old = fastdiff.diff_and_update(cur, snapshot, expect=expect)
    assert changed == expect_flat.numel() and flat is not None and new is not None and old is not None
    assert torch.equal(flat, expect_flat) and same_bits(new, expect_new) and same_bits(old, expect_old)
    assert same_bits(snapshot, cur.to(pair[1]))


def test_the_threaded_one_pass_is_for_sparse_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``THREADED_ONE_PASS_BELOW`` expected changed, a large tensor is compared in two
    passes (the one pass would write each change twice); below, in one."""
    n = fastdiff.PARALLEL_MIN
    calls: list[int] = []
    one_pass = fastdiff._THREADED_ONE_PASS

    def counted(*args: object) -> None:
        calls.append(1)
        one_pass.mark_collect(*args)

    monkeypatch.setattr(fastdiff, "_THREADED_ONE_PASS", fastdiff.ChunkedOnePass(counted, one_pass.compact))
    cur = torch.randn(n)
    snapshot = cur.to(torch.bfloat16)
    cur[::7] += 1.0
    expected = reference(cur, snapshot)[0]
    dense_expect = int(n * fastdiff.THREADED_ONE_PASS_BELOW) + 1
    for expect, passes in ((dense_expect, 0), (dense_expect - 2, 1)):
        work = snapshot.clone()
        flat = fastdiff.diff_and_update(cur, work, expect=expect).flat
        assert flat is not None and torch.equal(flat, expected) and len(calls) == passes


def _kernel_outputs(parallel: bool, cur: torch.Tensor, snapshot: torch.Tensor) -> tuple[np.ndarray, ...]:
    """Marks, counts and collected changes from one build of the kernels (``snapshot`` is moved)."""
    mark, collect = fastdiff._KERNELS[parallel].mark, fastdiff._KERNELS[parallel].collect
    n = cur.numel()
    cur_u, snap_u = fastdiff._bits(cur), fastdiff._bits(snapshot)
    rounding = cur.dtype != snapshot.dtype
    marks = np.empty(-(-n // 64), dtype=np.uint64)
    counts = np.empty(-(-marks.size // fastdiff.CHUNK_WORDS), dtype=np.int64)
    mark(cur_u, snap_u, rounding, marks, counts)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    total = int(offsets[-1])
    flat, new, old = np.empty(total, dtype=np.int64), np.empty(total, dtype=snap_u.dtype), np.empty(total, dtype=snap_u.dtype)
    collect(cur_u, snap_u, rounding, marks, offsets, fastdiff._NO_CHUNKS, flat, new, old)
    return marks, counts, flat, new, old, snap_u.copy()


@pytest.mark.parametrize("pair", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)])
@pytest.mark.parametrize("n", [1, 4095, 4097, 3 * 65536 + 5])
def test_parallel_and_serial_kernels_agree_bit_for_bit(pair: tuple[torch.dtype, torch.dtype], n: int) -> None:
    g = torch.Generator().manual_seed(n)
    cur = torch.randn(n, generator=g).to(pair[0])
    snapshot = cur.to(pair[1])
    snapshot.view(BITS[snapshot.element_size()])[torch.rand(n, generator=g) < 0.05] += 1
    expected = (cur.to(pair[1]).view(BITS[snapshot.element_size()]) != snapshot.view(BITS[snapshot.element_size()])).numpy()
    packed = np.packbits(np.concatenate([expected, np.zeros(-n % 64, dtype=bool)]), bitorder="little").view(np.uint64)
    serial = _kernel_outputs(False, cur, snapshot.clone())
    threaded = _kernel_outputs(True, cur, snapshot.clone())
    assert np.array_equal(serial[0], packed)  # bit i of the marks is element i
    for a, b in zip(serial, threaded):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("expect", [None, 10, 5000])
def test_the_dense_rule_samples_the_snapshot_as_it_was(expect: int | None) -> None:
    """Whether one pass has moved the snapshot by the time the count is known or not, the
    rule's sample is the differences against the version before."""
    g = torch.Generator().manual_seed(8)
    cur = torch.randn(50_000, generator=g)
    snapshot = cur.to(torch.bfloat16)
    cur[torch.rand(50_000, generator=g) < 0.1] += 0.01
    step = max(1, cur.numel() // fastdiff.SAMPLE)
    wanted = fastdiff.sampled_differences(cur, snapshot, step)
    assert wanted.numel() > 50
    seen: list[torch.Tensor] = []

    def rule(total: int, sample: Callable[[], torch.Tensor]) -> bool:
        seen.append(sample())
        return False

    fastdiff.diff_and_update(cur, snapshot, rule, expect)
    (got,) = seen
    assert torch.equal(got, wanted)


def test_the_two_builds_are_distinct_functions() -> None:
    """numba's cache does not key on ``parallel``: one function compiled twice would load
    one build for both. The threaded dispatch must hold its own, parallel, functions."""
    serial, threaded = fastdiff._KERNELS[False], fastdiff._KERNELS[True]
    for s, t in zip(serial, threaded):
        assert s is not t and s.py_func is not t.py_func
        assert s.py_func.__qualname__ != t.py_func.__qualname__  # so separate cache files
        assert s.targetoptions["parallel"] is False and t.targetoptions["parallel"] is True


_PROBE = """
import sys, numba, torch
from sender.diff import fastdiff
cur = torch.randn(fastdiff.PARALLEL_MIN if sys.argv[1] == "large" else 1000)
fastdiff.diff_and_update(cur, torch.zeros(cur.numel(), dtype=torch.bfloat16))
try:
    print(numba.threading_layer())
except ValueError:
    print("no threads")
"""


def test_threaded_dispatch_runs_threaded_code_after_a_serial_cache(tmp_path: Path) -> None:
    """A fresh cache filled by a process that ran only the serial build must not hand
    that build to the next process's threaded dispatch: there the thread pool starts."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}

    def probe(size: str) -> str:
        done = subprocess.run([sys.executable, "-c", _PROBE, size], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert probe("small") == "no threads"  # serial only: cached under the serial functions' names
    assert any(tmp_path.rglob("*.nbi"))
    assert probe("large") != "no threads"


def torch_sampled_differences(cur: torch.Tensor, snapshot: torch.Tensor, step: int) -> torch.Tensor:
    """The torch ops the kernel replaces on CPU. Cast whole, then strided: torch's strided
    fp32 -> bf16 cast turns NaN into 0x7FC0 where its contiguous one (the snapshot's) gives 0xFFFF."""
    bits = BITS[snapshot.element_size()]
    new = cur.reshape(-1).to(snapshot.dtype)[::step]
    diffs = (new.view(bits) - snapshot.reshape(-1)[::step].view(bits)).to(torch.int64)
    return diffs[diffs != 0]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 20_000),
    step=st.integers(1, 300),
    pair=st.sampled_from([(torch.float32, torch.bfloat16), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float16, torch.float16), (torch.int64, torch.int64)]),
    seed=st.integers(0, 2**16),
    transposed=st.booleans(),
)
def test_sampled_differences_match_torch(n: int, step: int, pair: tuple[torch.dtype, torch.dtype], seed: int, transposed: bool) -> None:
    state_dtype, receiver_dtype = pair
    g = torch.Generator().manual_seed(seed)
    if state_dtype.is_floating_point:
        base = torch.randn(n, generator=g) * 0.02
        base[torch.rand(n, generator=g) < 0.1] = torch.tensor(SPECIALS)[torch.randint(0, len(SPECIALS), (1,), generator=g)]
        cur = (base + torch.randn(n, generator=g) * 1e-3).to(state_dtype)
        snapshot = base.to(receiver_dtype)
    else:  # differences that wrap at the width: the extremes of int64
        snapshot = torch.randint(-9, 9, (n,), generator=g, dtype=torch.int64)
        snapshot[0] = torch.iinfo(torch.int64).min
        cur = snapshot.clone()
        cur[0] = torch.iinfo(torch.int64).max
    if transposed and n % 2 == 0:  # a non-contiguous state: compared in its logical order
        cur = cur.view(2, n // 2).t().contiguous().t()
        snapshot = snapshot.view(2, n // 2).contiguous()
    got = fastdiff.sampled_differences(cur, snapshot, step)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch_sampled_differences(cur, snapshot, step))
