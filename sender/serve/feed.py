"""A sender's versions fed to its ``VersionServer``: what ``Sender.sync`` and
``Sender.publish`` hand over once a version is built, and how.

A builder that streams (patches) has its parts served as they are built, in version order,
by one task per version chained after the one before (``flush`` waits for them); the last
part waits until the version has moved (``settle``): no receiver acknowledges a version
the server is not at. A whole version (buckets) is served at once, before it moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Callable

import torch

from protocol.net.server import VersionServer
from protocol.wire.framing import Message

from ..stats import SyncStats
from ..streams import Mark
from ..version.builder import BuildFailed, VersionBuilder
from .source import TrainerSource

log = logging.getLogger(__name__)


class VersionFeed:
    """Versions of ``strategy`` into ``server``; ``synced`` is called with a version's stats
    once it is served whole (a patch's, when its last part is)."""

    def __init__(self, server: VersionServer, strategy: str, synced: Callable[[SyncStats], None]) -> None:
        self.server, self.strategy, self._synced = server, strategy, synced
        self._serving: asyncio.Task[None] | None = None  # the newest patch being served
        self._moved: asyncio.Future[bool] | None = None  # whether that version became the server's
        self._reported: int | None = None  # the version whose stats its task reports once served

    async def build(self, source: TrainerSource, tensors: dict[str, torch.Tensor], version: int, after: Mark) -> SyncStats:
        """``version`` read from ``tensors`` and handed to the server (call under its lock,
        then ``server.moved`` and ``settle``); returns once the model has been read, which
        is after the work ``after`` marks (the trainer's step, on the streams of ``sync``'s caller)."""
        builder = source.builder
        if builder is None:  # no receiver yet: nothing to diff against, only the version moves
            source.hold(tensors)
            return SyncStats(version, self.strategy)
        assert source.plan is not None
        started = time.perf_counter()
        tensors, after = await source.plan.rolled(tensors, after)  # as the receivers hold them (fp8: quantized)
        quantize_s = time.perf_counter() - started if source.plan.view is not None else 0.0
        if builder.diverged:  # a failed sync moved what is at rest: patches from it would be wrong
            return await self._resync_all(builder, tensors, version, after)
        base, stats = self.server.version, SyncStats(version, self.strategy, quantize_seconds=quantize_s)
        build = builder.build(tensors, version, base, stats, after)
        if not builder.streams:  # a whole version: read, built, then served at once before it moves
            started = time.perf_counter()
            await build.read()
            frames_list = [self.server.stamp(m) async for m in build.parts]
            self.server.publish_buckets(version, frames_list)
            stats.messages, stats.wire_bytes = len(frames_list), sum(len(f) for fr in frames_list for f in fr)
            stats.build_seconds = time.perf_counter() - started
            return stats
        # A patch, encoded and published part by part while the model is read, after the
        # versions before it: the first parts travel before the last tensors are compared.
        previous = self._serving
        self._moved = asyncio.get_running_loop().create_future()
        self.server.expect_patch(base)
        self._serving = self.server.spawn(self._serve_parts(previous, build.parts, version, base, stats, self._moved), f"encode-v{version}")
        self._reported = version
        await build.read()
        return stats

    def reports(self, version: int) -> bool:
        """Whether ``version``'s stats are reported (``synced``) here, once it is served."""
        return self._reported == version

    def settle(self, moved: bool) -> None:
        """The version being built became the server's (``moved``), or never will."""
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(moved)

    async def flush(self) -> None:
        """Until every patch handed over is served whole (or abandoned)."""
        if self._serving is not None:
            await asyncio.shield(self._serving)

    def publish_part(self, msg: Message, base: int | None, version: int, stats: SyncStats) -> None:
        """One part of the patch from ``base`` to ``version`` stamped, counted and served."""
        frames = self.server.stamp(msg)
        stats.messages += 1
        stats.wire_bytes += sum(len(f) for f in frames)
        self.server.publish_patch(base, version, frames, last=msg.last)

    async def _resync_all(self, builder: VersionBuilder, tensors: dict[str, torch.Tensor], version: int, after: Mark) -> SyncStats:
        """``version`` as a new snapshot and no patch: every receiver, none of which is at
        it, is resynced to it by bootstrap (the ring is dropped)."""
        started = time.perf_counter()
        await self.flush()  # the versions before it reach the ring first
        await builder.recapture(tensors, after)
        self.server.forget()
        log.warning("sender %s: a failed sync left the snapshot ahead of the receivers; v%s resyncs them all",
                    self.server.session[:8], version)
        stats = SyncStats(version, self.strategy)
        stats.build_seconds = time.perf_counter() - started
        return stats

    async def _serve_parts(
        self, previous: asyncio.Task[None] | None, parts: AsyncGenerator[Message, None], version: int, base: int | None,
        stats: SyncStats, moved: asyncio.Future[bool],
    ) -> None:
        """Serve a version's patch as it is built, after the versions before it, part by
        part: receivers get each part as soon as it is encoded, the last once the server is
        at ``version`` (``moved``). A read that fails abandons the parts already out (its
        error reaches ``sync()``'s caller)."""
        if previous is not None:
            await previous
        try:
            async with contextlib.aclosing(parts):
                async for msg in parts:
                    if msg.last and not await moved:  # the sync failed or was cancelled after its read
                        raise BuildFailed(f"v{version} was not synced")
                    self.publish_part(msg, base, version, stats)
            self._synced(stats)
        except BuildFailed:
            self.server.abandon_patch(base, version)
