"""A trainer with an in-process weightsync Sender: real AdamW steps on a small
transformer, one sync per step. Prints a JSON line per version (used by demo.py).

    python examples/trainer.py --endpoint tcp://127.0.0.1:5555 --steps 20 --receivers 2
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.tiny_model import build, train_step
from protocol.host.cli import report, setup_logging
from protocol.wire.checksum import state_digest
from sender import Sender


def bf16_digest(model: torch.nn.Module) -> str:
    """What a bf16 rollout must hold, as a digest."""
    return state_digest({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()})


async def main(args: argparse.Namespace) -> None:
    model = build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    async with Sender(args.endpoint, args.config) as sender:
        await sender.start(model, version=0)
        report("listening", endpoint=sender.endpoint)
        await sender.wait_for_receivers(args.receivers, timeout=60)
        await sender.wait_acked(0, timeout=60)
        report("ready", digest=bf16_digest(model))
        for step in range(1, args.steps + 1):
            loss = train_step(model, optimizer, generator)
            stats = await sender.sync(model, step)  # returns once the changes are collected
            await sender.flush()  # only so this line can report wire bytes: encoding is background work
            report("synced", loss=loss, digest=bf16_digest(model), **stats.as_dict())
            await asyncio.sleep(args.step_interval)  # the rest of a real step (rollouts, logging, ...)
        await sender.wait_acked(args.steps, timeout=60)
        report("done", version=args.steps, receivers=sender.receivers)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--receivers", type=int, default=2, help="wait for this many rollouts before training")
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--step-interval", type=float, default=0.2)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    asyncio.run(main(args))
