"""The patch strategy, actor side: send only what changed since the snapshot.

``PatchBuilder`` (a ``VersionBuilder``) composes the pieces, each in its own module: the
snapshot's lifecycle and where the compare runs (``collector.py``), the compare, host or
device (``compare.py``), the encoder and its threads (``encode.py``, ``part_encoder.py``),
and part cutting (``parts.py``). ``PatchSender`` is the transport-free strategy.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import torch

from protocol.config import PatchConfig
from protocol.state import StateLike, state_tensors
from protocol.wire.framing import Encoding, Message

from ..base import Send, SenderBase, send_all
from ..diff.changes import plan_groups
from ..diff.compare import KINDS, make_compare
from ..diff.snapshot import Snapshot
from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import Mark
from .builder import Build, VersionBuilder
from .captured import Captured, CapturedStream
from .collector import Collector
from .encode import Encoder, make_encoder
from .part_encoder import PartEncoder, encode_threads
from .parts import cut, cut_stream

__all__ = ["Captured", "CapturedStream", "PatchBuilder", "PatchSender", "encode_threads"]


def _requested(config: PatchConfig) -> str:
    """``patch.codec`` (auto, host or device) where the config has it, else auto."""
    kind = getattr(config, "codec", "auto")
    return kind if isinstance(kind, str) and kind in KINDS else "auto"


class PatchBuilder(VersionBuilder):
    """Builds PATCH messages: the bitwise difference between the model (cast to the
    receivers' dtypes) and the snapshot of what the receivers hold.

    Comparison is on integer views, so NaNs and signed zeros behave, and only changes
    visible at the receiver's dtype travel (an fp32 master that moves less than a bf16
    ulp sends nothing). Frozen parameters are not tracked: they travel in bootstraps.
    """

    streams = True

    def __init__(self, plan: SyncPlan, config: PatchConfig, compare: str | None = None) -> None:
        self.plan = plan
        self.options = config.options()
        self.part_bytes = config.part_bytes
        self.snapshot = Snapshot(config.snapshot_device)
        transport = torch.device(config.transport_device)
        # RLinf's COO positions are 2-D: its format keeps each tensor to itself
        grouped = 0 if self.options.positions in (Encoding.COO, Encoding.COO_DELTA) else config.group_numel
        # patch.codec auto: the device codec for tensors on CUDA. Its encoder codes a part at
        # once where the changes live, so the compare leaves them there (no staging).
        self.encoder: Encoder = make_encoder(self.options.resolved(plan.on_cuda), self.snapshot.stream)
        self.encoding = PartEncoder(self.encoder, encode_threads(config.encode_threads))
        # A compare on CUDA copies its changes to pinned host memory unless they are packed on
        # the device (``transport_device: cuda``) or the device encoder codes them there.
        self.stages = transport.type != "cuda" and self.encoder.on_host
        # host or device (``compare``, else ``patch.codec``: auto compares on the device where the tensors are on CUDA)
        kind = compare or _requested(config)
        self.compare = make_compare(kind, plan, self.options, self.snapshot, plan_groups(plan, grouped), stage=self.stages)
        self.collector = Collector(plan, self.compare, self.encoding, transport, config.encode_backlog_bytes)

    @property
    def encode_threads(self) -> int:
        return self.encoding.threads

    # -- the snapshot -------------------------------------------------------------------
    def capture(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """Take the snapshot: what the receivers hold after the bootstrap (read once this
        thread's streams wait for ``after``, where ``tensors`` were made on another's)."""
        if after is not None:
            after.wait()
        self.collector.capture(tensors)
        # JIT now, while the first receiver's HELLO is answered (the server heartbeats it
        # meanwhile), rather than in the first sync (the device encoder has nothing to compile).
        self.encoder.warm_up(self.plan.metadata.dtypes)

    async def hold(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """Start holding the version in ``tensors`` (the first receiver's dtypes are known),
        read after ``after`` (default: the caller's current streams now)."""
        await asyncio.to_thread(self.capture, tensors, Mark.now(tensors.values()) if after is None else after)

    def held(self) -> dict[str, torch.Tensor]:
        """The tracked tensors of the current version at rest (after ``settled``)."""
        return self.snapshot.tensors

    async def settled(self) -> None:
        """Until ``held`` is the current version: the snapshot's write-back is done."""
        await self.snapshot.wait_writeback()

    @property
    def diverged(self) -> bool:
        return self.collector.diverged

    async def recapture(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        await self.collector.recapture(tensors, after)

    @property
    def backlog_bytes(self) -> int:
        return self.collector.backlog_bytes

    async def close(self) -> None:
        """Once a compare under way has ended, stop the compare thread and the encoder threads."""
        await self.collector.close()
        await self.encoding.close()

    # -- versions -----------------------------------------------------------------------
    def build(
        self, tensors: dict[str, torch.Tensor], version: int, base: int | None, stats: SyncStats, after: Mark | None = None
    ) -> Build:
        """The patch from ``base`` to ``version``, streamed: each part is yielded once its
        tensors are encoded and the next one is collected, so the first parts travel while
        the rest of the model is compared. The snapshot moves to ``version`` in ``read``
        (which reads the model after ``after``, default the caller's current streams now);
        the parts raise ``BuildFailed`` if that compare does not finish."""
        stream = CapturedStream()
        after = Mark.now(tensors.values()) if after is None else after

        async def read() -> None:
            await self.collector.collect(tensors, version, stream, stats, after)

        async def parts() -> AsyncGenerator[Message, None]:
            part = 0
            async with contextlib.aclosing(cut_stream(stream, self.part_bytes)) as groups:
                async for group, last in groups:
                    yield await self.encoding.part(group, version, base, stats, part, last)
                    part += 1

        return Build(read, parts())

    async def collect(
        self, tensors: dict[str, torch.Tensor], version: int, stream: CapturedStream | None = None, stats: SyncStats | None = None,
        after: Mark | None = None,
    ) -> tuple[list[Captured], SyncStats]:
        """The compare of ``version`` whole (``Collector.collect``): its changes, encoding or to encode."""
        return await self.collector.collect(tensors, version, stream, stats, after)

    async def message(self, tensors: dict[str, torch.Tensor], version: int, base: int | None) -> tuple[Message, SyncStats]:
        """The PATCH from ``base`` to ``version`` as one message; advances the snapshot to ``version``."""
        captured, stats = await self.collect(tensors, version)
        return await self.encode(captured, version, base, stats), stats

    async def encode(self, captured: list[Captured], version: int, base: int | None, stats: SyncStats) -> Message:
        """The collected version as one message, once its tensors are encoded."""
        return await self.encoding.part(captured, version, base, stats, 0, True)

    async def encode_parts(self, captured: list[Captured], version: int, base: int | None, stats: SyncStats) -> AsyncIterator[Message]:
        """The same as parts of about ``part_bytes`` of changes each, yielded as each is
        encoded: a receiver decodes one part while the next is encoded."""
        groups = self.parts(captured)
        for i, group in enumerate(groups):
            yield await self.encoding.part(group, version, base, stats, i, i + 1 == len(groups))

    def parts(self, captured: list[Captured]) -> list[list[Captured]]:
        """``captured`` cut into parts of about ``part_bytes`` (``parts.cut``)."""
        return cut(captured, self.part_bytes)


class PatchSender(SenderBase):
    """The patch strategy over injected ``send``/``recv``: one receiver, the PATCH parts of each version."""

    strategy = "patch"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.config.patch.options()  # fail fast on a bad encoding or compressor
        self.builder: PatchBuilder | None = None

    async def on_init(self, tensors: dict[str, torch.Tensor]) -> None:
        assert self.plan is not None
        self.builder = PatchBuilder(self.plan, self.config.patch)
        await self.builder.hold(tensors)

    async def close(self) -> None:
        """Stop the builder's threads (once a compare under way has ended)."""
        if self.builder is not None:
            await self.builder.close()

    async def _sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        """Build the patch from the snapshot to ``model`` and send it, in parts of
        ``patch.part_bytes`` (each sent as soon as it is encoded).

        The snapshot and ``self.version`` advance once the changes are collected, before
        anything is sent: if ``send`` fails, the receiver misses ``version`` and rejects
        the next patch as stale, which asks for a resync rather than silently diverging.
        A model missing a tracked key or with one reshaped is refused before anything is
        read. If the compare itself fails (or is cancelled) midway, the snapshot is ahead
        of the receiver on what it compared: the next sync sends its version as a
        bootstrap instead (``PatchBuilder.diverged``).
        """
        plan = self.require_plan(version)
        assert self.builder is not None
        started = time.perf_counter()
        tensors, after = await plan.rolled(state_tensors(model))
        quantize_s = time.perf_counter() - started if plan.view is not None else 0.0
        if self.builder.diverged:  # a failed sync moved the snapshot on: resync the receiver instead
            return await self._resync(plan, tensors, send, version, after)
        changes, stats = await self.builder.collect(tensors, version, after=after)
        stats.quantize_seconds = quantize_s
        base, self.version = self.version, version
        async for msg in self.builder.encode_parts(changes, version, base, stats):
            started = time.perf_counter()
            wire = self.stamp(msg)
            stats.build_seconds += time.perf_counter() - started
            stats.messages += 1
            stats.wire_bytes += sum(len(f) for f in wire)
            started = time.perf_counter()
            await send(wire)
            stats.send_seconds += time.perf_counter() - started
        return stats

    async def _resync(self, plan: SyncPlan, tensors: dict[str, torch.Tensor], send: Send, version: int, after: Mark) -> SyncStats:
        """``version`` as a bootstrap of every tracked tensor from a new snapshot: the
        receiver takes a BOOTSTRAP in place of a patch."""
        assert self.builder is not None
        started = time.perf_counter()
        await self.builder.recapture(tensors, after)
        self.version = version
        held = self.builder.held()
        parts, messages = plan.bootstrap(version, held.__getitem__, list(plan.tracked))
        stats = SyncStats(version, self.strategy, messages=parts)
        stats.wire_bytes = await send_all(send, self.stamp, messages)
        stats.build_seconds = time.perf_counter() - started
        return stats
