"""`make demo`: a trainer and two rollouts, three processes, syncing over TCP loopback.

The trainer does real AdamW steps on a small transformer (fp32) and syncs every step;
each bf16 rollout keeps generating while updates are applied in the background. One
line per version, then a summary. Everything runs on built-in defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


async def spawn(name: str, *argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(sys.executable, str(HERE / argv[0]), *argv[1:], stdout=asyncio.subprocess.PIPE)


async def main(args: argparse.Namespace) -> int:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    extra = ["--config", args.config] if args.config else []
    trainer = await spawn("trainer", "trainer.py", "--endpoint", endpoint, "--steps", str(args.steps), "--receivers", "2", *extra)
    rollouts = [
        await spawn(f"rollout-{i}", "rollout.py", "--endpoint", endpoint, "--identity", f"rollout-{i}", "--until", str(args.steps), *extra)
        for i in range(2)
    ]
    print(f"weightsync demo: trainer + 2 rollouts on {endpoint}, {args.steps} AdamW steps, fp32 trainer -> bf16 rollouts\n")
    print(f"{'ver':>4} {'changed':>8} {'wire':>11} {'dense':>11} {'ratio':>6} {'build':>8} {'recv+dec':>9} {'apply':>7}  rollouts")
    trained: dict[int, dict[str, Any]] = {}
    applied: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    printed: set[int] = set()
    done: dict[str, dict[str, Any]] = {}
    mismatches = 0

    def try_print(version: int) -> None:
        nonlocal mismatches
        t, rs = trained.get(version), applied.get(version, {})
        if version in printed or t is None or len(rs) < 2:
            return
        printed.add(version)
        # a version a rollout had already replaced when it reported (its hooks run in their own task) has no digest
        equal = all(r["digest"] is None or r["digest"] == t["digest"] for r in rs.values())
        mismatches += not equal
        worst = max(rs.values(), key=lambda r: r.get("decode_seconds", 0.0))
        vers = " ".join(f"{name}=v{r['version']}" for name, r in sorted(rs.items()))
        if "changed_fraction" not in t:  # version 0: the bootstrap, before training
            print(f"{version:>4} {'bootstrap':>66}  {vers}  digests {'equal' if equal else 'DIFFER'}", flush=True)
            return
        changed = f"{100 * t['changed_fraction']:.2f}%"
        ratio = t["dense_bytes"] / t["wire_bytes"] if t.get("wire_bytes") else 0.0
        print(
            f"{version:>4} {changed:>8} {kib(t.get('wire_bytes', 0)):>11} {kib(t.get('dense_bytes', 0)):>11} {ratio:>5.1f}x "
            f"{1e3 * t.get('build_seconds', 0):>6.1f}ms {1e3 * worst.get('decode_seconds', 0):>7.1f}ms "
            f"{1e3 * worst.get('apply_seconds', 0):>5.1f}ms  {vers}  digests {'equal' if equal else 'DIFFER'}",
            flush=True,
        )

    async def pump(name: str, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            try:
                event = json.loads(raw)
            except json.JSONDecodeError:
                continue
            if event["event"] == "synced":
                trained[event["version"]] = event
                try_print(event["version"])
            elif event["event"] == "ready":
                trained[0] = {"digest": event["digest"]}
            elif event["event"] == "applied" and event.get("version") is not None:
                applied[event["version"]][name] = event
                try_print(event["version"])
            elif event["event"] == "done":
                done[name] = event

    names = ["trainer", "rollout-0", "rollout-1"]
    procs = [trainer, *rollouts]
    try:
        await asyncio.wait_for(asyncio.gather(*(pump(n, p) for n, p in zip(names, procs))), args.timeout)
        codes = await asyncio.gather(*(p.wait() for p in procs))
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
    steps = [trained[v] for v in range(1, args.steps + 1) if v in trained]
    wire = sum(t["wire_bytes"] for t in steps)
    dense = sum(t["dense_bytes"] for t in steps)
    final_equal = all(applied[args.steps].get(n, {}).get("digest") == trained.get(args.steps, {}).get("digest") for n in names[1:])
    print("\nsummary")
    print(f"  versions synced        {len(steps)} (every one applied by both rollouts: {len(printed) >= len(steps)})")
    if steps:
        print(f"  mean changed           {100 * sum(t['changed_fraction'] for t in steps) / len(steps):.2f}% of elements per step")
        print(f"  wire bytes             {kib(wire)} vs {kib(dense)} for full bf16 copies ({dense / max(wire, 1):.1f}x less)")
        print(f"  mean build             {1e3 * sum(t['build_seconds'] for t in steps) / len(steps):.1f} ms per version")
    for n in names[1:]:
        print(f"  {n:<22} final v{done.get(n, {}).get('version')}, {done.get(n, {}).get('generations', 0)} generations run during sync")
    print(f"  digests                {'all equal' if mismatches == 0 and final_equal else f'{mismatches} versions DIFFER'}")
    ok = mismatches == 0 and final_equal and all(c == 0 for c in codes)
    print(f"  result                 {'OK' if ok else 'FAILED'} (exit codes {codes})")
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--config", help="weight_syncer YAML for all three (default: patch defaults)")
    p.add_argument("--timeout", type=float, default=180.0)
    sys.exit(asyncio.run(main(p.parse_args())))
