"""``python -m receiver``: the receiver daemon as a sidecar process.

Builds the rollout's model locally (``--model module:factory``, cast to ``--dtype``),
follows a sender, and reports each applied version as a JSON line on stdout (with the
state digest, so a script can check it against the trainer's).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import torch

from protocol.checksum import state_digest
from protocol.cli import load_object, report, run, setup_logging
from protocol.dtypes import parse_float_dtype

from .service import Receiver

log = logging.getLogger("receiver")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m receiver", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="the sender's address")
    p.add_argument("--config", help="weight_syncer YAML; must name the same strategy as the sender's")
    p.add_argument("--model", required=True, help="module:factory building the rollout's model")
    p.add_argument("--dtype", default="bfloat16", help="cast the model's floating tensors to this dtype (or 'keep')")
    p.add_argument("--identity", help="stable receiver id (default: host-pid-random)")
    p.add_argument("--save", type=Path, help="torch.save the state dict here on shutdown")
    p.add_argument("--digest", action="store_true", help="include the state digest in each report")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="seconds of silence before reconnecting")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    model = load_object(args.model)()
    if args.dtype != "keep":
        model = model.to(parse_float_dtype(args.dtype))
    receiver = Receiver(
        model, args.endpoint, args.config, identity=args.identity,
        heartbeat_interval=args.heartbeat, peer_timeout=args.peer_timeout,
    )

    async def on_update(version: int | None) -> None:
        fields: dict[str, object] = {"version": version, "identity": receiver.identity}
        stats = receiver.stats.get(version) if version is not None else None
        if stats is not None:
            fields.update(stats.as_dict())
        if args.digest:
            async with receiver.reading():
                fields["digest"] = await asyncio.to_thread(state_digest, model.state_dict())
        report("applied", **fields)

    receiver.on_update(on_update)
    async with receiver:
        started = asyncio.ensure_future(receiver.start(timeout=None))
        await asyncio.wait([started, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        if started.done():
            started.result()  # surface a failed handshake (metadata mismatch, ...)
            await stop.wait()
        else:
            started.cancel()
        if args.save is not None:
            async with receiver.reading():
                torch.save(model.state_dict(), args.save)
    report("stopped", version=receiver.version, identity=receiver.identity)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    run(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
