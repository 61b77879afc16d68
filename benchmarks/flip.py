"""One flip for the fleet: the spread of a version's commits across receivers, together vs not.

    python -m benchmarks.flip --json OUT.json [--receivers 4] [--steps 8]

One trainer (real AdamW steps on the 4.2M-parameter MLP of ``benchmarks/fanout.py``, fp32,
patch mode) and N receiver daemons (``python -m receiver``, bf16, a process each), twice: with
``Sender(commit="independent")`` (each receiver commits a version as soon as it has it) and
``commit="together"`` (each stages it, and all commit when the sender flips it). Per version
it reports the spread between the first and the last receiver's commit (each receiver's
wall clock right after its commit, the ``at`` of its ``applied`` line: one machine, one
clock), the time from ``sync()`` until the last commit, and each commit's own length (the
engine-hold window, ``apply_seconds``). Medians over ``--steps`` versions; the two modes run
one after the other in one run, so compare them, not runs of different machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import report
from benchmarks.fanout import Rollout, bf16_digest, wait_applied
from sender import Sender

TIMEOUT = 300.0
CONFIG = {"type": "patch"}


async def run_mode(commit: str, n: int, steps: int, lr: float) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rollouts: list[Rollout] = []
    async with Sender("tcp://127.0.0.1:0", CONFIG, peer_timeout=60.0, commit=commit) as sender:
        await sender.start(model, version=0)
        try:
            for i in range(n):
                rollouts.append(await Rollout.start(f"r{i}", sender.endpoint, relay=False))
            await asyncio.wait_for(wait_applied(rollouts, 0), TIMEOUT)
            x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2))
            spreads, lasts, holds, flips = [], [], [], []
            for version in range(1, steps + 1):
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                expected = bf16_digest(model)
                started = time.time()
                await sender.sync(model, version)
                await asyncio.wait_for(wait_applied(rollouts, version), TIMEOUT)
                events = [r.events[version] for r in rollouts]
                if any(e["digest"] != expected for e in events):
                    raise RuntimeError(f"v{version}: a receiver's digest differs from the trainer's")
                at = [e["at"] for e in events]
                spreads.append(max(at) - min(at))
                lasts.append(max(at) - started)
                holds += [e["apply_seconds"] for e in events]
                if commit == "together":
                    flips.append((await sender.wait_flipped(version, timeout=TIMEOUT)).seconds)
                await sender.wait_acked(version, timeout=TIMEOUT)
        finally:
            await asyncio.gather(*(r.stop() for r in reversed(rollouts)))
    return {
        "commit": commit,
        "receivers": n,
        "spread_s": statistics.median(spreads),
        "spread_s_samples": spreads,
        "sync_to_last_commit_s": statistics.median(lasts),
        "hold_s": statistics.median(holds),
        "flip_s": statistics.median(flips) if flips else None,
        "digests_equal": True,
    }


async def run(n: int, steps: int, lr: float) -> dict[str, Any]:
    load = os.getloadavg()[0]
    results = [await run_mode(commit, n, steps, lr) for commit in ("independent", "together")]
    return {"benchmark": "weightsync-flip", "command": report.command("-m benchmarks.flip"), "machine": report.machine(load),
            "model": "4 x Linear(1024, 1024): 4.2M parameters, fp32 trainer, bf16 receivers", "lr": lr, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write the result document here")
    p.add_argument("--receivers", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    args = p.parse_args(argv)
    doc = asyncio.run(run(args.receivers, args.steps, args.lr))
    print("| commit | receivers | spread (median) | sync to last commit | commit (hold) | publication to flip |", file=sys.stderr)
    print("| --- | --- | --- | --- | --- | --- |", file=sys.stderr)
    for r in doc["results"]:
        flip = "-" if r["flip_s"] is None else f"{r['flip_s'] * 1e3:.1f} ms"
        print(f"| {r['commit']} | {r['receivers']} | {r['spread_s'] * 1e3:.1f} ms | {r['sync_to_last_commit_s'] * 1e3:.1f} ms | "
              f"{r['hold_s'] * 1e3:.1f} ms | {flip} |", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
