"""Peak memory of the sender and of a receiver, each in its own process.

The e2e timings run the Sender and both Receivers in one process, where their memory
cannot be told apart; so for each workload the last measured step is replayed here:
``python -m benchmarks.memory sender`` loads the trainer's state before that step,
serves it as version 0 (bootstrap), reads the state after the step into the same
tensors in place and syncs it as version 1 until every receiver acknowledged it, then
the state before the step again as version 2 (the same changes undone: a version synced
while the ring still holds the one before, as every version after the first is);
``python -m benchmarks.memory receiver`` (two of them) starts from zeros at the
receivers' dtype. Each reports its RSS before the daemon was created, with the runtime
every daemon loads already in (compiled kernels, threads: ``base``), its
lifetime peak (VmHWM, i.e. ``ru_maxrss`` of this process alone), the peak of the first
sync alone (``sync_peak``: VmHWM restarted once the bootstrap is applied) and of the
second (``steady_peak``: restarted once the first is applied), and its RSS where each
restarted (``sync_start``, ``steady_start``), in bytes. States travel as raw files (read with
``readinto`` straight into the tensors, so loading adds no second copy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .peers import DTYPES, ROOT, dtype_name, maxrss_bytes, reset_peak_rss


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dump_state(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``path``.json (keys, shapes, dtypes) and ``path``.bin (the raw bytes, in order)."""
    manifest = [(k, list(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()]
    path.with_suffix(".json").write_text(json.dumps(manifest))
    with open(path.with_suffix(".bin"), "wb") as f:
        for t in tensors.values():
            f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))


def manifest(path: Path) -> list[tuple[str, list[int], str]]:
    return [tuple(e) for e in json.loads(path.with_suffix(".json").read_text())]  # type: ignore[misc]


def read_into(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    with open(path.with_suffix(".bin"), "rb") as f:
        for t in tensors.values():
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            if f.readinto(view) != len(view):
                raise EOFError(f"{path}: short read")


def empty_state(path: Path, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Zeros of the manifest's shapes; floating tensors at ``dtype`` when given."""
    out = {}
    for key, shape, name in manifest(path):
        d = DTYPES[name]
        out[key] = torch.zeros(shape, dtype=dtype if dtype is not None and d.is_floating_point else d)
    return out


def rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


SETTLE = 1.0  # seconds between the bootstrap and the measured sync


def release_freed() -> None:
    """Return freed heap to the OS (glibc ``malloc_trim``) after a collection, so the
    peak restarted next starts from what is live, not from the bootstrap's leftovers."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the peak then includes what the allocator kept


def warm_runtime() -> None:
    """Load what every daemon loads whatever the model's size (compiled kernels, the codec
    threads, ZeroMQ's I/O threads), so ``base`` holds the runtime and growth is the model's."""
    import receiver.apply.warmup
    import sender.diff.warmup
    from protocol.codec.parallel import map_ordered
    from protocol.net.context import shared_context

    sender.diff.warmup.compile_kernels()
    receiver.apply.warmup.compile_kernels()
    map_ordered(abs, [1, 2, 3, 4])
    shared_context()


async def run_sender(args: argparse.Namespace) -> dict[str, Any]:
    from sender import Sender

    pre = Path(args.pre)
    state = empty_state(pre)
    read_into(pre, state)
    warm_runtime()
    base = rss()
    sender = Sender(f"tcp://127.0.0.1:{args.port}", json.loads(args.config), peer_timeout=300.0)
    try:
        await sender.start(state, version=0)
        await sender.wait_for_receivers(args.receivers, timeout=300)
        await sender.wait_acked(0, timeout=300)
        boot_peak = maxrss_bytes()
        await asyncio.sleep(SETTLE)  # every side lets go of the bootstrap (receivers restart their peaks)
        release_freed()
        reset = reset_peak_rss()  # from here: one sync
        sync_start = rss()
        read_into(Path(args.post), state)
        started = time.perf_counter()
        stats = await sender.sync(state, 1)
        await sender.wait_acked(1, timeout=300)
        e2e = time.perf_counter() - started
        sync_peak = maxrss_bytes() if reset else None
        await asyncio.sleep(SETTLE)  # the receivers restart their peaks
        release_freed()
        reset = reset_peak_rss()  # from here: the next sync, version 1 still in the ring
        steady_start = rss()
        read_into(Path(args.pre), state)
        await sender.sync(state, 2)
        await sender.wait_acked(2, timeout=300)
        steady_peak = maxrss_bytes() if reset else None
        resyncs = sum(int(p["resyncs"]) for p in sender.receivers.values())  # type: ignore[call-overload]
    finally:
        await sender.close()
    return {"base_rss": base, "peak_rss": max(boot_peak, sync_peak or 0, maxrss_bytes()), "sync_peak_rss": sync_peak,
            "steady_peak_rss": steady_peak, "sync_start_rss": sync_start, "steady_start_rss": steady_start,
            "wire_bytes": stats.wire_bytes, "e2e_s": e2e, "resyncs": resyncs}


async def run_receiver(args: argparse.Namespace) -> dict[str, Any]:
    from receiver import Receiver

    state = empty_state(Path(args.pre), DTYPES[args.dtype])
    warm_runtime()
    base = rss()
    receiver = Receiver(state, f"tcp://127.0.0.1:{args.port}", json.loads(args.config), identity=args.identity, peer_timeout=300.0)
    marks: dict[str, Any] = {}
    try:
        await receiver.start(timeout=300)  # bootstrapped; the sender settles before it syncs v1
        marks["boot_peak"] = maxrss_bytes()
        release_freed()
        marks["reset"] = reset_peak_rss()
        marks["sync_start"] = rss()
        await receiver.wait_for_version(1, timeout=300)
        marks["sync_peak"] = maxrss_bytes() if marks["reset"] else None
        marks["peak"] = max(marks["boot_peak"], maxrss_bytes())
        await asyncio.sleep(SETTLE / 2)  # what it lets go of after publishing (the sender waits SETTLE)
        release_freed()
        marks["steady_reset"] = reset_peak_rss()
        marks["steady_start"] = rss()
        await receiver.wait_for_version(2, timeout=300)
        applied = receiver.stats.get(1)
    finally:
        await receiver.close()
    peak = maxrss_bytes()
    return {"base_rss": base, "peak_rss": max(peak, marks.get("peak", 0)), "sync_peak_rss": marks.get("sync_peak"),
            "steady_peak_rss": peak if marks.get("steady_reset") else None,
            "sync_start_rss": marks.get("sync_start"), "steady_start_rss": marks.get("steady_start"),
            "reconnects": receiver.reconnects, "applied_as": applied.kind if applied else None, "version": receiver.version}


def measure(pre: Path, post: Path, receiver_dtype: torch.dtype, config: dict[str, Any], receivers: int = 2, timeout: float = 600) -> dict[str, Any]:
    """Run the sender and ``receivers`` receiver processes; their reports."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    common = ["--pre", str(pre), "--post", str(post), "--port", str(port), "--config", json.dumps(config)]
    argv = [[sys.executable, "-m", "benchmarks.memory", "sender", *common, "--receivers", str(receivers)]]
    argv += [
        [sys.executable, "-m", "benchmarks.memory", "receiver", *common, "--dtype", dtype_name(receiver_dtype), "--identity", f"mem-{i}"]
        for i in range(receivers)
    ]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env) for a in argv]
    reports = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"memory process {p.args[3]} failed with {p.returncode}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return {"sender": reports[0], "receivers": reports[1:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["sender", "receiver"])
    p.add_argument("--pre", required=True)
    p.add_argument("--post", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--config", required=True, help="the sync config as JSON")
    p.add_argument("--receivers", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--identity", default="mem-0")
    args = p.parse_args()
    report = asyncio.run(run_sender(args) if args.role == "sender" else run_receiver(args))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
