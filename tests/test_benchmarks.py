"""Smoke tests of the benchmark harness: its pure functions on hand-worked cases, and one
tiny workload through the real Sender/Receivers (stub peers) for the result's keys."""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.e2e import finish, run_workload  # noqa: E402
from benchmarks.floor import (  # noqa: E402
    binary_entropy,
    entropy_floor_bits,
    order0_entropy,
    seed_format_bytes,
    tensor_change,
    unsigned_width,
    update_sizes,
)
from benchmarks.peers import digest  # noqa: E402
from benchmarks.phases import PHASES, breakdown  # noqa: E402
from benchmarks.report import RESULT_KEYS, TOP_KEYS, evaluate_targets, missing_keys, table  # noqa: E402
from benchmarks.rollout import RemoteReceivers  # noqa: E402
from benchmarks.workloads import SyntheticWorkload, perturb_ulps  # noqa: E402


def bf16(bits: list[int], shape: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.tensor(bits, dtype=torch.int16).view(torch.bfloat16)
    return t.reshape(shape) if shape else t


# -- the entropy floor -------------------------------------------------------------------------
def test_entropies_by_hand() -> None:
    assert binary_entropy(0.25) == pytest.approx(0.25 * 2 + 0.75 * math.log2(4 / 3))  # 0.811278
    assert binary_entropy(0.0) == binary_entropy(1.0) == 0.0
    assert order0_entropy(torch.tensor([1, -1, 1, -1])) == pytest.approx(1.0)
    assert order0_entropy(torch.tensor([3, 1, 7, 1])) == pytest.approx(1.5)  # 1/2, 1/4, 1/4


def test_entropy_floor_of_two_one_ulp_moves() -> None:
    # 8 elements, 2 change: positions 8*H(1/4) bits; ulp diffs +1/-1 -> 1 bit each
    # (XOR 200^201 = 1 and 600^599 = 15: also 1 bit each).
    old = bf16([100, 200, 300, 400, 500, 600, 700, 800])
    new = bf16([100, 201, 300, 400, 500, 599, 700, 800])
    change = tensor_change(old, new)
    assert change.flat.tolist() == [1, 5] and change.ulp.tolist() == [1, -1]
    assert entropy_floor_bits(change) == pytest.approx(8 * 0.8112781244591328 + 2 * 1.0)


def test_entropy_floor_takes_the_lower_of_ulp_and_xor() -> None:
    # 16 elements, 4 move by exactly +1 ulp: the ulp difference has entropy 0, while the
    # XORs (1^2, 2^3, 3^4, 4^5 = 3, 1, 7, 1) have 1.5 bits; the floor is positions only.
    old_bits = list(range(1, 17))
    new_bits = [b + 1 if i < 4 else b for i, b in enumerate(old_bits)]
    change = tensor_change(bf16(old_bits), bf16(new_bits))
    assert order0_entropy(change.xor) == pytest.approx(1.5)
    assert entropy_floor_bits(change) == pytest.approx(16 * 0.8112781244591328)
    sizes = update_sizes({"a": bf16(old_bits)}, {"a": bf16(new_bits)})
    assert sizes.entropy_floor_bytes == pytest.approx(16 * 0.8112781244591328 / 8)
    assert sizes.density == 0.25 and sizes.dense_bytes == 32


def test_no_change_costs_nothing() -> None:
    t = bf16([1, 2, 3])
    change = tensor_change(t, t.clone())
    assert entropy_floor_bits(change) == 0.0 and seed_format_bytes(change) == 0


# -- the seed's format -------------------------------------------------------------------------
def test_unsigned_width() -> None:
    assert [unsigned_width(x) for x in (0, 255, 256, 65535, 65536, 2**32 - 1, 2**32)] == [1, 1, 2, 2, 4, 4, 8]


def test_seed_format_bytes_by_hand() -> None:
    # (3, 4) matrix, changes at flat 1, 2, 9 -> rows 0, 0, 2 and cols 1, 2, 1.
    # Delta: rows 0, 0, 2 (uint8); cols 1 (new row: absolute), 2-1 = 1, 1 (new row) (uint8);
    # values bf16: 3 * (1 + 1 + 2) = 12 bytes.
    old = torch.zeros(3, 4, dtype=torch.bfloat16)
    new = old.clone()
    new.view(-1)[[1, 2, 9]] = 1.0
    assert seed_format_bytes(tensor_change(old, new)) == 12
    # (2, 300): flat 0, 299, 300 -> rows 0, 0, 1; cols 0, 299, 0 -> delta cols 0, 299, 0 needs
    # uint16: 3 * (1 + 2 + 2) = 15 bytes in bf16, 3 * (1 + 2 + 4) = 21 in fp32.
    for dtype, want in ((torch.bfloat16, 15), (torch.float32, 21)):
        old = torch.zeros(2, 300, dtype=dtype)
        new = old.clone()
        new.view(-1)[[0, 299, 300]] = 1.0
        assert seed_format_bytes(tensor_change(old, new)) == want
    # (300, 2): flat 0, 599 -> rows 0, 299 (delta 0, 299: uint16); cols 0, 1 (uint8): 2 * (2 + 1 + 2).
    old = torch.zeros(300, 2, dtype=torch.bfloat16)
    new = old.clone()
    new.view(-1)[[0, 599]] = 1.0
    assert seed_format_bytes(tensor_change(old, new)) == 10


# -- the synthetic workload --------------------------------------------------------------------
def test_perturb_ulps_moves_each_chosen_element_by_one_to_three_ulp() -> None:
    t = (torch.randn(64, 64) * 0.02).to(torch.bfloat16)
    before = t.clone()
    moved = perturb_ulps(t, 0.5, torch.Generator().manual_seed(0))
    change = tensor_change(before, t)
    assert change.changed == moved and 0.4 < moved / t.numel() < 0.6
    assert set(change.ulp.abs().tolist()) <= {1, 2, 3} and (change.ulp > 0).any() and (change.ulp < 0).any()


# -- the result document -----------------------------------------------------------------------
class StubPeers:
    """Stands in for PeerGroup (no processes): sizes from the tensors, made-up times."""

    def setup(self, tensors: dict[str, torch.Tensor]) -> None:
        self.last = tensors

    def _nbytes(self, tensors: dict[str, torch.Tensor]) -> int:
        self.last = tensors
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def safetensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"e2e_s": 0.01, "write_s": 0.005, "load_s": 0.005, "bytes": self._nbytes(tensors)}

    def gloo(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"e2e_s": 0.01, "pack_s": 0.001, "bytes": self._nbytes(tensors)}

    def digests(self) -> list[str]:
        return [digest(self.last)] * 2


@pytest.mark.timeout(60)
async def test_result_objects_have_every_required_key() -> None:
    w = SyntheticWorkload("synthetic-tiny", 0.05, [(64, 32), (16,)], measured_steps=1)
    run = await run_workload(w, StubPeers(), memory_pass=False)  # type: ignore[arg-type]
    result = finish(run, copy_bps=1e9, zmq_bps=1e9)
    assert result["verified_bit_exact"] is True
    assert result["wire_bytes"] > 0 and result["dense_bytes"] == (64 * 32 + 16) * 2
    assert result["entropy_floor_bytes"] <= result["wire_bytes"]
    doc: dict[str, Any] = {
        "suite": "test", "command": "pytest", "machine": {"platform": "x", "cpus": 1, "torch": torch.__version__},
        "copy_Bps": 1e9, "zmq_raw_Bps": 1e9, "results": [result], "targets": evaluate_targets([result]),
    }
    assert missing_keys(doc) == []
    assert set(RESULT_KEYS) <= set(result) and set(TOP_KEYS) <= set(doc)
    checks = doc["targets"]["workloads"]["synthetic-tiny"]
    assert {"build_vs_read_floor", "bucket_vs_zmq_raw"} <= set(checks)
    assert all(isinstance(c["pass"], bool) and c["ratio"] > 0 for c in checks.values())
    json.loads(json.dumps(doc, default=str))
    assert "synthetic-tiny" in table(doc)
    # every phase timed, for the patch path per step and as medians (receivers included)
    for phased in (result["patch_phases_ms"], run["steps"][0]["patch_phases_ms"]):
        assert set(PHASES) <= set(phased)
        assert all(phased[k] is not None and phased[k] >= 0 for k in PHASES if k != "other")
        assert phased["encode"] > 0 and phased["frame"] > 0 and phased["send"] > 0 and phased["decode"] > 0 and phased["validate"] > 0
        assert phased["e2e"] == pytest.approx(sum(phased[k] for k in PHASES))
        assert phased["cpu_sender"] > 0 and phased["cpu_receivers"] > 0  # the CPU time beside them, not stacked


@pytest.mark.timeout(60)
async def test_a_device_coded_row_times_its_compare() -> None:
    """``patch.codec: device`` (the quick suite's device row): the device compare's runs are
    timed as the ``mark`` phase, not left to ``per_tensor``; bit-exact all the same."""
    w = SyntheticWorkload("synthetic-tiny-device", 0.05, [(64, 32), (16,)], measured_steps=1)
    w.patch = {"codec": "device"}
    run = await run_workload(w, StubPeers(), memory_pass=False)  # type: ignore[arg-type]
    result = finish(run, copy_bps=1e9, zmq_bps=1e9)
    assert result["verified_bit_exact"] is True
    assert run["steps"][0]["patch_phases_ms"]["mark"] > 0


async def test_workers_that_fail_to_start_are_reaped_with_their_pipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollout worker that exits before ``ready`` (a spec it cannot build) fails the harness
    at once, and every worker is killed and reaped and its pipes closed and read to the end:
    none outlives the run, and no transport is left for the garbage collector to close after
    the event loop (a later test then failed on that unraisable error)."""
    procs: list[asyncio.subprocess.Process] = []
    spawn = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kw: Any) -> asyncio.subprocess.Process:
        procs.append(await spawn(*args, **kw))
        return procs[-1]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    with pytest.raises(RuntimeError, match="expected 'ready'"):
        await RemoteReceivers.start({}, "tcp://127.0.0.1:1", {"type": "patch"}, "broken", count=2)
    assert len(procs) == 2
    for p in procs:
        assert p.returncode is not None
        assert p.stdin is not None and p.stdin.is_closing()
        assert p.stdout is not None and p.stdout.at_eof()


def test_phase_breakdown_by_hand() -> None:
    ms = 1_000_000
    sender = {"sums_ns": {"mark": 2 * ms, "collect": 1 * ms, "frame": ms // 2, "send": ms}, "last_ns": {"send": 100 * ms}}
    fast = {"decode_s": 0.004, "apply_s": 0.001,
            "phases": {"sums_ns": {"validate": ms, "decode": 3 * ms, "stage_calls": ms}, "last_ns": {"arrived": 101 * ms, "ack": 106 * ms}}}
    slow = {"decode_s": 0.006, "apply_s": 0.002,
            "phases": {"sums_ns": {"validate": ms, "decode": 4 * ms, "stage_calls": 2 * ms}, "last_ns": {"arrived": 103 * ms, "ack": 110 * ms}}}
    out = breakdown(sender, [fast, None, slow], build_s=0.005, encode_s=0.010, e2e_s=0.040, started_ns=80 * ms, ended_ns=111 * ms)
    assert out["mark"] == 2 and out["collect"] == 1 and out["per_tensor"] == pytest.approx(2)  # 5 ms of build, less the kernels
    assert out["encode"] == pytest.approx(10) and out["frame"] == 0.5 and out["send"] == 1
    # the receiver that acknowledged last is the critical path
    assert out["receive"] == 3 and out["validate"] == 1 and out["decode"] == 4 and out["stage"] == 2
    assert out["commit"] == pytest.approx(2) and out["ack"] == 1
    assert out["other"] == pytest.approx(40 - (2 + 1 + 2 + 10 + 0.5 + 1 + 3 + 1 + 4 + 2 + 2 + 1))
    no_receivers = breakdown(sender, [None], 0.005, 0.010, 0.040, 80 * ms, 111 * ms)
    assert no_receivers["decode"] is None and no_receivers["other"] == pytest.approx(40 - 16.5)
    # CPU time beside the phases: the sender's, and every receiver's summed
    sender["cpu_ns"] = 30 * ms
    fast["phases"]["cpu_ns"], slow["phases"]["cpu_ns"] = 12 * ms, 15 * ms
    cpu = breakdown(sender, [fast, None, slow], 0.005, 0.010, 0.040, 80 * ms, 111 * ms)
    assert cpu["cpu_sender"] == 30 and cpu["cpu_receivers"] == 27 and cpu["other"] == pytest.approx(out["other"])
    assert breakdown(sender, [None], 0.005, 0.010, 0.040, 80 * ms, 111 * ms)["cpu_receivers"] is None


def test_phase_timers_time_and_pass_through() -> None:
    from benchmarks import phases

    phases.RECORDER.take()
    wrapped = phases._timed("x", lambda a, b=1: a + b)
    assert wrapped(2, b=3) == 5 and wrapped(1) == 2
    taken = phases.RECORDER.take()
    assert taken["counts"] == {"x": 2} and taken["sums_ns"]["x"] >= 0 and taken["last_ns"]["x"] >= taken["first_ns"]["x"]
    assert phases.RECORDER.take()["counts"] == {}  # take() restarts

    def burn() -> int:  # ~20 ms of this process's CPU, measured
        started = time.process_time_ns()
        while time.process_time_ns() - started < 20_000_000:
            sum(range(10_000))
        return time.process_time_ns() - started

    burned = burn()
    assert phases.RECORDER.take()["cpu_ns"] >= burned  # counted since the last take
    burn()
    phases.RECORDER.skip_cpu()
    assert phases.RECORDER.take()["cpu_ns"] < burned / 2  # skipped: only what came after


def test_benchmarks_without_the_bench_extra_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without psutil (the memory pass) or matplotlib (--plot) the harness says how to
    install them before it runs anything, rather than dying later in a worker."""
    import importlib.util

    from benchmarks import __main__ as cli

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("psutil", "matplotlib") else real(name, *a))
    monkeypatch.setattr(cli, "run_suite", lambda *a, **k: pytest.fail("ran without its packages"))
    with pytest.raises(SystemExit) as e:
        cli.main(["--suite", "quick", "--json", "/nonexistent/x.json"])
    assert "psutil" in str(e.value) and "pip install -e '.[bench]'" in str(e.value) and "--no-memory" in str(e.value)
    with pytest.raises(SystemExit) as e:
        cli.main(["--suite", "quick", "--json", "/nonexistent/x.json", "--no-memory", "--plot", "/nonexistent/x.png"])
    assert "matplotlib" in str(e.value) and "psutil" not in str(e.value)
    assert cli.missing_packages(memory_pass=False, plot=False) == []


# -- fan-out: direct vs a relay tree -----------------------------------------------------------
async def test_fanout_tree_halves_the_trainers_egress_and_every_rollout_matches() -> None:
    """Two receiver daemons (real processes): direct, the trainer sends each version twice;
    as trainer -> relay -> leaf, once. Digests are checked inside ``run`` (it raises)."""
    from benchmarks.fanout import run as run_fanout
    from benchmarks.fanout import table as fanout_table

    doc = await run_fanout([2], fanout=1, steps=2, lr=1e-5)
    direct, tree = doc["results"]
    assert (direct["layout"], direct["first_level"], tree["layout"], tree["first_level"]) == ("direct", 2, "tree", 1)
    assert all(r["digests_equal"] and r["trainer_bytes_per_version"] > 0 for r in (direct, tree))
    assert tree["trainer_bytes_per_version"] < 0.55 * direct["trainer_bytes_per_version"]
    assert tree["trainer_bootstrap_bytes"] < 0.55 * direct["trainer_bootstrap_bytes"]
    assert "| 2 | tree | 1 |" in fanout_table(doc)


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")), reason="needs root, ip and tc")
async def test_fanout_over_a_shaped_uplink_in_a_namespace_and_cleans_up() -> None:
    """``--uplink-mbit``: the receivers run in a network namespace behind a shaped veth; the
    tree still halves the trainer's egress, digests still match, and the namespace is gone."""
    from benchmarks.fanout import run as run_fanout

    doc = await run_fanout([2], fanout=1, steps=1, lr=1e-5, uplink_mbit=400)
    direct, tree = doc["results"]
    assert "tbf 400" in doc["uplink"]
    assert tree["trainer_bytes_per_version"] < 0.55 * direct["trainer_bytes_per_version"]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "wsfan-" not in listed


# -- low bandwidth: the receivers behind a shaped link in a network namespace ------------------
def test_lowbw_suite_runs_every_path_across_the_shaped_link(tmp_path: Path) -> None:
    """``python -m benchmarks --suite lowbw --tiny``: one small workload, patch, bucket,
    safetensors (downloaded over the link) and gloo, all to receivers in a namespace behind a
    tc-tbf-shaped veth and (but gloo) a delaying proxy; each path reports a time and the
    bytes it put on the link, receivers are bit-exact, and the namespace is gone after."""
    from benchmarks.lowbw import PATHS, TIMES, why_not

    reason = why_not()
    if reason:
        pytest.skip(reason)
    out = tmp_path / "lowbw.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--suite", "lowbw", "--tiny", "--mbit", "400", "--rtt-ms", "40",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["suite"] == "lowbw" and doc["link"]["mbit"] == 400 and doc["link"]["rtt_ms"] == 40
    assert missing_keys(doc) == []
    (r,) = doc["results"]
    assert r["verified_bit_exact"] is True and r["incidents"] == 0
    for path in PATHS:
        assert r[TIMES[path]] > 0, path
        assert r["link_bytes"][path] > 0, path  # it crossed the shaped link
    # the sparse patch moves less over the link than any dense path
    assert r["link_bytes"]["patch"] < min(r["link_bytes"][p] for p in ("bucket", "safetensors", "gloo"))
    assert "| synthetic-tiny-2% |" in done.stdout
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert "wsfan-" not in listed


async def test_apply_benchmark_times_every_path_bit_exact_over_parts() -> None:
    """``benchmarks.apply`` on a small TinyLM whose patch travels in several parts: every
    path ends bit-exact (the benchmark asserts it) and each is reported."""
    from benchmarks.apply import case

    shape = {"vocab": 512, "dim": 64, "heads": 4, "layers": 2, "context": 16}
    out = await case(1e-5, 1, {"type": "patch", "patch": {"part_bytes": 8192}}, shape)
    assert out["parts"] > 1 and out["changed"] > 0
    for path in ("weightsync", "weightsync_serial", "weightsync_commit", "index_put", "seed"):
        assert out[path]["median_s"] > 0, path
    assert out["ratio_commit"] == out["weightsync_commit"]["median_s"] / out["index_put"]["median_s"]
    assert out["seed_bytes"] > out["wire_bytes"]  # the seed's uncompressed COO is larger than the coded patch


@pytest.mark.parametrize("shape", [(7,), (1, 9), (5, 6), (4, 3, 5), (300, 2)])
def test_the_seed_format_positions_round_trip(shape: tuple[int, ...]) -> None:
    """``benchmarks.apply``'s seed path: the delta-encoded, narrowed rows and cols decode back to
    the flat positions, rows with one change, none or all included."""
    from benchmarks.apply import seed_buffers, seed_positions

    g = torch.Generator().manual_seed(len(shape))
    numel = math.prod(shape)
    for density in (0.05, 0.5, 1.0):
        flat = torch.nonzero(torch.rand(numel, generator=g) < density).squeeze(1)
        if flat.numel() == 0:
            continue
        drows, dcols = seed_buffers(flat, torch.Size(shape))
        assert drows.element_size() <= 2 and dcols.element_size() <= 2
        assert torch.equal(seed_positions(drows, dcols, torch.Size(shape)), flat)


@pytest.mark.timeout(240)
def test_the_memory_pass_measures_the_first_sync_and_the_next(tmp_path: Path) -> None:
    """Real processes (a sender, two receivers over TCP loopback): both syncs' peaks are
    reported, the receivers end at the second version, and the excess figures come out."""
    from benchmarks.e2e import memory_excess
    from benchmarks.memory import dump_state, measure

    g = torch.Generator().manual_seed(0)
    before = {"a.weight": torch.randn(256, 256, generator=g), "b.bias": torch.randn(256, generator=g)}
    after = {k: v.clone() for k, v in before.items()}
    after["a.weight"].view(-1)[::7] += 0.05  # a seventh of one tensor moves
    dump_state(before, tmp_path / "pre")
    dump_state(after, tmp_path / "post")
    mem = measure(tmp_path / "pre", tmp_path / "post", torch.bfloat16, {"type": "patch"}, receivers=2, timeout=200)
    s = mem["sender"]
    assert s["resyncs"] == 0 and s["wire_bytes"] > 0
    for report in (s, *mem["receivers"]):
        assert 0 < report["sync_peak_rss"] <= report["peak_rss"] and 0 < report["steady_peak_rss"] <= report["peak_rss"]
    assert [r["version"] for r in mem["receivers"]] == [2, 2]
    assert [r["applied_as"] for r in mem["receivers"]] == ["patch", "patch"]
    numel = 256 * 256 + 256
    last = {"dense_bytes": numel * 2, "dense_elements": numel, "wire_bytes": s["wire_bytes"], "changed_elements": numel // 7}
    excess = memory_excess(mem, last, numel * 4)
    assert set(excess) == {"sender_memory_excess", "receiver_memory_excess", "sender_steady_memory_excess", "receiver_steady_memory_excess"}
    assert all(isinstance(v, float) and math.isfinite(v) for v in excess.values())
    assert memory_excess(None, last, numel * 4) == dict.fromkeys(excess)


def test_sharded_benchmark_runs_both_builds_and_reports_the_issue_keys(tmp_path: Path) -> None:
    """``python -m benchmarks.sharded --tiny``: 2 gloo ranks, the gathering and the sharded build,
    two lrs: every record has the issue's keys, receivers bit-exact, the same changes in both
    builds (one training, twice), and the sharded build's group bytes far below the gathering one's."""
    out = tmp_path / "sharded.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.sharded", "--ranks", "2", "--tiny", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    keys = {"build", "ranks", "lr", "group_bytes_per_version", "patch_wire_bytes", "slowest_rank_build_s", "leader_build_s",
            "e2e_s", "peak_rss_bytes_per_rank", "digests_equal"}
    runs = {(r["build"], r["lr"]): r for r in doc["runs"]}
    assert set(runs) == {(b, lr) for b in ("gather", "sharded") for lr in (1e-6, 1e-5)}
    for r in runs.values():
        assert keys <= set(r) and r["ranks"] == 2 and r["digests_equal"] is True
        assert len(r["peak_rss_bytes_per_rank"]) == 2 and r["slowest_rank_build_s"] >= r["leader_build_s"] > 0
    for lr in (1e-6, 1e-5):
        gather, sharded = runs[("gather", lr)], runs[("sharded", lr)]
        assert sharded["changed_elements"] == gather["changed_elements"] > 0  # every rank's changes counted
        assert sharded["group_bytes_per_version"] < gather["group_bytes_per_version"] / 4
    assert {t["target"] for t in doc["targets"]} >= {"group bytes <= 1.5x the encoded patch", "wire bytes equal within 1%"}


def test_fp8_benchmark_reports_both_formats_per_lr_and_its_guard_holds(tmp_path: Path) -> None:
    """``python -m benchmarks.fp8`` on a small model: per lr the fp8 and bf16 patches of the
    same steps and the dense fp8 checkpoint, the fp8 rollout bit-exact against the reference
    after every version, and the fp8 patch smaller than the bf16 one (fewer elements change)."""
    out = tmp_path / "fp8.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.fp8", "--hidden", "256", "--layers", "2", "--vocab", "1024",
                           "--steps", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["guard"]["equal"] is True and [r["version"] for r in doc["rows"]] == [1, 2, 3, 4]
    for lr, m in doc["by_lr"].items():
        assert 0 < m["fp8_bytes_changed"] < m["bf16_elements_changed"], (lr, m)
        assert m["fp8_patch_bytes"] < m["bf16_patch_bytes"] and m["fp8_patch_bytes"] < m["dense_fp8_bytes"] < m["dense_bf16_bytes"]
        assert m["fp8_quantize_s"] > 0 and m["fp8_apply_s"] > 0


def test_megatron_benchmark_compares_the_sharded_sync_with_gather_and_export(tmp_path: Path) -> None:
    """``python -m benchmarks.megatron`` on a tiny Qwen2 at TP=2 (the Megatron environment only):
    per lr, ours without a single export, every path's receiver bit-exact against the bridge's
    export, the bucket send's wire at least the dense bf16 bytes, and each path's figures measured."""
    import importlib.util

    try:
        found = importlib.util.find_spec("megatron.bridge") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("megatron-bridge is not importable here: run in the Megatron environment (`make megatron-env`)")
    out = tmp_path / "megatron.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.megatron", "--layouts", "tp2", "--hidden", "64", "--layers", "2", "--vocab", "256",
                           "--intermediate", "128", "--heads", "4", "--seq", "16", "--versions", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["equal"] is True and len(doc["ru_maxrss_bytes_per_rank"]["tp2"]) == 2
    assert [(r["layout"], r["ranks"], r["lr"]) for r in doc["runs"]] == [("tp2", 2, 1e-5), ("tp2", 2, 1e-4)]
    for r in doc["runs"]:
        assert r["equal"] == {"ours": True, "dense": True, "patch": True}, r["differing"]
        assert r["ours_exports_per_version"] == 0 and r["versions"] == 1
        assert r["dense_wire_bytes"] >= r["dense_bf16_bytes"] > r["ours_wire_bytes"] > 0 and r["patch_wire_bytes"] > 0
        assert 0 < r["ours_group_bytes"] and r["ours_slowest_s"] >= r["ours_leader_s"] > 0 and r["export_slowest_s"] > 0
        assert len(r["ours_peak_bytes_per_rank"]) == len(r["export_peak_bytes_per_rank"]) == 2
        assert set(r["ratios"]) >= {"ours_slowest_over_export_slowest", "ours_wire_over_dense_bf16", "ours_wire_over_patch_wire"}
