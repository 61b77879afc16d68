"""An FSDP2 (``fully_shard``) trainer on 2 ranks (gloo, CPU) syncing one bf16 receiver.

Each rank holds half of every weight. Rank 0 hosts the one ``Sender``; every rank calls
``ShardedSync.sync`` after its AdamW step. Under the sharded build (the default) each rank
compares its own shards with its own snapshot of them and only the encoded changes travel
to rank 0, which publishes them: no rank ever holds a weight gathered for a patch. A bf16
``Receiver`` runs in rank 0's event loop and joins before the first version: a bootstrap
needs the whole model, which the ranks gather together at the next version, so it holds
v1 after the first sync and is patched from then on. ``--gather`` runs the gathering
build instead (every weight gathered to rank 0, one at a time, each version). Prints a
``listening`` JSON line with the Sender's endpoint, then a JSON line per version, like
``examples/trainer.py``. Rollouts of your own join it at that endpoint (``--endpoint`` fixes
it; ``--step-interval`` leaves them time to follow):

    python examples/fsdp2_trainer.py --steps 5
    python examples/fsdp2_trainer.py --endpoint tcp://127.0.0.1:5555 --steps 50 --step-interval 1 &
    python -m receiver --endpoint tcp://127.0.0.1:5555 --model examples.tiny_model:build
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.tiny_model import TinyLM, build, train_step
from protocol.host.cli import report, setup_logging
from protocol.wire.checksum import state_digest
from receiver import Receiver
from sender import Sender, ShardedSync


def build_sharded(world: int, *, freeze_pos: bool = True, **shape: int) -> TinyLM:
    """The tiny transformer (``shape``: ``TinyLM``'s sizes), each block and then the root
    sharded over ``world`` CPU ranks. ``pos`` is frozen: a sharded weight that only travels
    in bootstraps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build(seed=0, **shape)
    model.pos.requires_grad_(not freeze_pos)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_bf16_digest(model: torch.nn.Module) -> str | None:
    """What a bf16 rollout must hold, as a digest (rank 0; None elsewhere). A check only:
    every rank gathers every weight for it, outside the sync."""
    out = {}
    for key, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if dist.get_rank() == 0:
            out[key] = full.to(torch.bfloat16) if full.is_floating_point() else full.clone()
    return state_digest(out) if dist.get_rank() == 0 else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def train(rank: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train and sync on this rank; rank 0 returns a record per version."""
    model = build_sharded(dist.get_world_size())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own batches
    sharded = ShardedSync(model, gather=args.gather)
    records: list[dict[str, Any]] = []
    async with contextlib.AsyncExitStack() as stack:
        sender = None
        if rank == 0:
            sender = Sender(args.endpoint, args.config, trainable_keys=sharded.trainable_keys)
            await stack.enter_async_context(sender)
        await sharded.start(sender, version=0)
        if sender is not None:
            report("listening", endpoint=sender.endpoint, version=0)
        receiver: Receiver | None = None
        joined: asyncio.Future[Any] | None = None
        if sender is not None:
            rollout = build(seed=1).to(torch.bfloat16)  # other weights: only the sync makes them equal
            receiver = Receiver(rollout, sender.endpoint, args.config)
            await stack.enter_async_context(receiver)
            joined = asyncio.ensure_future(receiver.start())  # its handshake ends at the next version
            while not sender.bootstrap_wanted and not joined.done():  # its HELLO is in: v1 bootstraps it
                await asyncio.sleep(0.01)
        for step in range(1, args.steps + 1):
            if args.step_interval:
                await asyncio.sleep(args.step_interval)
            loss = train_step(model, optimizer, generator)
            stats = await sharded.sync(sender, step)  # every rank; the Sender's stats on rank 0
            digest = full_bf16_digest(model)
            if sender is None:
                continue
            assert stats is not None and receiver is not None and joined is not None
            await joined
            await sender.flush()
            await receiver.wait_for_version(step, timeout=30)
            async with receiver.reading():
                applied = state_digest(rollout.state_dict())
            g = sharded.stats
            record = {
                "version": step, "loss": loss, "digest": digest, "receiver_digest": applied,
                "gathered": len(g.last), "peak_gathered_alive": g.peak_live, "peak_gathered_bytes": g.peak_bytes,
                **stats.as_dict(),
            }
            report("synced", **record)
            records.append(record)
        if sender is not None:
            await sender.wait_acked(args.steps, timeout=30)
            report("done", version=args.steps, receivers=sender.receivers)
    return records


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    setup_logging(args.log_level)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        asyncio.run(train(rank, args))
    finally:
        dist.destroy_process_group()


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--gather", action="store_true", help="the gathering build (ShardedSync(gather=True))")
    p.add_argument("--endpoint", default="tcp://127.0.0.1:0", help="where rank 0's Sender binds (port 0: any; printed as 'listening')")
    p.add_argument("--step-interval", type=float, default=0.0, help="seconds between steps (time for rollouts of your own to follow)")
    p.add_argument("--log-level", default="WARNING")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    arguments = parse()
    mp.spawn(run_rank, args=(arguments.world, free_port(), arguments), nprocs=arguments.world)
