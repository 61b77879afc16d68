"""A rollout worker with an in-process weightsync Receiver: it keeps generating under
the receiver's read lock while new versions are applied in the background, and prints
a JSON line per applied version (used by demo.py).

    python examples/rollout.py --endpoint tcp://127.0.0.1:5555 --identity rollout-0
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.tiny_model import build, generate
from protocol.host.cli import report, setup_logging
from protocol.wire.checksum import state_digest
from receiver import Receiver


async def main(args: argparse.Namespace) -> None:
    model = build(seed=1234).to(torch.bfloat16)  # different weights: the bootstrap aligns them
    generations = 0
    stop = asyncio.Event()

    async def infer() -> None:
        nonlocal generations
        prompt = torch.tensor([[1, 2, 3, 4]])
        while not stop.is_set():
            async with receiver.reading():  # never sees a half-applied version
                await asyncio.to_thread(generate, model, prompt, 4)
            generations += 1
            await asyncio.sleep(0)

    async def on_update(version: int | None) -> None:
        async with receiver.reading() as held:  # hooks run in their own task: a newer version may be in by now
            digest = await asyncio.to_thread(state_digest, model.state_dict()) if held == version else None
        stats = receiver.stats.get(version) if version is not None else None
        fields = stats.as_dict() if stats else {}
        fields.update(identity=receiver.identity, version=version, digest=digest, generations=generations)
        report("applied", **fields)
        if version is not None and version >= args.until:
            stop.set()

    async with Receiver(model, args.endpoint, args.config, identity=args.identity) as receiver:
        receiver.on_update(on_update)
        await receiver.start(timeout=60)
        worker = asyncio.create_task(infer())
        await asyncio.wait_for(stop.wait(), args.timeout)
        await worker
        report("done", identity=receiver.identity, version=receiver.version, generations=generations)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--identity", default="rollout-0")
    p.add_argument("--until", type=int, default=20, help="exit after applying this version")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    asyncio.run(main(args))
