"""``python -m sender``: the sender daemon as a sidecar process.

It serves the newest checkpoint of a trainer: the trainer saves each version as
``<watch>/step_<version>.pt`` (a state dict, written to a temporary name and renamed),
and the daemon syncs every new one to its receivers.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from pathlib import Path

import torch

from protocol.cli import load_object, report, run, setup_logging

from .service import Sender

log = logging.getLogger("sender")
STEP = re.compile(r"step_(\d+)\.pt$")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sender", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="address to bind: tcp://host:port, ipc://path, tcp://host:0 for any port")
    p.add_argument("--config", help="weight_syncer YAML (examples/config/weight_syncer/patch_syncer.yaml); default: patch defaults")
    p.add_argument("--watch", required=True, type=Path, help="directory the trainer writes step_<version>.pt state dicts to")
    p.add_argument("--model", help="module:factory building the trainer's model (marks frozen parameters); default: all keys tracked")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between scans of --watch")
    p.add_argument("--ring-size", type=int, default=8, help="recent patches kept to catch up late receivers")
    p.add_argument("--max-inflight", type=int, default=2, help="versions sent to a receiver ahead of its acks")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="seconds of silence before a receiver is dropped")
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def newest(watch: Path, after: int | None) -> tuple[int, Path] | None:
    steps = sorted((int(m.group(1)), f) for f in watch.iterdir() if (m := STEP.search(f.name)))
    steps = [s for s in steps if after is None or s[0] > after]
    return steps[-1] if steps else None


def load(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(path, map_location="cpu", weights_only=True)
    return state


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    args.watch.mkdir(parents=True, exist_ok=True)
    first = newest(args.watch, None)
    model = load_object(args.model)() if args.model else None
    version = None
    if first is not None:
        version, path = first
        state = load(path)
        if model is None:
            model = state
        else:
            model.load_state_dict(state)
    if model is None:
        raise SystemExit(f"no --model and no checkpoint in {args.watch}: nothing to serve")
    sender = Sender(
        args.endpoint, args.config, ring_size=args.ring_size, max_inflight=args.max_inflight,
        heartbeat_interval=args.heartbeat, peer_timeout=args.peer_timeout,
    )
    async with sender:
        await sender.start(model, version=version)
        report("listening", endpoint=sender.endpoint, version=version, session=sender.session)
        while not stop.is_set():
            found = newest(args.watch, sender.version)
            if found is None:
                try:
                    await asyncio.wait_for(stop.wait(), args.poll)
                except TimeoutError:
                    pass
                continue
            step, path = found
            state = await asyncio.to_thread(load, path)
            if isinstance(model, dict):
                model = state
            else:
                model.load_state_dict(state)
            stats = await sender.sync(model, step)
            report("synced", **stats.as_dict(), receivers=sender.receivers)
    report("stopped", version=sender.version)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    setup_logging(args.log_level)
    run(lambda stop: serve(args, stop))


if __name__ == "__main__":
    main()
