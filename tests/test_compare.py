"""The device compare (sender/diff/compare_device.py) against the host compare, on CPU tensors.

Both must hand the encoder the same changes (positions, new and old bits, counts, dense
decisions, whole copies) and leave the same snapshot, whatever the dtypes, shapes and
special values; and the device compare's structure must be what a GPU needs: host syncs
bounded per run, the same for 48 tensors as for 480, kernels that do not grow with the
tensors beyond a small constant each, and no numba.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_device_codec import SyncCounter

from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from sender.diff import runs
from sender.diff.changes import Changes, plan_groups
from sender.diff.compare import choose, make_compare
from sender.diff.compare_device import DeviceCompare
from sender.diff.compare_host import HostCompare
from sender.diff.snapshot import Snapshot
from sender.plan import SyncPlan
from sender.stats import SyncStats

RECEIVERS = (torch.bfloat16, torch.float16, torch.float32)
INTEGERS = (torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SPECIALS = (float("nan"), -float("nan"), -0.0, 0.0, float("inf"), 1e-40)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.element_size()])


def compare_of(
    kind: str, state: dict[str, torch.Tensor], receivers: dict[str, torch.dtype], group_numel: int = 0, dense_above: Any = "auto",
    snapshot_device: str = "cpu",
) -> HostCompare | DeviceCompare:
    """A ``kind`` compare of ``state`` (each key to its receiver dtype), captured, with its own snapshot."""
    config = load_config({"type": "patch", "patch": {"group_numel": group_numel, "dense_above": dense_above}})
    metadata = ModelMetadata.of({k: t.to(receivers.get(k, t.dtype)) for k, t in state.items()})
    plan = SyncPlan(resolve_state(state), metadata, config.init_sync)
    compare = make_compare(kind, plan, config.patch.options(), Snapshot(snapshot_device), plan_groups(plan, group_numel), stage=True)
    compare.capture(state)
    return compare


def compares(
    state: dict[str, torch.Tensor], receivers: dict[str, torch.dtype], group_numel: int = 0, dense_above: Any = "auto"
) -> tuple[HostCompare | DeviceCompare, HostCompare | DeviceCompare]:
    """A host and a device compare of ``state``, captured."""
    host = compare_of("host", state, receivers, group_numel, dense_above)
    device = compare_of("device", state, receivers, group_numel, dense_above)
    assert isinstance(host, HostCompare) and isinstance(device, DeviceCompare)
    return host, device


def collected(compare: HostCompare | DeviceCompare, state: dict[str, torch.Tensor]) -> tuple[dict[Any, Changes], SyncStats]:
    stats = SyncStats(1, "patch")
    changes = compare.collect(state, stats, lambda c: c)
    by_entry = {(c.key, c.group): c for c in changes}
    assert len(by_entry) == len(changes)
    return by_entry, stats


def assert_same(host: HostCompare | DeviceCompare, device: HostCompare | DeviceCompare, state: dict[str, torch.Tensor]) -> None:
    """One version through both: the same changes, stats and snapshot."""
    want, want_stats = collected(host, state)
    got, got_stats = collected(device, state)
    assert got_stats == want_stats
    assert got.keys() == want.keys()
    for entry, w in want.items():
        g = got[entry]
        assert (g.shape, g.nnz) == (w.shape, w.nnz) and not g.kept, entry
        assert (g.flat is None) == (w.flat is None), entry  # the same dense decision at compare time
        if w.flat is not None:
            assert g.flat is not None and g.new is not None and g.old is not None and w.new is not None and w.old is not None
            assert not g.flat.dtype.is_floating_point and torch.equal(g.flat.long(), w.flat.long()), entry
            assert torch.equal(bits(g.new), bits(w.new)) and torch.equal(bits(g.old), bits(w.old)), entry
        assert (g.dense is None) == (w.dense is None), entry
        if w.dense is not None:
            assert g.dense is not None and torch.equal(bits(g.dense), bits(w.dense)), entry
    for key, w in host.snapshot.tensors.items():
        assert torch.equal(bits(device.snapshot.tensors[key]), bits(w)), key


def moved(t: torch.Tensor, share: float, gen: torch.Generator) -> torch.Tensor:
    """``t`` with a ``share`` of its elements moved (at least one when share > 0), specials among them."""
    out = t.clone()
    if t.numel() == 0 or share == 0:
        return out
    flat = out.view(-1)
    mask = torch.rand(t.numel(), generator=gen) < share
    mask[torch.randint(0, t.numel(), (1,), generator=gen)] = True
    if t.dtype == torch.bool:
        flat[mask] = ~flat[mask]
    elif t.dtype != torch.float32:  # a bf16 or fp16 model: any bits, NaN payloads and -0.0 among them
        width = _BITS[t.element_size()]
        flat.view(width)[mask] = torch.randint(-(2**15), 2**15, (int(mask.sum()),), generator=gen, dtype=torch.int64).to(width)
    elif t.dtype.is_floating_point:
        flat[mask] += torch.randn(int(mask.sum()), generator=gen) * 1e-2
        pick = torch.randint(0, len(SPECIALS), (t.numel(),), generator=gen)
        specials = torch.tensor(SPECIALS)[pick]
        flat.copy_(torch.where(mask & (torch.rand(t.numel(), generator=gen) < 0.1), specials, flat))
    else:
        flat[mask] += torch.randint(1, 5, (int(mask.sum()),), generator=gen, dtype=t.dtype)
    return out


@st.composite
def models(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.dtype], list[dict[str, float]], int]:
    """A state of fp32 masters, bf16/fp16 weights and integer buffers, each key's receiver
    dtype, the shares of each key's elements two versions move, and a seed."""
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    count = draw(st.integers(1, 7))
    state: dict[str, torch.Tensor] = {}
    receivers: dict[str, torch.dtype] = {}
    receiver = draw(st.sampled_from(RECEIVERS))
    for i in range(count):
        shape = tuple(draw(st.lists(st.integers(0 if i == count - 1 else 1, 9), min_size=0, max_size=4)))
        if draw(st.integers(0, 3)) == 0:  # an integer buffer (a step counter, position ids, a mask)
            dtype = draw(st.sampled_from(INTEGERS))
            if dtype == torch.bool:
                t = torch.rand(shape, generator=gen) < 0.5
            else:
                t = torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen, dtype=dtype)
            state[f"t{i}"] = t
        elif draw(st.integers(0, 3)) == 0:  # a model held in bf16 or fp16 itself
            half = draw(st.sampled_from((torch.bfloat16, torch.float16)))
            state[f"t{i}"] = (torch.randn(shape, generator=gen) * 0.02).to(half)
            receivers[f"t{i}"] = half
        else:  # an fp32 master
            state[f"t{i}"] = torch.randn(shape, generator=gen) * 0.02
            receivers[f"t{i}"] = draw(st.sampled_from(RECEIVERS)) if draw(st.booleans()) else receiver
    if draw(st.booleans()):  # a tied weight: one storage under two names, compared once
        state["tied"] = state["t0"]
    shares = st.sampled_from([0.0, 1e-9, 0.01, 0.3, 0.5, 0.7, 1.0])
    versions = [{k: draw(shares) for k in state if k != "tied"} for _ in range(2)]
    return state, receivers, versions, seed


@pytest.fixture(scope="module")
def no_kernel_warm_up() -> Iterator[None]:
    """A host compare compiles (or loads) its kernels at every capture: once is enough here."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(HostCompare, "warm_up", lambda self, pairs: None)
        yield


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    model=models(), group_numel=st.sampled_from([0, 40, 4096]), dense_above=st.sampled_from(["auto", 0.25, 1.0]),
    run_numel=st.sampled_from([runs.RUN_NUMEL, 256]),
)
def test_the_device_compare_finds_the_host_compares_changes(
    model: tuple[dict[str, torch.Tensor], dict[str, torch.dtype], list[dict[str, float]], int], group_numel: int, dense_above: Any,
    run_numel: int, no_kernel_warm_up: None,
) -> None:
    """fp32 masters to bf16/fp16/fp32 snapshots, bf16/fp16 weights, integer buffers; NaN
    (either sign, any payload), -0.0, all or one or no element changed, 0-d to 4-d and
    empty tensors, groups, tied weights, runs sharing a work buffer (``run_numel`` 256),
    two versions: the same changes, dense decisions and snapshot."""
    state, receivers, versions, seed = model
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runs, "RUN_NUMEL", run_numel)
        host, device = compares(state, receivers, group_numel, dense_above)
    gen = torch.Generator().manual_seed(seed + 1)
    for shares in versions:
        for key, share in shares.items():
            state[key].copy_(moved(state[key], share, gen))  # in place: a tied alias moves with it
        assert_same(host, device, state)


def test_the_edges_one_by_one() -> None:
    """Nothing changed, one element of a 0-d tensor, -0.0 and a NaN's sign, all changed; a
    0-d fp32 NaN cast to bf16 as the fused kernels and torch's loops cast it (0xFFFF: torch
    casts a 0-d tensor by another path, to 0x7FC0)."""
    state = {"s": torch.tensor(1.0), "w": torch.zeros(3, 5), "n": torch.full((7,), float("nan")), "i": torch.arange(6), "z": torch.tensor(2.0)}
    host, device = compares(state, dict.fromkeys(("s", "w", "n", "z"), torch.bfloat16))
    assert_same(host, device, state)  # nothing changed
    state["s"] += 1
    state["z"].fill_(float("nan"))
    state["w"][1, 2] = -0.0
    state["n"][3] = -float("nan")
    assert_same(host, device, state)
    for t in state.values():
        t.add_(1)
    assert_same(host, device, state)


# -- structure ---------------------------------------------------------------------------------
class CompareCounter(SyncCounter):
    """``SyncCounter``, counting besides: explicit copies to the host (``.to("cpu")``, a
    device-to-host copy on a GPU, whatever the source here), and kernels (ops that are not
    views: what a GPU launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name == "aten::_to_copy" and str((kwargs or {}).get("device")) == "cpu":
            self.syncs["to host"] += 1
        if not func.is_view:
            self.kernels += 1
        if name == "aten::nonzero_static":  # its size given: no wait (``SyncCounter`` counts it by its name's prefix)
            self.ops += 1
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def structure_model(tensors: int, total: int = 960_000) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(tensors)
    shapes = [(total // tensors // 40, 40) if i % 2 else (total // tensors,) for i in range(tensors)]
    return {f"w{i}": torch.randn(shape, generator=gen) for i, shape in enumerate(shapes)}


def structure_step(state: dict[str, torch.Tensor]) -> None:
    """1% of every tensor moved; the first two half moved (their dense rule reads a
    sample) and the third all (it goes whole)."""
    gen = torch.Generator().manual_seed(7)
    for i, t in enumerate(t for t in state.values() if t.is_floating_point()):
        share = 0.5 if i < 2 else 1.0 if i == 2 else 0.01
        t.view(-1).add_((torch.rand(t.numel(), generator=gen) < share) * 0.05)


def counted_build(tensors: int) -> tuple[CompareCounter, SyncStats]:
    state = structure_model(tensors)
    device = compare_of("device", state, dict.fromkeys(state, torch.bfloat16))
    structure_step(state)
    stats = SyncStats(1, "patch")
    with CompareCounter() as counter:
        device.collect(state, stats, lambda c: c)
    return counter, stats


def test_host_syncs_per_version_are_per_run_not_per_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 48-tensor and a 480-tensor model of the same elements (one run each): the same
    host syncs, at most 4 a run (here 2: the counts, and the samples of the two tensors
    the dense rule reads); kernels grow by at most 2 a tensor (measured: 1, the cast copy
    into the run), and no numba kernel is called."""
    from sender.diff import fastdiff

    def numba(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a numba kernel on the device path")

    for name in ("diff_and_update", "sampled_differences", "supported", "warm_up"):
        monkeypatch.setattr(fastdiff, name, numba)
    small, small_stats = counted_build(48)
    large, large_stats = counted_build(480)
    assert small_stats.tensors_changed == 48 and large_stats.tensors_changed == 480
    assert small.syncs == large.syncs, (small.syncs, large.syncs)
    assert set(small.syncs) == {"to host"} and sum(small.syncs.values()) == 2
    assert (large.kernels - small.kernels) / (480 - 48) <= 2, (small.kernels, large.kernels)
    assert (large.ops - small.ops) / (480 - 48) <= 12, (small.ops, large.ops)


def test_the_device_path_calls_no_numba() -> None:
    """In a fresh process, a device compare's capture and two versions leave every numba
    dispatcher uncompiled (none called), if numba was imported at all."""
    code = """
import torch
from test_compare import compare_of, structure_model, structure_step
from sender.stats import SyncStats
state = structure_model(12, 12_000)
state["steps"] = torch.tensor(3)
device = compare_of("device", state, {k: torch.bfloat16 for k in state if k != "steps"}, group_numel=2000)
for _ in range(2):
    structure_step(state)
    state["steps"] += 1
    assert device.collect(state, SyncStats(1, "patch"), lambda c: c)
"""
    run_calling_no_numba(code)


def run_calling_no_numba(code: str) -> None:
    """Run ``code`` in a fresh Python (tests/ and the repo on its path), then check that it
    left every numba dispatcher uncompiled (none called), if numba was imported at all."""
    check = """
import gc as _gc, sys as _sys
_numba = _sys.modules.get("numba")
if _numba is not None:
    _called = [d for d in _gc.get_objects() if isinstance(d, _numba.core.dispatcher.Dispatcher) and d.signatures]
    assert not _called, _called
"""
    root = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root.parent), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code + check], check=True, timeout=300, cwd=root.parent, env=env)


def test_auto_compares_on_the_device_where_the_tensors_are_on_cuda() -> None:
    assert choose("auto", False) == "host" and choose("device", False) == "device" and choose("host", False) == "host"
    assert choose("auto", True) == "device" and choose("host", True) == "host"


def test_tensors_that_moved_device_or_became_dtensors_are_compared_one_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run whose tensors are no longer plain tensors of its device falls back to the
    per-tensor path, with the same result, and runs again once they are back."""
    from sender.diff import compare_device

    state = structure_model(6, 6000)
    host, device = compares(state, dict.fromkeys(state, torch.bfloat16))
    assert isinstance(device, DeviceCompare)
    structure_step(state)
    monkeypatch.setattr(compare_device, "is_dtensor", lambda t: True)
    fallback = []
    real = device._host.collect
    monkeypatch.setattr(device._host, "collect", lambda *a: fallback.append(1) or real(*a))
    assert_same(host, device, state)
    assert fallback
    monkeypatch.undo()
    structure_step(state)
    assert_same(host, device, state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("snapshot_device", ["cpu", "cuda"])
def test_on_cuda_the_same_changes_with_two_host_syncs(snapshot_device: str) -> None:
    """CUDA tensors, a CUDA or pinned host snapshot: the changes of a CPU host compare,
    staged to the host behind events, with the run's two syncs (CUDA's sync debug mode
    warns at each) and none hidden elsewhere."""
    state = structure_model(48)
    cuda = {k: t.cuda() for k, t in state.items()}
    host = compare_of("host", state, dict.fromkeys(state, torch.bfloat16))
    device = compare_of("auto", cuda, dict.fromkeys(state, torch.bfloat16), snapshot_device=snapshot_device)
    assert isinstance(device, DeviceCompare)
    structure_step(state)
    structure_step(cuda)
    want, _ = collected(host, state)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, _ = collected(device, cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 2, [str(w.message) for w in caught]
    assert got.keys() == want.keys()
    for entry, w in want.items():
        g = got[entry]
        g.wait()
        assert g.nnz == w.nnz and (g.flat is None) == (w.flat is None)
        if w.flat is not None:
            assert g.flat is not None and g.flat.device.type == "cpu" and torch.equal(g.flat.long(), w.flat.long())
            assert g.new is not None and w.new is not None and torch.equal(bits(g.new), bits(w.new))
    torch.cuda.synchronize()
    for key, w in host.snapshot.tensors.items():
        assert torch.equal(bits(device.snapshot.tensors[key].cpu()), bits(w)), key


def test_the_benchmark_times_both_compares_on_a_small_model(tmp_path: Path) -> None:
    """``python -m benchmarks.device_compare`` on a small model: both compares find the same changes."""
    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import device_compare as bench

    out = tmp_path / "compare.json"
    assert bench.main(["--numel", "40000", "--tensors", "4", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["host"]["changed"] == result["device"]["changed"] > 0
    assert result["read_floor_seconds"] > 0 and result["device"]["over_floor"] > 0
