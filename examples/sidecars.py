"""The two processes that sit beside the sidecars: a trainer and a rollout engine.

    python -m sender --shm trainer-w --handoff ipc:///tmp/ws.handoff --endpoint tcp://127.0.0.1:5555
    python -m receiver --endpoint tcp://127.0.0.1:5555 --model examples.tiny_model:build --shm engine0-w
    python -m examples.sidecars engine --shm engine0-w
    python -m examples.sidecars trainer --shm trainer-w --handoff ipc:///tmp/ws.handoff --steps 5

The trainer does real AdamW steps and publishes each version through
``sender.SidecarClient`` (or, with ``--snapshots DIR``, writes ipc_snapshot files);
with ``--steps 0`` it reads one command per stdin line (``step``, ``quit``), as the
tests drive it. The engine maps its bf16 model onto the receiver sidecar's region and
generates in a loop, checking that no read ever mixes two versions. Both print one JSON
line per event.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.tiny_model import build, generate, train_step
from protocol.host.cli import report
from protocol.wire.checksum import state_digest
from receiver import attach
from sender import SidecarClient, write_snapshot


def bf16_digest(model: torch.nn.Module) -> str:
    """The digest a bf16 rollout reports for this model's weights."""
    state = {k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach() for k, v in model.state_dict().items()}
    return state_digest(state)


def trainer(args: argparse.Namespace) -> None:
    model = build(seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1234)
    client = None if args.snapshots else SidecarClient(args.handoff, args.shm, timeout=args.timeout)

    def publish(version: int) -> None:
        if client is not None:
            client.publish(model, version)
        else:
            write_snapshot(model.state_dict(), args.snapshots, version)
        report("published", version=version, digest=bf16_digest(model))

    try:
        version = 0
        publish(version)
        commands = (line.strip() for line in sys.stdin) if args.steps == 0 else iter(["step"] * args.steps)
        for command in commands:
            if command == "quit":
                break
            if command == "step":
                train_step(model, optimizer, generator)
                version += 1
                publish(version)
        if client is not None:
            client.flush()
    finally:
        if client is not None:
            client.close()  # unlinks the region this process owns
    report("stopped", version=version)


def engine(args: argparse.Namespace) -> None:
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    model = build(seed=99).to(torch.bfloat16)  # other weights than the trainer's: only syncing makes them equal
    attached = attach(model, args.shm, timeout=args.timeout)
    prompt = torch.tensor([[1, 2, 3, 4]])
    seen: dict[int, str] = {}
    reads = 0
    while not stop:
        if args.mode == "reading":
            with attached.reading() as version:
                digest = state_digest(model.state_dict())
                generate(model, prompt, 2)  # inference on the weights held still
                if state_digest(model.state_dict()) != digest:
                    report("mixed", version=version, why="weights changed inside reading()")
        else:
            version, state = attached.snapshot()
            digest = state_digest(state)
        reads += 1
        if version is not None:
            if version not in seen:
                seen[version] = digest
                report("observed", version=version, digest=digest, reads=reads)
            elif seen[version] != digest:
                report("mixed", version=version, why="two digests for one version")
        time.sleep(0.01)
    report("stopped", reads=reads, versions=sorted(seen))
    attached.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m examples.sidecars", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="role", required=True)
    t = sub.add_parser("trainer")
    t.add_argument("--shm", default="weightsync-trainer")
    t.add_argument("--handoff", default="ipc:///tmp/weightsync-weightsync-trainer.handoff")
    t.add_argument("--snapshots", type=Path, help="write ipc_snapshot files here instead of publishing to a sidecar")
    t.add_argument("--steps", type=int, default=5, help="0: read 'step' / 'quit' commands from stdin")
    t.add_argument("--seed", type=int, default=7)
    t.add_argument("--timeout", type=float, default=60.0)
    e = sub.add_parser("engine")
    e.add_argument("--shm", required=True)
    e.add_argument("--mode", choices=["reading", "snapshot"], default="reading", help="blocking reads, or lock-free seqlock copies")
    e.add_argument("--timeout", type=float, default=60.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    trainer(args) if args.role == "trainer" else engine(args)


if __name__ == "__main__":
    main()
