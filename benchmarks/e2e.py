"""One workload, every path, for real: weightsync patch and bucket, safetensors, gloo.

A patch ``Sender`` and a bucket ``Sender`` (the library's public API and default patch
config) run in this process, beside the trainer; each serves two ``Receiver``s in their
own processes (``benchmarks.rollout``) over tcp loopback; all four are bootstrapped at
version 0. Each step the trainer moves, then:

* patch: ``build_s`` is the awaited ``sync()``; ``e2e_patch_s`` runs from ``sync()``'s
  start until ``wait_acked`` says both receivers applied the version;
* bucket: the same, with ``{"type": "bucket", "bucket": {"bucket_dtype": <receiver dtype>}}``;
* safetensors and gloo through ``PeerGroup`` (two worker processes);
* reference sizes (entropy floor, RLinf's format) from the bitwise difference.

Every receiver is checked bit for bit against the trainer's state at the receivers'
dtype after each measured step (not timed).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from protocol.state import StateLike
from sender import Sender

from . import memory, phases
from .floor import update_sizes
from .peers import PeerGroup, digest, dtype_name
from .rollout import RemoteReceivers
from .workloads import Workload

TIMEOUT = 600.0
RECEIVERS = 2  # per path; python -m benchmarks --receivers sets it
DAEMON_KW: dict[str, Any] = {"peer_timeout": 300.0}  # the harness blocks the loop while it measures peers


EMPTY_SYNCS = 3  # per workload, after the measured steps: the state synced again unchanged
PATCH_OPTIONS: dict[str, Any] = {}  # python -m benchmarks --dense-above sets one
# python -m benchmarks --metrics: each Sender serves its metrics and a scraper reads them every
# SCRAPE_EVERY seconds during the run (Prometheus scrapes every 15 s by default: this is harsher)
METRICS = False
SCRAPE_EVERY = 1.0


def patch_config(workload: Workload | None = None) -> dict[str, Any]:
    """The run's patch options (``PATCH_OPTIONS``) and the workload's over them (its ``patch``:
    the quick suite's device-codec row); every other option at the library's default."""
    return {"type": "patch", "patch": {**PATCH_OPTIONS, **(workload.patch if workload is not None else {})}}


def bucket_config(dtype: torch.dtype) -> dict[str, Any]:
    return {"type": "bucket", "bucket": {"bucket_dtype": dtype_name(dtype)}}


class Loopback:
    """Where the rigs' receivers run and how they reach their sender: here, tcp loopback.
    ``benchmarks.lowbw`` puts a shaped, delayed link in between instead."""

    bind = "127.0.0.1"  # the Sender's bind address
    insecure_plaintext = False
    prefix: tuple[str, ...] = ()  # prepended to each receiver process's command (``ip netns exec NS``)

    async def route(self, sender_endpoint: str) -> tuple[str, Any]:
        """The endpoint receivers connect to, and a handle ``unroute`` takes back."""
        return sender_endpoint, None

    async def unroute(self, handle: Any) -> None:
        pass

    def link_bytes(self) -> int | None:
        """Bytes sent over the link so far (None: not counted)."""
        return None


NETWORK: Loopback = Loopback()  # benchmarks.lowbw sets another


class Rig:
    """One Sender in this process (beside the trainer) and its Receivers, each in its own
    process (as rollouts run), on tcp loopback (or ``NETWORK``'s link)."""

    def __init__(self, sender: Sender, receivers: RemoteReceivers, route: Any = None) -> None:
        self.sender, self.receivers, self.route = sender, receivers, route
        self.closed = False
        self.scrapes = 0
        self._scraper = asyncio.ensure_future(self._scrape()) if sender.metrics_url is not None else None

    async def _scrape(self) -> None:
        """Read the sender's /metrics over HTTP every ``SCRAPE_EVERY`` seconds (``METRICS``)."""
        import aiohttp

        async with aiohttp.ClientSession() as http:
            while True:
                async with http.get(f"{self.sender.metrics_url}/metrics") as r:
                    await r.read()
                self.scrapes += 1
                await asyncio.sleep(SCRAPE_EVERY)

    @classmethod
    async def open(cls, workload: Workload, config: dict[str, Any], name: str, count: int | None = None) -> Rig:
        count = RECEIVERS if count is None else count
        net = NETWORK
        sender = Sender(f"tcp://{net.bind}:0", config, insecure_plaintext=net.insecure_plaintext,
                        metrics_address="127.0.0.1:0" if METRICS else None, **DAEMON_KW)
        route: Any = None
        receivers: RemoteReceivers | None = None
        try:
            await sender.start(workload.trainer_state(), version=0)
            endpoint, route = await net.route(sender.endpoint)
            receivers = await RemoteReceivers.start(workload.receiver_spec(), endpoint, config, name, count, prefix=net.prefix)
            await sender.wait_for_receivers(count, timeout=TIMEOUT)
            await sender.wait_acked(0, timeout=TIMEOUT)
        except BaseException:  # nothing of a rig that never opened outlives it
            try:
                if receivers is not None:
                    await receivers.kill()
            finally:
                await sender.close()
                await net.unroute(route)
            raise
        return cls(sender, receivers, route)

    def incidents(self) -> int:
        """Resyncs the sender counted plus reconnects of the receivers, so far."""
        return sum(int(p["resyncs"]) for p in self.sender.receivers.values()) + sum(self.receivers.reconnects)  # type: ignore[call-overload]

    async def sync(self, state: StateLike, version: int) -> dict[str, Any]:
        before = self.incidents()
        phases.RECORDER.take()  # what happened between syncs is not this version's
        started_ns = time.monotonic_ns()
        started = time.perf_counter()
        stats = await self.sender.sync(state, version)
        built = time.perf_counter()
        await self.sender.wait_acked(version, timeout=TIMEOUT)
        ended = time.perf_counter()
        ended_ns = time.monotonic_ns()
        sender_phases = phases.RECORDER.take()
        applied = await self.receivers.reports(version)  # they trail the acknowledgements (untimed)
        return {
            "stats": stats, "build_s": built - started, "e2e_s": ended - started,
            "phases_ms": phases.breakdown(sender_phases, applied, built - started, stats.encode_seconds, ended - started, started_ns, ended_ns),
            "decode_s": max((a["decode_s"] for a in applied if a and a["decode_s"] is not None), default=None),
            "apply_s": max((a["apply_s"] for a in applied if a and a["apply_s"] is not None), default=None),
            # anything but one clean patch/bucket per receiver means the time includes a recovery
            "applied_as": sorted({(a["kind"] or "missing") if a else "missing" for a in applied}),
            "incidents": self.incidents() - before,
        }

    async def verify(self, expected: dict[str, torch.Tensor]) -> bool:
        """Every receiver holds ``expected`` bit for bit."""
        return set(await self.receivers.digests()) == {digest(expected)}

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        failed: BaseException | None = None
        if self._scraper is not None:
            self._scraper.cancel()
            (outcome,) = await asyncio.gather(self._scraper, return_exceptions=True)
            failed = None if isinstance(outcome, asyncio.CancelledError) else outcome
        try:
            await self.receivers.stop()
        finally:
            await self.sender.close()
            await NETWORK.unroute(self.route)
        if failed is not None:  # the run's "metrics on" figures would not be what they say
            raise RuntimeError(f"the metrics scraper failed after {self.scrapes} scrapes") from failed


def link_deltas(marks: dict[str, int | None]) -> dict[str, int] | None:
    """Bytes each path put on the link, from the counter read before and after it (the
    digest checks between them are left out); None where the link is not counted."""
    if marks["start"] is None:
        return None
    m = {k: int(v or 0) for k, v in marks.items()}
    return {"patch": m["patch"] - m["start"], "bucket": m["bucket"] - m["verify"],
            "safetensors": m["safetensors"] - m["verify2"], "gloo": m["gloo"] - m["safetensors"]}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _mean(xs: list[float]) -> float:
    return float(statistics.fmean(xs))


async def run_workload(workload: Workload, peers: PeerGroup, memory_pass: bool) -> dict[str, Any]:
    """Every measured step of ``workload``; ``finish`` turns it into a result object."""
    with phases.sender_timers():  # the receivers install theirs (benchmarks.rollout)
        return await _measure(workload, peers, memory_pass)


async def _measure(workload: Workload, peers: PeerGroup, memory_pass: bool) -> dict[str, Any]:
    workload.setup()
    described = workload.describe()
    rdtype = workload.receiver_dtype
    prev = workload.receiver_view()
    patch = await Rig.open(workload, patch_config(workload), f"{workload.name}-patch")
    bucket = await Rig.open(workload, bucket_config(rdtype), f"{workload.name}-bucket")
    peers.setup(prev)
    tracked = workload.tracked()
    read_bytes = sum(t.numel() * (t.element_size() + rdtype.itemsize if t.is_floating_point() else 2 * t.element_size()) for t in tracked.values())
    steps: list[dict[str, Any]] = []
    warmup: list[dict[str, Any]] = []
    verified = True
    scratch = Path(tempfile.mkdtemp(prefix="weightsync-bench-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    pre_path, post_path = scratch / "pre", scratch / "post"
    total = workload.warmup_steps + workload.measured_steps
    try:
        for version in range(1, total + 1):
            last = version == total
            if last and memory_pass:
                memory.dump_state(workload.tracked(), pre_path)
            workload.step()
            link = {"start": NETWORK.link_bytes()}
            p = await patch.sync(workload.trainer_state(), version)
            link["patch"] = NETWORK.link_bytes()
            cast_started = time.perf_counter()
            new = workload.receiver_view()  # the peers' input: the state dict at the receivers' dtype
            cast_s = time.perf_counter() - cast_started
            if version <= workload.warmup_steps:
                warmup.append({"version": version, "build_s": p["build_s"], "e2e_patch_s": p["e2e_s"], "wire_bytes": p["stats"].wire_bytes})
                prev = new
                continue
            verified &= await patch.verify(new)
            link["verify"] = NETWORK.link_bytes()
            b = await bucket.sync(workload.trainer_state(), version)
            link["bucket"] = NETWORK.link_bytes()
            verified &= await bucket.verify(new)
            link["verify2"] = NETWORK.link_bytes()
            st = peers.safetensors(new)
            link["safetensors"] = NETWORK.link_bytes()
            gl = peers.gloo(new)
            link["gloo"] = NETWORK.link_bytes()
            sizes = update_sizes(prev, new)
            if last:
                verified &= set(peers.digests()) == {digest(new)}
            prev = new
            ps, bs = p["stats"], b["stats"]
            steps.append({
                "version": version,
                "density": sizes.density,
                "changed_elements": sizes.changed,
                "library_changed_elements": ps.changed_elements,
                "tensors_dense": ps.tensors_dense,
                "dense_bytes": ps.dense_bytes,
                "dense_elements": ps.total_elements,
                "wire_bytes": ps.wire_bytes,
                "entropy_floor_bytes": sizes.entropy_floor_bytes,
                "seed_format_bytes": sizes.seed_format_bytes,
                "ulp_histogram": {("gt3" if k < 0 else str(k)): v for k, v in sorted((sizes.ulp_histogram or {}).items())},
                "build_s": p["build_s"],
                "e2e_patch_s": p["e2e_s"],
                "patch_receiver_decode_s": p["decode_s"],
                "patch_receiver_apply_s": p["apply_s"],
                "patch_phases_ms": p["phases_ms"],
                "bucket_phases_ms": b["phases_ms"],
                "patch_applied_as": p["applied_as"],
                "patch_incidents": p["incidents"],
                "bucket_applied_as": b["applied_as"],
                "bucket_incidents": b["incidents"],
                "bucket_wire_bytes": bs.wire_bytes,
                "bucket_dense_bytes": bs.dense_bytes,
                "bucket_build_s": b["build_s"],
                "e2e_bucket_s": b["e2e_s"],
                "safetensors_bytes": st["bytes"],
                "e2e_safetensors_s": st["e2e_s"],
                "safetensors_write_s": st["write_s"],
                "safetensors_load_s": st["load_s"],
                "gloo_bytes": gl["bytes"],
                "e2e_gloo_s": gl["e2e_s"],
                "gloo_pack_s": gl["pack_s"],
                "peer_cast_s": cast_s,
                "loss": getattr(workload, "last_loss", None),
                "link_bytes": link_deltas(link),
            })
        # Unchanged state, the whole model: what a version costs when nothing moved (the
        # compare still reads every tracked tensor and its snapshot).
        empty = []
        for version in range(total + 1, total + 1 + EMPTY_SYNCS):
            e = await patch.sync(workload.trainer_state(), version)
            empty.append({"version": version, "e2e_s": e["e2e_s"], "build_s": e["build_s"], "wire_bytes": e["stats"].wire_bytes,
                          "changed_elements": e["stats"].changed_elements, "phases_ms": e["phases_ms"], "applied_as": e["applied_as"]})
        verified &= await patch.verify(workload.receiver_view())
        mem = None
        if memory_pass:
            memory.dump_state(workload.tracked(), post_path)
            await patch.close()
            await bucket.close()
            mem = await asyncio.to_thread(memory.measure, pre_path, post_path, rdtype, patch_config(workload))
    finally:
        await patch.close()
        await bucket.close()
        workload.teardown()
        for f in scratch.iterdir():
            f.unlink()
        scratch.rmdir()
    return {
        "workload": workload.name, "kind": workload.kind, "config": described,
        "steps": steps, "warmup": warmup, "empty": empty, "read_bytes": read_bytes, "memory": mem, "verified": verified,
        "receivers": RECEIVERS, "model_bytes": sum(t.numel() * t.element_size() for t in tracked.values()),
        "patch_options": dict(workload.patch), "targets_counted": workload.counted,
        # --metrics: the scrapes of both Senders' endpoints this workload's run made (None: off)
        "metrics_scrapes": patch.scrapes + bucket.scrapes if METRICS else None,
    }


def memory_excess(mem: dict[str, Any] | None, last: dict[str, Any], model_bytes: int) -> dict[str, float | None]:
    """How far the sync's memory growth exceeds what it must hold, as a share of the total.

    The sender must hold the model and one snapshot at the receivers' dtype; a receiver,
    its model and one update (the message, plus each change staged as an int64 index and
    a value). ``base_rss`` already holds the model, so the growth during the sync
    (``sync_peak_rss - base_rss``) is compared with the snapshot (sender) or the update
    (receiver): excess = (growth - needed) / (model + needed). The ``steady`` figures are
    the same for the pass's second sync (``steady_peak_rss``: the first still in the ring)."""
    out: dict[str, float | None] = {}
    snapshot = last["dense_bytes"]  # every tracked element at the receivers' dtype
    itemsize = snapshot / max(1, last["dense_elements"])
    update = last["wire_bytes"] + last["changed_elements"] * (8 + itemsize)
    for peak, name in (("sync_peak_rss", "memory"), ("steady_peak_rss", "steady_memory")):
        s, rs = (mem["sender"], mem["receivers"]) if mem else ({}, [])
        if s.get(peak) is None or any(r.get(peak) is None for r in rs):
            out[f"sender_{name}_excess"] = out[f"receiver_{name}_excess"] = None
            continue
        out[f"sender_{name}_excess"] = (s[peak] - s["base_rss"] - snapshot) / (model_bytes + snapshot)
        out[f"receiver_{name}_excess"] = max((r[peak] - r["base_rss"] - update) / (snapshot + update) for r in rs)
    return out


def phase_medians(steps: list[dict[str, Any]], key: str) -> dict[str, float | None]:
    """Each phase's median over ``steps`` (None where no step timed it)."""
    out: dict[str, float | None] = {}
    for name in (*phases.PHASES, "e2e", *phases.CPU):
        values = [s[key][name] for s in steps if s.get(key) and s[key].get(name) is not None]
        out[name] = _median(values) if values else None
    return out


def finish(run: dict[str, Any], copy_bps: float, zmq_bps: float) -> dict[str, Any]:
    """The workload's result object: byte figures averaged over the measured steps, times
    their median; ``read_floor_s`` from the run's copy bandwidth."""
    steps, mem = run["steps"], run["memory"]

    def mean(k: str) -> float:
        return _mean([s[k] for s in steps])

    def median(k: str) -> float:
        return _median([s[k] for s in steps])

    e2e_bucket = median("e2e_bucket_s")
    empty = run.get("empty") or []
    out: dict[str, Any] = {
        "workload": run["workload"],
        "kind": run["kind"],
        "density": mean("density"),
        "dense_bytes": int(mean("dense_bytes")),
        "wire_bytes": mean("wire_bytes"),
        "entropy_floor_bytes": mean("entropy_floor_bytes"),
        "seed_format_bytes": mean("seed_format_bytes"),
        "build_s": median("build_s"),
        "read_floor_s": run["read_bytes"] / copy_bps,
        "read_bytes": run["read_bytes"],
        "e2e_patch_s": median("e2e_patch_s"),
        "e2e_bucket_s": e2e_bucket,
        "e2e_safetensors_s": median("e2e_safetensors_s"),
        "e2e_gloo_s": median("e2e_gloo_s"),
        "zmq_raw_Bps": zmq_bps,
        "copy_Bps": copy_bps,
        "bucket_Bps": run["receivers"] * mean("bucket_dense_bytes") / e2e_bucket,
        "bucket_wire_bytes": mean("bucket_wire_bytes"),
        "bucket_build_s": median("bucket_build_s"),
        "safetensors_bytes": mean("safetensors_bytes"),
        "gloo_bytes": mean("gloo_bytes"),
        "patch_phases_ms": phase_medians(steps, "patch_phases_ms"),
        "e2e_empty_patch_s": _median([e["e2e_s"] for e in empty]) if empty else None,
        "build_empty_patch_s": _median([e["build_s"] for e in empty]) if empty else None,
        "empty_patch_phases_ms": phase_medians(empty, "phases_ms") if empty else None,
        "bucket_phases_ms": phase_medians(steps, "bucket_phases_ms"),
        "sender_peak_rss": mem["sender"]["peak_rss"] if mem else None,
        "receiver_peak_rss": max(r["peak_rss"] for r in mem["receivers"]) if mem else None,
        **memory_excess(mem, steps[-1], run["model_bytes"]),
        "memory": mem,
        "verified_bit_exact": run["verified"],
        # resyncs/reconnects during measured syncs (their times then include a recovery)
        "incidents": sum(s["patch_incidents"] + s["bucket_incidents"] for s in steps),
        "measured_steps": len(steps),
        "wall_s": run.get("wall_s"),
        "patch_options": run.get("patch_options", {}),  # the workload's own, over the run's (library_info: patch_options)
        "targets_counted": run.get("targets_counted", True),
        "metrics_scrapes": run.get("metrics_scrapes"),  # --metrics: both Senders' endpoints scraped this often (None: off)
        "config": run["config"],
        "steps": steps,
        "warmup": run.get("warmup", []),
        "empty": empty,
        "notes": [
            "e2e_empty_patch_s / build_empty_patch_s: median of the state synced again unchanged (EMPTY_SYNCS times, after "
            "the measured steps): the whole model is still compared, nothing is sent but the (empty) PATCH",
            "bytes: mean over the measured steps; times: median over them",
            "patch_options: this workload's patch options over the run's (real-bf16-lr1e-6-device: patch.codec device, the "
            "device compare and codec on CPU tensors); targets_counted false: its targets are reported apart, not counted",
            "e2e_patch_s / e2e_bucket_s: the Sender in the trainer's process, 2 Receivers in 2 processes, tcp loopback; "
            "from sync() until both acknowledged the version",
            "e2e_safetensors_s: write to tmpfs (/dev/shm where present) then 2 worker processes load_file + load_state_dict in parallel",
            "e2e_gloo_s: dist.broadcast of one packed buffer from rank 0 (this process) to 2 worker processes, "
            "each copying it into its module, until a barrier",
            "safetensors and gloo start from the state dict already at the receivers' dtype: the cast "
            "(peer_cast_s in steps) is not in their times",
            "sender_peak_rss / receiver_peak_rss: peak RSS (VmHWM) of separate processes replaying the last measured "
            "step (1 sender process, 2 receiver processes, patch config); base_rss is before the daemon was created; "
            "sync_peak_rss is the peak of the sync alone (VmHWM restarted after the bootstrap); steady_peak_rss the peak "
            "of the next sync (the step undone, synced while the ring still holds the first)",
            "sender_memory_excess / receiver_memory_excess: (sync growth - what must be held) / (model + what must be held); "
            "the sender must hold one snapshot at the receivers' dtype, a receiver one update; "
            "sender_steady_memory_excess / receiver_steady_memory_excess: the same for the next sync",
            "patch_phases_ms / bucket_phases_ms: each phase's median over the measured steps, in ms (so they need not add up "
            "to the median e2e); the phases and how each is timed: benchmarks/phases.py; per step under steps",
            "bucket_Bps: bytes delivered (2 receivers x the dense bytes at the receivers' dtype) / e2e_bucket_s, "
            "as zmq_raw_Bps counts one ROUTER's fan-out to 2 DEALERs",
        ],
    }
    return out


async def fixed_cost(syncs: int = 10) -> dict[str, Any]:
    """What a version costs when the model is trivial and nothing changed: one 16-element
    bf16 tensor, synced unchanged ``syncs`` times to 2 receivers (their own processes) over
    tcp loopback; e2e from ``sync()`` until both acknowledged. Issue 14's fixed cost."""
    from .workloads import SyntheticWorkload

    w = SyntheticWorkload("fixed-cost", 0.0, [(16,)], measured_steps=0)
    w.setup()
    rig = await Rig.open(w, patch_config(), "fixed-cost")
    samples = []
    try:
        with phases.sender_timers():
            for version in range(1, syncs + 2):
                r = await rig.sync(w.trainer_state(), version)
                if version > 1:  # the first pays one-time costs
                    samples.append(r)
        verified = await rig.verify(w.receiver_view())
    finally:
        await rig.close()
        w.teardown()
    return {
        "state": "1 bf16 tensor of 16 elements, unchanged", "receivers": RECEIVERS, "transport": "tcp loopback",
        "e2e_s": _median([s["e2e_s"] for s in samples]), "build_s": _median([s["build_s"] for s in samples]),
        "e2e_s_samples": [s["e2e_s"] for s in samples], "wire_bytes": samples[-1]["stats"].wire_bytes,
        "phases_ms": phase_medians([{"p": s["phases_ms"]} for s in samples], "p"), "verified_bit_exact": verified,
        "applied_as": sorted({k for s in samples for k in s["applied_as"]}),
    }
