"""Fan-out: the trainer's egress and time-to-all-applied, direct vs a relay tree.

    python -m benchmarks.fanout --json benchmarks/results/fanout.json [--receivers 1 4 8] [--steps 5]

For each fleet size N, the same trainer (real AdamW steps on an MLP, fp32, synced to
bf16 rollouts in patch mode) feeds N receiver daemons (``python -m receiver``, one
process each) two ways:

* direct: all N follow the trainer;
* tree: ``min(N, fanout)`` of them relay (``--relay-bind``), and the rest follow the
  relays, spread evenly; every one of the N is a rollout holding the model.

Per layout it reports the trainer's egress (bytes its ``Sender`` queued, bootstrap and
per version), each relay's egress, and per version the time from ``sync()`` to the
moment the last of the N reported the version applied (read from their JSON lines; the
digests are checked against the trainer's). Times are medians over ``--steps`` versions
on this machine, which the N processes share with the trainer: compare the layouts of one
run, not runs of different machines.

On one machine loopback is nearly free, so the trainer's uplink is never the bottleneck.
``--uplink-mbit M`` (root, iproute2) makes it one: the receivers run in a network namespace
joined to the trainer by a veth pair whose trainer-to-rollouts direction is shaped to M
Mbit/s (tc tbf), while relays and their leaves talk over the namespace's own loopback, as
rollouts in one cluster would. Only addresses of that namespace pair are used.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import report
from protocol.wire.checksum import state_digest
from sender import Sender

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 300.0
CONFIG = {"type": "patch"}


def rollout_model(width: int = 1024, depth: int = 4) -> nn.Module:
    """The receivers' model (``--model benchmarks.fanout:rollout_model``); the trainer's has the same shape."""
    torch.manual_seed(1)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def bf16_digest(model: nn.Module) -> str:
    return state_digest({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})


class Rollout:
    """One ``python -m receiver`` process and the events it printed, time-stamped on arrival."""

    def __init__(self, proc: asyncio.subprocess.Process, identity: str) -> None:
        self.proc, self.identity = proc, identity
        self.applied: dict[int, tuple[float, str]] = {}  # version -> (arrival, digest)
        self.events: dict[int, dict[str, Any]] = {}  # version -> its "applied" event
        self.relay_endpoint: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.reader = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, identity: str, upstream: str, relay: bool, netns: str | None = None, extra: tuple[str, ...] = ()) -> Rollout:
        args = [
            *(["ip", "netns", "exec", netns] if netns else []),
            sys.executable, "-m", "receiver", "--endpoint", upstream, "--model", "benchmarks.fanout:rollout_model",
            "--dtype", "bfloat16", "--identity", identity, "--digest", "--peer-timeout", "60", "--log-level", "WARNING",
        ]
        args += extra
        if relay:
            args += ["--relay-bind", "tcp://127.0.0.1:0"]
        if netns:  # the trainer's end of the veth is not loopback: a test link of this machine
            args += ["--insecure-plaintext"]
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        proc = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env)
        return cls(proc, identity)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            event = json.loads(line)
            if event["event"] == "applied" and event.get("version") is not None:
                self.applied[event["version"]] = (time.perf_counter(), event["digest"])
                self.events[event["version"]] = event
            elif event["event"] == "relay" and not self.relay_endpoint.done():
                self.relay_endpoint.set_result(event["endpoint"])

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
        await asyncio.wait_for(self.proc.wait(), TIMEOUT)
        await asyncio.gather(self.reader, return_exceptions=True)


@contextlib.contextmanager
def shaped_uplink(mbit: float) -> Iterator[tuple[str, str]]:
    """A namespace for the rollouts, reached from here over a veth pair shaped to ``mbit``
    Mbit/s towards them; yields (namespace, this side's address). Removed on exit."""
    tag = uuid.uuid4().hex[:6]
    ns, here, there = f"wsfan-{tag}", f"wsf{tag}h", f"wsf{tag}n"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", ns)
    try:
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", "10.123.9.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("-n", ns, "addr", "add", "10.123.9.2/24", "dev", there)
        ip("-n", ns, "link", "set", there, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        subprocess.run(["tc", "qdisc", "add", "dev", here, "root", "tbf", "rate", f"{mbit}mbit", "burst", "256kb", "latency", "500ms"],
                       check=True, capture_output=True, timeout=30)
        yield ns, "10.123.9.1"
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # takes the veth pair with it


async def wait_applied(rollouts: list[Rollout], version: int) -> float:
    """When the last of ``rollouts`` reported ``version`` (perf_counter)."""
    while not all(version in r.applied for r in rollouts):
        if any(r.proc.returncode is not None for r in rollouts):
            raise RuntimeError("a receiver process exited")
        await asyncio.sleep(0.002)
    return max(r.applied[version][0] for r in rollouts)


async def run_layout(n: int, tree: bool, fanout: int, steps: int, lr: float, uplink: tuple[str, str] | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rollouts: list[Rollout] = []
    netns, address = uplink or (None, "127.0.0.1")
    async with Sender(f"tcp://{address}:0", CONFIG, peer_timeout=60.0, insecure_plaintext=uplink is not None) as sender:
        await sender.start(model, version=0)
        relays = min(n, fanout) if tree and n > 1 else 0
        try:
            for i in range(relays):
                rollouts.append(await Rollout.start(f"relay-{i}", sender.endpoint, relay=True, netns=netns))
            parents = [await asyncio.wait_for(r.relay_endpoint, TIMEOUT) for r in rollouts]
            for i in range(n - relays):
                upstream = parents[i % len(parents)] if parents else sender.endpoint
                rollouts.append(await Rollout.start(f"leaf-{i}", upstream, relay=False, netns=netns))
            await asyncio.wait_for(wait_applied(rollouts, 0), TIMEOUT)
            bootstrap_bytes = sender.bytes_sent
            expected = {0: bf16_digest(model)}
            times, versions_bytes = [], []
            x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(2))
            for version in range(1, steps + 1):
                loss = model(x).square().mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                expected[version] = bf16_digest(model)
                before = sender.bytes_sent
                started = time.perf_counter()
                await sender.sync(model, version)
                done = await asyncio.wait_for(wait_applied(rollouts, version), TIMEOUT)
                times.append(done - started)
                await sender.wait_acked(version, timeout=TIMEOUT)
                versions_bytes.append(sender.bytes_sent - before)
            wrong = [(r.identity, v) for r in rollouts for v, (_, d) in r.applied.items() if v in expected and d != expected[v]]
            if wrong:
                raise RuntimeError(f"digests differ from the trainer's: {wrong[:4]}")
        finally:
            await asyncio.gather(*(r.stop() for r in reversed(rollouts)))
    return {
        "receivers": n,
        "layout": "tree" if relays else "direct",
        "first_level": relays or n,
        "trainer_bootstrap_bytes": bootstrap_bytes,
        "trainer_bytes_per_version": statistics.median(versions_bytes),
        "trainer_bytes_per_version_samples": versions_bytes,
        "all_applied_s": statistics.median(times),
        "all_applied_s_samples": times,
        "digests_equal": True,
    }


async def run(receivers: list[int], fanout: int, steps: int, lr: float, uplink_mbit: float | None = None) -> dict[str, Any]:
    started, load = time.perf_counter(), os.getloadavg()[0]
    with shaped_uplink(uplink_mbit) if uplink_mbit else contextlib.nullcontext() as uplink:
        results = await run_layouts(receivers, fanout, steps, lr, uplink)
    return {
        "benchmark": "weightsync-fanout",
        "command": report.command("-m benchmarks.fanout"),
        "machine": report.machine(load),
        "model": "4 x Linear(1024, 1024): 4.2M parameters, fp32 trainer, bf16 receivers",
        "lr": lr,
        "fanout": fanout,
        "uplink": f"veth into a namespace, tc tbf {uplink_mbit} Mbit/s towards the rollouts" if uplink_mbit else "tcp loopback, unshaped",
        "results": results,
        "wall_s": time.perf_counter() - started,
    }


async def run_layouts(receivers: list[int], fanout: int, steps: int, lr: float, uplink: tuple[str, str] | None) -> list[dict[str, Any]]:
    results = []
    for n in receivers:
        for tree in (False, True):
            if tree and n <= 1:
                continue  # one receiver: the tree is the direct connection
            result = await run_layout(n, tree, fanout, steps, lr, uplink)
            print(f"  {n} receivers, {result['layout']}: trainer {result['trainer_bytes_per_version']:.0f} B/version, "
                  f"all applied in {result['all_applied_s'] * 1e3:.0f} ms", file=sys.stderr, flush=True)
            results.append(result)
    return results


def table(doc: dict[str, Any]) -> str:
    rows = ["| receivers | layout | trainer sends to | trainer bytes / version | bootstrap bytes | all applied (median) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for r in doc["results"]:
        rows.append(f"| {r['receivers']} | {r['layout']} | {r['first_level']} | {r['trainer_bytes_per_version']:,.0f} | "
                    f"{r['trainer_bootstrap_bytes']:,} | {r['all_applied_s'] * 1e3:.0f} ms |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fanout", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--receivers", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--fanout", type=int, default=2, help="relays under the trainer in the tree layout")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--uplink-mbit", type=float, help="shape the trainer's uplink to this many Mbit/s (root: a namespace and tc)")
    args = p.parse_args(argv)
    doc = asyncio.run(run(args.receivers, args.fanout, args.steps, args.lr, args.uplink_mbit))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print(table(doc))
    print(f"\nwall time {doc['wall_s']:.1f}s; JSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
