"""The patch strategy, actor side: send only what changed since the snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from protocol.codec.tensorcodec import EncodedTensor, assemble
from protocol.config import PatchConfig
from protocol.errors import WeightSyncError
from protocol.state import ModelState, StateLike, is_dtensor, state_tensors
from protocol.wire.framing import Encoding, Message, MessageType

from .backlog import Backlog
from .base import Send, SenderBase, send_all
from .changes import Changes, plan_groups
from .compare import KINDS, make_compare
from .encode import Encoder, make_encoder
from .plan import SyncPlan
from .snapshot import Snapshot
from .stats import SyncStats

BACKLOG_SHARE = 32  # patch.encode_backlog_bytes by default: this fraction of the snapshot...
BACKLOG_MIN = 4 << 20  # ...and at least this
ENCODE_THREADS_MAX = 4  # patch.encode_threads by default: half the cores, at most this many
def encode_threads(configured: int | None) -> int:
    """``patch.encode_threads``, or by default half this host's cores (the compare and the
    receivers' side of the host keep the rest), 1 to ``ENCODE_THREADS_MAX``."""
    if configured is not None:
        return configured
    return max(1, min(ENCODE_THREADS_MAX, (os.cpu_count() or 1) // 2))

def _requested(config: PatchConfig) -> str:
    """``patch.codec`` (auto, host or device) where the config has it, else auto."""
    kind = getattr(config, "codec", "auto")
    return kind if isinstance(kind, str) and kind in KINDS else "auto"


# States whose compare reads at most this run it on the event loop's thread (~3 ms of
# reading at 20 GB/s): below it a thread hand-off is a large share of the build.
INLINE_READ_BYTES = 64 << 20


@dataclass(frozen=True)
class Captured:
    """One tensor's (or group's) collected changes: the bytes the capture held (what parts
    are cut by), and either its encoding, under way since it was collected, or the changes
    themselves, to encode with their part."""

    nbytes: int
    encoded: Future[EncodedTensor] | None
    changes: Changes | None = None


class CompareFailed(Exception):
    """Raised by a ``CapturedStream`` whose compare failed or was cancelled: the version's
    parts already sent must be abandoned (the compare's own error reaches ``sync()``)."""


class CapturedStream:
    """A version's ``Captured`` in order, handed from the compare (on its thread, or the
    loop's) to the task that encodes and publishes it as parts while the compare goes on.
    Iterating ends once the compare is done, or raises ``CompareFailed`` if it was not."""

    _END = object()

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Captured) -> Captured:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        return item

    def close(self, failed: BaseException | None = None) -> None:
        """The compare is over (``failed``: it raised); safe from any thread, and after the loop closed."""
        end = self._END if failed is None else CompareFailed(repr(failed))
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is left reading
            self._loop.call_soon_threadsafe(self._queue.put_nowait, end)

    def __aiter__(self) -> CapturedStream:
        return self

    async def __anext__(self) -> Captured:
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, CompareFailed):
            raise item
        return item


class PatchBuilder:
    """Builds PATCH messages: the bitwise difference between the model (cast to the
    receivers' dtypes) and the snapshot of what the receivers hold.

    Comparison is on integer views, so NaNs and signed zeros behave, and only changes
    visible at the receiver's dtype travel (an fp32 master that moves less than a bf16
    ulp sends nothing). Frozen parameters are not tracked: they travel in bootstraps.
    """

    def __init__(self, plan: SyncPlan, config: PatchConfig, compare: str | None = None) -> None:
        self.plan = plan
        self.options = config.options()
        self.part_bytes = config.part_bytes
        self.snapshot = Snapshot(config.snapshot_device)
        self.transport = torch.device(config.transport_device)
        # the seed's COO positions are 2-D: its format keeps each tensor to itself
        grouped = 0 if self.options.positions in (Encoding.COO, Encoding.COO_DELTA) else config.group_numel
        # patch.codec auto: the device codec for tensors on CUDA. Its encoder codes a part at
        # once where the changes live, so the compare leaves them there (no staging).
        resolved = self.options.resolved(plan.on_cuda)
        self.encoder: Encoder = make_encoder(resolved, self.snapshot.stream)
        # host or device (``compare``, else ``patch.codec``: auto compares on the device where the tensors are on CUDA)
        kind = compare or _requested(config)
        self.compare = make_compare(kind, plan, self.options, self.snapshot, plan_groups(plan, grouped), stage=self._stages())
        self._diverged = False  # ``diverged``
        self._backlog: Backlog | None = None  # the last collect's, while its changes are encoded
        self._comparing: asyncio.Future[Any] | None = None  # a compare on its thread
        # Threads encode what a compare on a worker thread collects, each tensor as it comes,
        # while the compare goes on (docs/performance.md, *Encoding beside the compare*); the
        # kernels release the GIL, so several code tensors side by side. Each tensor's future
        # keeps its place: a part waits for its own tensors, in order, however they finish.
        self.encode_threads = encode_threads(config.encode_threads)
        self._encoder = ThreadPoolExecutor(self.encode_threads, thread_name_prefix="weightsync-encode")
        # (no shutdown needed: the executor's threads end once the builder, and so it, is collected)
        # what a compare reads: the state and the snapshot
        tensors = plan.state.tensors
        sizes = {k: plan.receiver_dtype(k).itemsize for k in plan.tracked}
        self._read_bytes = sum(tensors[k].numel() * (tensors[k].element_size() + size) for k, size in sizes.items())
        snapshot_bytes = sum(tensors[k].numel() * size for k, size in sizes.items())
        limit = config.encode_backlog_bytes
        self.backlog_limit = max(BACKLOG_MIN, snapshot_bytes // BACKLOG_SHARE) if limit is None else limit

    def _stages(self) -> bool:
        """Whether a compare copies changes on a CUDA device to pinned host memory: unless
        they are packed on the device (``transport_device: cuda``) or the device encoder
        codes them there."""
        return self.transport.type != "cuda" and self.encoder.on_host

    def capture(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the snapshot: what the receivers hold after the bootstrap."""
        self.compare.capture(tensors)
        # JIT now, while the first receiver's HELLO is answered (the server heartbeats it
        # meanwhile), rather than in the first sync (the device encoder has nothing to compile).
        self.encoder.warm_up()

    @property
    def backlog_bytes(self) -> int:
        """Collected bytes waiting for the encoder threads now (the last collect's)."""
        return 0 if self._backlog is None else self._backlog.pending

    @property
    def diverged(self) -> bool:
        """A collect began comparing and did not hand its changes over (it failed or was
        cancelled): the snapshot may hold changes no receiver was sent. Until ``recapture``,
        a patch from it would leave receivers silently behind on those elements."""
        return self._diverged

    async def recapture(self, tensors: dict[str, torch.Tensor]) -> None:
        """The snapshot anew from ``tensors`` (checked first), in place, once any compare a
        cancelled collect left running has ended: what receivers resynced to it will hold."""
        self.plan.check_tensors(tensors)
        await self._settle()
        await asyncio.to_thread(self.compare.recapture, tensors)
        self._diverged = False

    async def _settle(self) -> None:
        """Until the compare of a cancelled collect, still running on its thread, is done."""
        running, self._comparing = self._comparing, None
        if running is not None:
            await asyncio.wait([running])
            if not running.cancelled():
                running.exception()  # its collect is gone: what it raised is retrieved here
        await self.snapshot.wait_writeback()

    async def hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start holding the version in ``tensors`` (the first receiver's dtypes are known)."""
        await asyncio.to_thread(self.capture, tensors)

    def held(self) -> dict[str, torch.Tensor]:
        """The tracked tensors of the current version at rest (after ``settled``)."""
        return self.snapshot.tensors

    async def settled(self) -> None:
        """Until ``held`` is the current version: the snapshot's write-back is done."""
        await self.snapshot.wait_writeback()

    async def build(self, tensors: dict[str, torch.Tensor], version: int, base: int | None) -> tuple[Message, SyncStats]:
        """The PATCH from ``base`` to ``version``; advances the snapshot to ``version``."""
        changes, stats = await self.collect(tensors, version)
        return await self.encode(changes, version, base, stats), stats

    async def collect(
        self, tensors: dict[str, torch.Tensor], version: int, stream: CapturedStream | None = None, stats: SyncStats | None = None
    ) -> tuple[list[Captured], SyncStats]:
        """Compare the model with the snapshot, collect the changes and advance the
        snapshot to ``version``: the only part that reads the model. Off the event loop's
        thread, each tensor's changes go to the encoder threads as soon as they are collected,
        so encoding runs beside the compare and a tensor's raw changes live only until they
        are coded; a state compared on the loop's thread is encoded with its parts.
        ``stream`` gets each ``Captured`` as it is collected, and is closed at the end
        (with the failure, if the compare fails)."""
        stats = SyncStats(version, "patch") if stats is None else stats
        started = time.perf_counter()
        try:
            self.plan.check_tensors(tensors)
            await self._settle()
            if self._diverged:
                raise WeightSyncError("the snapshot diverged from the receivers in a failed collect: recapture() first")
        except BaseException as e:
            if stream is not None:
                stream.close(e)
            raise
        self._diverged = True  # until the changes are handed over
        if not self.encoder.streams or self._inline(tensors):
            # Encoded with their part, after the compare: the device encoder codes a part at
            # once; beside a compare on the event loop's thread, an encoder thread's Python
            # would hold the GIL the loop needs.
            def later(changes: Changes) -> Captured:
                return Captured(changes.captured_nbytes(), None, changes)

            captured = await self._compared(tensors, stats, later, stream)
        else:
            # Each tensor's changes go to the encoder threads; once they are on the stream, the
            # compare waits while too many bytes wait to be encoded ahead of them (``Backlog``).
            backlog = self._backlog = Backlog(self.backlog_limit)

            def submit(changes: Changes) -> Captured:
                encoded = backlog.add(changes.pending_nbytes(), self._encoder.submit(self._encode, changes))
                return Captured(changes.captured_nbytes(), encoded)

            def pace() -> None:
                stats.backlog_wait_seconds += backlog.wait()

            captured = await self._compared(tensors, stats, submit, stream, pace)
        self._diverged = False
        stats.build_seconds = time.perf_counter() - started
        return captured, stats

    async def _compared(
        self,
        tensors: dict[str, torch.Tensor],
        stats: SyncStats,
        emit: Callable[[Changes], Captured],
        stream: CapturedStream | None,
        pace: Callable[[], None] | None = None,
    ) -> list[Captured]:
        """``_streamed`` on the caller's thread for a small CPU state (``_inline``), else on
        a worker thread, shielded: a cancelled collect cannot stop its thread, which goes on
        moving the snapshot; the next collect waits for it (``_settle``) and finds it diverged."""
        if self._inline(tensors):
            return self._streamed(tensors, stats, emit, stream, pace)
        self._comparing = asyncio.ensure_future(asyncio.to_thread(self._streamed, tensors, stats, emit, stream, pace))
        try:
            captured = await asyncio.shield(self._comparing)
        except BaseException as e:  # cancelled: what the thread still streams comes after this end
            if stream is not None:
                stream.close(e)
            raise
        self._comparing = None
        return captured

    def _streamed(
        self,
        tensors: dict[str, torch.Tensor],
        stats: SyncStats,
        emit: Callable[[Changes], Captured],
        stream: CapturedStream | None,
        pace: Callable[[], None] | None = None,
    ) -> list[Captured]:
        """``_collect``, each item also put on ``stream``, which is closed however it ends,
        and ``pace`` called after each."""

        def handed(changes: Changes) -> Captured:
            item = emit(changes)
            if stream is not None:
                stream.put(item)
            if pace is not None:
                pace()
            return item

        try:
            captured = self.compare.collect(tensors, stats, handed)
        except BaseException as e:
            if stream is not None:
                stream.close(e)
            raise
        if stream is not None:
            stream.close()
        return captured

    def _inline(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether to compare on the caller's thread: a small state of plain CPU tensors,
        where the hand-off to a worker thread (~0.3 ms idle, a few ms on a busy host, the
        GIL changing hands at every kernel) costs more than blocking the loop that long.
        DTensors (whose gathers may need the loop) and CUDA tensors always go to a thread."""
        if self._read_bytes > INLINE_READ_BYTES or self.snapshot.device.type != "cpu" or self.transport.type != "cpu":
            return False
        return all((t := tensors.get(key)) is not None and t.device.type == "cpu" and not is_dtensor(t) for key in self.plan.tracked)

    async def encode(self, captured: list[Captured], version: int, base: int | None, stats: SyncStats) -> Message:
        """The collected version as one message, once its tensors are encoded."""
        return await self._encode_part(captured, version, base, stats, 0, True)

    async def encode_parts(self, captured: list[Captured], version: int, base: int | None, stats: SyncStats) -> AsyncIterator[Message]:
        """The same as parts of about ``part_bytes`` of changes each, yielded as each is
        encoded: a receiver decodes one part while the next is encoded."""
        groups = self.parts(captured)
        for i, group in enumerate(groups):
            yield await self._encode_part(group, version, base, stats, i, i + 1 == len(groups))

    async def encode_stream(self, stream: CapturedStream, version: int, base: int | None, stats: SyncStats) -> AsyncIterator[Message]:
        """``encode_parts`` of a collect still under way (the daemon's way): each part is
        yielded once its tensors are encoded and the next one is collected, so the first
        parts travel while the rest of the model is compared. The parts are those of
        ``parts``; ``CompareFailed`` if the compare does not finish."""
        group: list[Captured] = []
        size = part = 0
        async for c in stream:
            if group and self.part_bytes and size >= self.part_bytes:
                yield await self._encode_part(group, version, base, stats, part, False)
                group, size, part = [], 0, part + 1
            group.append(c)
            size += c.nbytes
        yield await self._encode_part(group, version, base, stats, part, True)

    def parts(self, captured: list[Captured]) -> list[list[Captured]]:
        """Consecutive groups of ``captured`` of at least ``part_bytes`` each (by the bytes
        captured: positions and values, or the whole tensor); one group for 0, or for
        fewer changes than that."""
        groups: list[list[Captured]] = [[]]
        size = 0
        for c in captured:
            if self.part_bytes and size >= self.part_bytes:
                groups.append([])
                size = 0
            groups[-1].append(c)
            size += c.nbytes
        return groups

    async def _encode_part(
        self, captured: list[Captured], version: int, base: int | None, stats: SyncStats, part: int, last: bool
    ) -> Message:
        started = time.perf_counter()  # encoding the collect did not hide: waits for the encoder, and framing
        later = [c.changes for c in captured if c.changes is not None]
        coded = iter(await asyncio.to_thread(self.encoder.encode, later, stats) if later else [])
        encoded = [await asyncio.wrap_future(c.encoded) if c.encoded is not None else next(coded) for c in captured]
        stats.tensors_dense += sum(len(e.group) or 1 for e in encoded if e.encoding is Encoding.DENSE)
        specs, frames = assemble(encoded)
        stats.encode_seconds += time.perf_counter() - started
        return Message(MessageType.PATCH, version=version, base_version=base, tensors=specs, frames=frames, part=part, last=last)

    def _encode(self, changes: Changes) -> EncodedTensor:
        """One tensor's entry, on an encoder thread (a streaming encoder's)."""
        return self.encoder.encode_one(changes)


class PatchSender(SenderBase):
    """The patch strategy over injected ``send``/``recv``: one receiver, the PATCH parts of each version."""

    strategy = "patch"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.config.patch.options()  # fail fast on a bad encoding or compressor
        self.builder: PatchBuilder | None = None

    async def on_init(self, state: ModelState) -> None:
        assert self.plan is not None
        self.builder = PatchBuilder(self.plan, self.config.patch)
        await asyncio.to_thread(self.builder.capture, state.tensors)

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
        tensors = state_tensors(model)
        if self.builder.diverged:  # a failed sync moved the snapshot on: resync the receiver instead
            return await self._resync(plan, tensors, send, version)
        changes, stats = await self.builder.collect(tensors, version)
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

    async def _resync(self, plan: SyncPlan, tensors: dict[str, torch.Tensor], send: Send, version: int) -> SyncStats:
        """``version`` as a bootstrap of every tracked tensor from a new snapshot: the
        receiver takes a BOOTSTRAP in place of a patch."""
        assert self.builder is not None
        started = time.perf_counter()
        await self.builder.recapture(tensors)
        self.version = version
        held = self.builder.held()
        parts, messages = plan.bootstrap(version, held.__getitem__, list(plan.tracked))
        stats = SyncStats(version, self.strategy, messages=parts)
        stats.wire_bytes = await send_all(send, self.stamp, messages)
        stats.build_seconds = time.perf_counter() - started
        return stats
