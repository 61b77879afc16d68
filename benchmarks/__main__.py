"""python -m benchmarks --suite quick|full|lowbw --json OUT.json [--plot OUT.png] [--part-bytes N]

lowbw: the receivers behind a shaped link in a network namespace (--mbit, --rtt-ms; root,
iproute2), see benchmarks/lowbw.py; skipped with the reason where that cannot run."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from . import device_ops, e2e, report
from .bandwidth import copy_bandwidth, zmq_raw_throughput
from .e2e import finish, fixed_cost, run_workload
from .memory import free_port
from .peers import CPUS_ENV, PeerGroup, maxrss_bytes
from .report import evaluate_targets, missing_keys, plot, table
from .workloads import SUITES, workloads


def split_cores() -> None:
    """``--split-cores``: this process (trainer, sender) keeps the first half of the cores;
    the workers it starts get the rest (``peers.CPUS_ENV``)."""
    from protocol.codec import parallel

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--split-cores needs at least 2 cores")
    own, theirs = cpus[: len(cpus) // 2], cpus[len(cpus) // 2 :]
    os.sched_setaffinity(0, own)
    parallel.WORKERS = len(own)
    os.environ[CPUS_ENV] = ",".join(map(str, theirs))
    os.environ[parallel.ENV] = str(len(theirs))
    print(f"split cores: trainer and sender on {own}, receivers and peers on {theirs}", file=sys.stderr)


async def run_suite(name: str, only: list[str] | None = None, memory_pass: bool | None = None) -> dict[str, Any]:
    suite = SUITES[name]
    started = time.perf_counter()
    load_before = os.getloadavg()
    peers = PeerGroup(free_port(), workers=e2e.RECEIVERS)
    try:
        chosen = [w for w in workloads(suite) if not only or w.name in only]
        if only and len(chosen) != len(only):
            raise SystemExit(f"unknown workload in {only}; known: {[w.name for w in workloads(suite)]}")
        # The ceilings are sampled at the start, before each workload and at the end; the
        # best sample is used everywhere (the strictest floor, the highest raw throughput).
        copy_samples = [copy_bandwidth(suite.copy_bytes)]
        zmq_samples = [zmq_raw_throughput(suite.zmq_bytes, suite.zmq_frame)]
        pending = []
        for w in chosen:
            copy_samples.append(copy_bandwidth(suite.copy_bytes, repeat=3))
            t0 = time.perf_counter()
            pending.append(await run_workload(w, peers, suite.memory_pass if memory_pass is None else memory_pass))
            pending[-1]["wall_s"] = time.perf_counter() - t0
            print(f"  {w.name}: {pending[-1]['wall_s']:.1f}s", file=sys.stderr, flush=True)
            del w
        fixed = await fixed_cost() if not only else None
        # ops a version costs each side of the device path (a GPU launches each): counted, not timed
        ops = None
        if suite.device_codec_row and not only:
            ops = [await device_ops.measure(layout, versions=2) for layout in device_ops.LAYOUTS]
        copy_samples.append(copy_bandwidth(suite.copy_bytes))
        zmq_samples.append(zmq_raw_throughput(suite.zmq_bytes, suite.zmq_frame))
        copy_bps, zmq_bps = max(copy_samples), max(zmq_samples)
        results = [finish(r, copy_bps, zmq_bps) for r in pending]
        peer_rss = peers.close()
    except BaseException:
        peers.close()
        raise
    doc: dict[str, Any] = {
        "benchmark": "weightsync",
        "suite": name,
        "command": report.command("-m benchmarks"),
        "machine": report.machine(
            load_before[0],
            sender_cpus=sorted(os.sched_getaffinity(0)),  # --split-cores: the receivers' are receiver_cpus
            receiver_cpus=os.environ.get(CPUS_ENV) or "all",
            receivers=e2e.RECEIVERS,
        ),
        "library": library_info(),
        "copy_Bps": copy_bps,
        "zmq_raw_Bps": zmq_bps,
        "copy_Bps_samples": copy_samples,
        "zmq_raw_Bps_samples": zmq_samples,
        "zmq_raw_method": f"ROUTER->2 DEALERs (threads) over tcp loopback, one {suite.zmq_bytes} B multipart message to each in "
                          f"{suite.zmq_frame} B frames, copy=False; bytes delivered per second, best sample of the run",
        "copy_method": f"dst.copy_(src) of {suite.copy_bytes} B fp32 CPU tensors, bytes read per second; best sample of the run",
        "peer_worker_peak_rss": peer_rss,
        "results": results,
        "fixed_cost": fixed,
        "device_ops": ops,
    }
    doc["harness_peak_rss"] = maxrss_bytes()  # this process: trainer, both Senders, 4 Receivers, references
    doc["targets"] = evaluate_targets(results, fixed)
    doc["wall_s"] = time.perf_counter() - started
    return doc


def library_info() -> dict[str, Any]:
    """What was measured: the checkout's commit, uncommitted changes, the default patch config
    and what the run's flags set over it."""
    import dataclasses
    import subprocess

    from protocol.config import load_config

    root = Path(__file__).resolve().parent.parent
    from sender.version.part_encoder import encode_threads

    info: dict[str, Any] = {
        "patch_defaults": dataclasses.asdict(load_config({"type": "patch"}).patch),
        "patch_options": dict(e2e.PATCH_OPTIONS),  # what this run's flags set over the defaults
        "encode_threads": encode_threads(e2e.PATCH_OPTIONS.get("encode_threads")),  # as resolved on this host
        "metrics_scraped": e2e.METRICS,  # --metrics: the Senders' endpoints served and scraped every SCRAPE_EVERY s
    }
    try:
        git = ["git", "-C", str(root)]
        info["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run([*git, "status", "--porcelain", "--", "protocol", "sender", "receiver"], capture_output=True, text=True, check=True)
        info["uncommitted"] = [line[3:] for line in status.stdout.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


BENCH_EXTRA = "pip install -e '.[bench]'"


def missing_packages(memory_pass: bool, plot: bool) -> list[str]:
    """The ``bench`` extra's packages this run needs and cannot import: psutil for the
    memory processes, matplotlib for ``--plot``."""
    import importlib.util

    wanted = (["psutil"] if memory_pass else []) + (["matplotlib"] if plot else [])
    return [name for name in wanted if importlib.util.find_spec(name) is None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--suite", choices=[*sorted(SUITES), "lowbw"], default="quick")
    p.add_argument("--json", type=Path, required=True, help="write the results here")
    p.add_argument("--plot", type=Path, help="also write a PNG: bytes and time per step, per workload")
    p.add_argument("--only", nargs="+", metavar="WORKLOAD", help="run only these workloads (by name)")
    p.add_argument("--no-memory", action="store_true", help="skip the per-workload memory processes")
    p.add_argument("--dense-above", metavar="VALUE", help="patch.dense_above for the patch runs: auto (the default), "
                   "a share in [0, 1], or JSON such as '{\"link_gbps\": 10}'")
    p.add_argument("--receivers", type=int, metavar="N", help="receivers (and peer workers) per path (default 2)")
    p.add_argument("--split-cores", action="store_true", help="the trainer and sender on the first half of this "
                   "machine's cores, the receivers and peer workers on the other half, each side's codec threads one per "
                   "core it has: as if they ran on separate hosts, so their stages can overlap")
    p.add_argument("--part-bytes", type=int, metavar="N", help="patch.part_bytes for the patch runs (0: one message a "
                   "version; default: the library's)")
    p.add_argument("--encode-backlog", type=int, metavar="N", help="patch.encode_backlog_bytes for the patch runs (0: "
                   "unbounded; default: the library's)")
    p.add_argument("--encode-threads", type=int, metavar="N", help="patch.encode_threads for the patch runs (default: "
                   "the library's, half the cores up to 4)")
    p.add_argument("--mbit", type=float, help="lowbw: the link's rate towards the receivers, Mbit/s (default 100)")
    p.add_argument("--rtt-ms", type=float, help="lowbw: the round trip the proxy adds, ms (default 40)")
    p.add_argument("--tiny", action="store_true", help="lowbw: one small synthetic workload (the smoke test)")
    p.add_argument("--metrics", action="store_true", help="each Sender serves its metrics endpoint, scraped every second during the run")
    args = p.parse_args(argv)
    e2e.METRICS = args.metrics
    if args.dense_above is not None:
        from protocol.config import dense_rule

        value = args.dense_above if args.dense_above == "auto" else json.loads(args.dense_above)
        dense_rule(value)  # a ConfigError now, not from a worker process
        e2e.PATCH_OPTIONS["dense_above"] = value
    if args.part_bytes is not None:
        e2e.PATCH_OPTIONS["part_bytes"] = args.part_bytes
    if args.encode_backlog is not None:
        e2e.PATCH_OPTIONS["encode_backlog_bytes"] = args.encode_backlog
    if args.encode_threads is not None:
        e2e.PATCH_OPTIONS["encode_threads"] = args.encode_threads
    if args.receivers is not None:
        e2e.RECEIVERS = args.receivers
    if args.split_cores:
        split_cores()
    if args.suite == "lowbw":
        return lowbw_main(args)
    memory_pass = False if args.no_memory else SUITES[args.suite].memory_pass
    missing = missing_packages(memory_pass, args.plot is not None)
    if missing:  # say so now, not minutes later from a worker process
        uses = {"psutil": "the memory pass (or pass --no-memory)", "matplotlib": "--plot"}
        raise SystemExit(f"python -m benchmarks: {', '.join(missing)} not installed (needed for "
                         f"{'; '.join(uses[m] for m in missing)}); install the bench extra: {BENCH_EXTRA}")
    logging.basicConfig(level=logging.WARNING)
    doc = asyncio.run(run_suite(args.suite, args.only, memory_pass))
    missing = missing_keys(doc)
    if missing:
        raise SystemExit(f"result is missing keys: {missing}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2, default=str))
    print(table(doc))
    if doc.get("device_ops"):
        print("\nops a version on the device path (python -m benchmarks.device_ops)\n" + device_ops.report(doc["device_ops"]))
    print(f"\nwall time {doc['wall_s']:.1f}s; JSON: {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"plot: {args.plot}")
    return 0


def lowbw_main(args: argparse.Namespace) -> int:
    from . import lowbw

    reason = lowbw.why_not()
    if reason:
        print(f"python -m benchmarks --suite lowbw: skipped: {reason}")
        return 0
    if args.plot:
        raise SystemExit("--plot: not for the lowbw suite (its table is the result)")
    chosen = [w for w in lowbw.workloads(args.tiny) if not args.only or w.name in args.only]
    logging.basicConfig(level=logging.WARNING)
    doc = asyncio.run(lowbw.run(chosen, args.mbit or lowbw.DEFAULT_MBIT, lowbw.DEFAULT_RTT_MS if args.rtt_ms is None else args.rtt_ms))
    missing = missing_keys(doc)
    if missing:
        raise SystemExit(f"result is missing keys: {missing}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2, default=str))
    print(lowbw.table(doc))
    print(f"\nwall time {doc['wall_s']:.1f}s; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
