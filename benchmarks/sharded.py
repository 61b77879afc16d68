"""A sharded (FSDP2) trainer's sync: the sharded build against the gathering build (issue 36).

    python -m benchmarks.sharded --ranks 2 4 --json benchmarks/results/sharded.json [--versions 2] [--tiny]

For each world size and build (``ShardedSync(model)`` and ``ShardedSync(model, gather=True)``),
one spawn of gloo ranks on this machine's CPUs trains a sharded transformer (``TinyLM``, by
default 32000 x 1024 tied embedding, 8 blocks: ~134M parameters, fp32, real forward/backward
and AdamW steps) and syncs it through one Sender on rank 0 to 2 bf16 receivers in rank 0's
event loop. Two warm-up versions (the receivers' bootstrap among them), then for each lr
(1e-6, 1e-5) ``--versions`` measured versions, each:

* ``sync_s`` per rank: the wall time of ``ShardedSync.sync`` on that rank (what blocks its
  trainer; the ranks enter it together, after a barrier): ``slowest_rank_build_s`` is the
  largest, ``leader_build_s`` rank 0's;
* ``e2e_s``: from entering ``sync`` to both receivers acknowledging the version;
* ``group_bytes_per_version``: what the process group carried for the version. Sharded: the
  parts that crossed it plus the size agreement (``PartStats.group_bytes``). Gathering: each
  gathered tensor's all-gather delivers its other ranks' shards to every rank, (N-1) x its
  bytes in all. The version agreement (6 int64 a rank, both builds) and the sharded build's
  verdict (8 bytes to each other rank) are left out;
* ``patch_wire_bytes``: every frame the Sender published for the version;
* ``digests_equal``: after each lr's last version, both receivers hold the full model cast
  to bf16 bit for bit (a digest of the test's own gather).

``peak_rss_bytes_per_rank``: each rank's peak resident set over its whole spawn (training
included: the same model and optimizer in both builds, so the difference is the sync's).
Medians over the measured versions; records are one per (build, ranks, lr). Ranks share
this machine's cores: compare builds within one run, not across machines.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LRS = (1e-6, 1e-5)
FULL = {"vocab": 32000, "dim": 1024, "heads": 16, "layers": 8, "context": 16}
TINY = {"vocab": 512, "dim": 64, "heads": 4, "layers": 2, "context": 16}
WARMUP = 2  # versions before measuring: the receivers' bootstrap, and a first patch
BATCH = 2


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


async def _run(rank: int, world: int, build: str, shape: dict[str, int], versions: int) -> dict[str, Any] | None:
    from examples.fsdp2_trainer import build_sharded, full_bf16_digest
    from examples.tiny_model import build as build_model
    from examples.tiny_model import train_step
    from protocol.wire.checksum import state_digest
    from receiver import Receiver
    from sender import Sender
    from sender.sharded.sync import ShardedSync

    model = build_sharded(world, **shape)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LRS[0], weight_decay=0.0)
    generator = torch.Generator().manual_seed(1 + rank)
    sharded = ShardedSync(model, gather=build == "gather", timeout=600)
    full_bytes = {k: t.numel() * t.element_size() for k, t in model.state_dict().items()}
    config = {"weight_syncer": {"type": "patch"}}
    records: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        sender = Sender("tcp://127.0.0.1:0", config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
        if sender is not None:
            await stack.enter_async_context(sender)
        await sharded.start(sender, version=0)
        receivers: list[tuple[Receiver, torch.nn.Module]] = []
        joined: list[asyncio.Future[Any]] = []
        if sender is not None:
            for i in range(2):
                rollout = build_model(seed=10 + i, **shape).to(torch.bfloat16)
                receiver = Receiver(rollout, sender.endpoint, config, identity=f"rollout-{i}")
                await stack.enter_async_context(receiver)
                receivers.append((receiver, rollout))
                joined.append(asyncio.ensure_future(receiver.start(timeout=600)))
            if build == "gather":
                await asyncio.gather(*joined)
            else:  # bootstrapped at the next version: wait until one has asked
                while not sender.bootstrap_wanted:
                    await asyncio.sleep(0.01)
        version = 0
        for lr_index, lr in enumerate(LRS):
            for group in optimizer.param_groups:
                group["lr"] = lr
            count = versions + (WARMUP if lr_index == 0 else 0)
            for i in range(count):
                version += 1
                train_step(model, optimizer, generator, batch=BATCH)
                dist.barrier()
                started = time.perf_counter()
                stats = await sharded.sync(sender, version)
                sync_s = time.perf_counter() - started
                e2e_s = None
                if sender is not None:
                    await asyncio.gather(*joined)
                    await sender.flush()
                    await sender.wait_acked(version, timeout=600)
                    e2e_s = time.perf_counter() - started
                if build == "gather":
                    gathered = sum(full_bytes[k] for k in sharded.stats.last)
                    group_bytes = gathered * (world - 1)
                else:
                    part = sharded.part_stats
                    group_bytes = part.group_bytes if part is not None and part.version == version else None
                times = [None] * world
                dist.all_gather_object(times, sync_s)
                measured = i >= count - versions
                last = i == count - 1
                digests_equal = None
                if last:
                    expected = full_bf16_digest(model)
                    if sender is not None:
                        digests = []
                        for receiver, rollout in receivers:
                            async with receiver.reading():
                                digests.append(state_digest(rollout.state_dict()))
                        digests_equal = all(d == expected for d in digests)
                if sender is not None and measured:
                    assert stats is not None
                    records.append({
                        "lr": lr, "version": version, "sync_s": times, "e2e_s": e2e_s, "group_bytes": group_bytes,
                        "wire_bytes": stats.wire_bytes, "changed_elements": stats.changed_elements,
                        "digests_equal": digests_equal,
                    })
                    print(json.dumps({"build": build, "ranks": world, **records[-1]}), flush=True)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, _ru_maxrss_bytes())
    if rank != 0:
        return None
    dense = sum(t.numel() * 2 for k, t in model.state_dict().items() if k in set(sharded.trainable_keys))
    return {"records": records, "peak_rss": peaks, "params": sum(p.numel() for p in model.parameters()), "dense_bf16_bytes": dense}


def _worker(rank: int, world: int, port: int, build: str, shape: dict[str, int], versions: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=900))
    try:
        result = asyncio.run(_run(rank, world, build, shape, versions))
        if result is not None:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _spawn(world: int, build: str, shape: dict[str, int], versions: int, out: Path) -> dict[str, Any]:
    from examples.fsdp2_trainer import free_port

    mp.start_processes(_worker, args=(world, free_port(), build, shape, versions, str(out)), nprocs=world, start_method="spawn")
    return dict(json.loads(out.read_text()))


def summarize(build: str, world: int, lr: float, spawn: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in spawn["records"] if r["lr"] == lr]
    equal = [r["digests_equal"] for r in rows if r["digests_equal"] is not None]
    return {
        "build": build, "ranks": world, "lr": lr, "versions": len(rows), "params": spawn["params"],
        "dense_bf16_bytes": spawn["dense_bf16_bytes"],
        "group_bytes_per_version": statistics.median(r["group_bytes"] for r in rows),
        "patch_wire_bytes": statistics.median(r["wire_bytes"] for r in rows),
        "changed_elements": statistics.median(r["changed_elements"] for r in rows),
        "slowest_rank_build_s": statistics.median(max(r["sync_s"]) for r in rows),
        "leader_build_s": statistics.median(r["sync_s"][0] for r in rows),
        "e2e_s": statistics.median(r["e2e_s"] for r in rows),
        "peak_rss_bytes_per_rank": spawn["peak_rss"],
        "digests_equal": bool(equal) and all(equal),
        "per_version": rows,
    }


def targets(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with its ratio as measured here."""
    by = {(r["build"], r["ranks"], r["lr"]): r for r in runs}
    out = []
    for (build, ranks, lr), r in sorted(by.items()):
        if build != "sharded":
            continue
        g = by.get(("gather", ranks, lr))
        out.append({"target": "group bytes <= 1.5x the encoded patch", "ranks": ranks, "lr": lr,
                    "ratio": r["group_bytes_per_version"] / r["patch_wire_bytes"], "limit": 1.5,
                    "pass": r["group_bytes_per_version"] <= 1.5 * r["patch_wire_bytes"]})
        if g is None:
            continue
        ratio = r["slowest_rank_build_s"] / g["slowest_rank_build_s"]
        if ranks == 4:
            out.append({"target": "slowest rank's build <= 0.6x the gathering build's at 4 ranks", "ranks": ranks, "lr": lr,
                        "ratio": ratio, "limit": 0.6, "pass": ratio <= 0.6})
        if lr == 1e-6:
            e2e = r["e2e_s"] / g["e2e_s"]
            out.append({"target": "end to end below the gathering build's at lr 1e-6", "ranks": ranks, "lr": lr,
                        "ratio": e2e, "limit": 1.0, "pass": e2e < 1.0})
        wire = r["patch_wire_bytes"] / g["patch_wire_bytes"]
        out.append({"target": "wire bytes equal within 1%", "ranks": ranks, "lr": lr, "ratio": wire, "limit": 1.01,
                    "pass": abs(wire - 1) <= 0.01})
    return out


def table(runs: list[dict[str, Any]]) -> str:
    lines = ["| build | ranks | lr | group bytes | wire bytes | slowest rank s | leader s | e2e s | peak RSS/rank (max) | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(
            f"| {r['build']} | {r['ranks']} | {r['lr']:g} | {r['group_bytes_per_version'] / 1e6:.2f} MB | "
            f"{r['patch_wire_bytes'] / 1e6:.2f} MB | {r['slowest_rank_build_s']:.3f} | {r['leader_build_s']:.3f} | "
            f"{r['e2e_s']:.3f} | {max(r['peak_rss_bytes_per_rank']) / 2**20:.0f} MiB | {r['digests_equal']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--versions", type=int, default=2, help="measured versions per lr")
    p.add_argument("--tiny", action="store_true", help="a tiny model (a check of the harness, not a measurement)")
    args = p.parse_args(argv)
    shape = TINY if args.tiny else FULL
    started = time.perf_counter()
    runs = []
    args.json.parent.mkdir(parents=True, exist_ok=True)
    for world in args.ranks:
        for build in ("gather", "sharded"):
            spawn = _spawn(world, build, shape, args.versions, args.json.with_suffix(f".{build}{world}.part"))
            args.json.with_suffix(f".{build}{world}.part").unlink()
            runs += [summarize(build, world, lr, spawn) for lr in LRS]
    doc = {
        "benchmark": "sharded", "command": "python -m benchmarks.sharded " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model": shape, "runs": runs, "targets": targets(runs), "wall_s": time.perf_counter() - started,
    }
    args.json.write_text(json.dumps(doc, indent=2))
    print(table(runs))
    for t in doc["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'} {t['target']} (ranks {t['ranks']}, lr {t['lr']:g}): {t['ratio']:.3f} vs {t['limit']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
