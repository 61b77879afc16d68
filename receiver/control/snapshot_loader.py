"""The ``ipc_snapshot`` load strategy on the rollout side: reload from snapshot files.

The trainer (``sender.write_snapshot``) writes ``step_<version>.safetensors``
files into a directory on the same host; the receiver sidecar
(``python -m receiver --load-strategy ipc_snapshot --watch DIR``) loads the newest one,
checks every name, shape and dtype, casts it to the rollout's dtypes, and only then
writes it (into the engine's shared-memory region under its seqlock, or into its own
model). A file that does not fit is rejected whole and the model keeps its version.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
from torch import nn

from protocol.errors import WeightSyncError
from protocol.host.cli import report
from protocol.host.shm import Layout, Region
from protocol.host.snapfile import newest_snapshot, read_snapshot
from protocol.wire.checksum import state_digest

log = logging.getLogger(__name__)


async def follow_snapshots(
    model: nn.Module,
    region: Region | None,
    directory: Path,
    stop: asyncio.Event,
    on_applied: Callable[[int], Awaitable[None]],
    *,
    poll: float = 0.05,
) -> int | None:
    """Apply each newer snapshot in ``directory`` until ``stop``; returns the last version.

    Versions may be skipped (only the newest file counts). ``on_applied(version)`` runs
    after each complete write.
    """
    version: int | None = None
    rejected: set[Path] = set()
    layout = region.layout if region is not None else Layout.of(model.state_dict())
    while not stop.is_set():
        found = newest_snapshot(directory, version)
        if found is None or found[1] in rejected:
            try:
                await asyncio.wait_for(stop.wait(), poll)
            except TimeoutError:
                pass
            continue
        new, path = found
        try:
            _, tensors = await asyncio.to_thread(read_snapshot, path, layout)
        except (WeightSyncError, OSError) as e:  # a bad file: keep the current version, report once
            log.error("rejected snapshot %s: %s", path, e)
            rejected.add(path)
            continue
        if region is not None:
            async with region.writing_async(new):
                await asyncio.to_thread(region.load, tensors)
        else:
            await asyncio.to_thread(_load, model, tensors)
        version = new
        await on_applied(new)
    return version


@torch.no_grad()
def _load(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    model.load_state_dict(tensors, strict=True)


async def serve_snapshots(args: argparse.Namespace, model: nn.Module, region: Region | None, stop: asyncio.Event) -> None:
    """``python -m receiver --load-strategy ipc_snapshot``: follow ``--watch`` until stopped,
    reporting each applied version (with ``--digest``, its state digest) as a JSON line."""

    async def applied(version: int) -> None:
        fields: dict[str, object] = {"version": version, "identity": args.identity, "kind": "ipc_snapshot"}
        if args.digest:
            fields["digest"] = await asyncio.to_thread(state_digest, model.state_dict())
        report("applied", **fields)

    Path(args.watch).mkdir(parents=True, exist_ok=True)
    try:
        version = await follow_snapshots(model, region, args.watch, stop, applied)
        if args.save is not None:
            torch.save(model.state_dict(), args.save)
    finally:
        if region is not None:
            region.close()
    report("stopped", version=version, identity=args.identity)
