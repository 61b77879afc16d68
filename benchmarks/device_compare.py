"""The compare on this machine's CPU: the host compare (numba, tensor by tensor) against the
device compare (runs of batched torch ops, issue 35), and the read floor.

    python -m benchmarks.device_compare [--numel 100000000] [--tensors 200] [--share 0.01] [--repeat 3] [--json OUT]

A bf16 model of ``--numel`` elements in ``--tensors`` tensors (bf16 receivers): each version
moves ``--share`` of its elements by one ulp, and the time of one compare (``collect``: the
changes collected and the snapshot moved) is the best of ``--repeat`` versions after one
warm-up version. The read floor is the model and the snapshot read once (2 bytes an element
each) at the bandwidth a torch copy of the model reaches here (its bytes read and written).
On CPU the device compare need not win: it is written for a GPU, where its syncs and launches
are what matter (``tests/test_compare.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from sender.diff.changes import plan_groups
from sender.diff.compare import make_compare
from sender.diff.snapshot import Snapshot
from sender.plan import SyncPlan
from sender.stats import SyncStats


def model(numel: int, tensors: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    each = numel // tensors
    return {f"w{i}": torch.randn(each, generator=gen).to(torch.bfloat16) for i in range(tensors)}


def step(state: dict[str, torch.Tensor], share: float, gen: torch.Generator) -> None:
    """``share`` of each tensor's elements moved by one ulp."""
    for t in state.values():
        at = torch.randint(0, t.numel(), (max(1, int(share * t.numel())),), generator=gen)
        t.view(torch.int16)[at] += 1


def copy_seconds(state: dict[str, torch.Tensor], repeat: int) -> float:
    """The best time of a torch copy of every tensor (into buffers touched before)."""
    out = {k: torch.empty_like(t) for k, t in state.items()}
    best = float("inf")
    for _ in range(repeat + 1):
        started = time.perf_counter()
        for k, t in state.items():
            out[k].copy_(t)
        best = min(best, time.perf_counter() - started)
    return best


def time_compare(kind: str, state: dict[str, torch.Tensor], share: float, repeat: int) -> dict[str, Any]:
    config = load_config({"type": "patch", "patch": {"group_numel": 0}})
    plan = SyncPlan(resolve_state(state), ModelMetadata.of(state), config.init_sync)
    compare = make_compare(kind, plan, config.patch.options(), Snapshot("cpu"), plan_groups(plan, 0), stage=True)
    compare.capture(state)
    gen = torch.Generator().manual_seed(1)
    best, changed = float("inf"), 0
    for _ in range(repeat + 1):  # the first version warms up (one pass needs a count, pages fault in)
        step(state, share, gen)
        stats = SyncStats(0, "patch")
        started = time.perf_counter()
        compare.collect(state, stats, lambda c: c)
        best = min(best, time.perf_counter() - started)
        changed = stats.changed_elements
    return {"seconds": best, "changed": changed}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=100_000_000)
    p.add_argument("--tensors", type=int, default=200)
    p.add_argument("--share", type=float, default=0.01)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    state = model(args.numel, args.tensors)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    copy = copy_seconds(state, args.repeat)
    bandwidth = 2 * nbytes / copy  # bytes read and written a second
    floor = 2 * nbytes / bandwidth  # the model and the snapshot, each read once
    result: dict[str, Any] = {
        "machine": platform.node(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "tensors_on": "cpu",
        "numel": sum(t.numel() for t in state.values()), "tensors": args.tensors, "share": args.share,
        "copy_gbps": bandwidth / 1e9, "read_floor_seconds": floor,
    }
    for kind in ("host", "device"):
        timed = time_compare(kind, state, args.share, args.repeat)
        result[kind] = {**timed, "over_floor": timed["seconds"] / floor}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
