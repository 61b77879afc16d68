"""A patch's compare, run: the snapshot's lifecycle and where each version's compare runs.

The compare itself (host or device) is behind ``sender/diff/compare.py``; this runs it. A small
state of plain CPU tensors is compared on the event loop's thread (``inline``), any other
on the collector's own compare thread, each tensor's changes handed to the encoder threads
as soon as they are collected (``PartEncoder.submit``), paced by a ``Backlog``, and put on
the version's ``CapturedStream``. The compare is the only thing that moves the snapshot:
one that fails or is cancelled midway leaves it ``diverged`` until ``recapture``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from protocol.errors import WeightSyncError
from protocol.state import is_dtensor

from ..diff.changes import Changes
from ..diff.compare import Compare
from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import Mark
from .backlog import Backlog
from .captured import Captured, CapturedStream
from .part_encoder import PartEncoder

T = TypeVar("T")
BACKLOG_SHARE = 32  # patch.encode_backlog_bytes by default: this fraction of the snapshot...
BACKLOG_MIN = 4 << 20  # ...and at least this
# States whose compare reads at most this run it on the event loop's thread (~3 ms of
# reading at 20 GB/s): below it a thread hand-off is a large share of the build.
INLINE_READ_BYTES = 64 << 20


class Collector:
    """Runs ``compare`` of ``plan``'s tracked tensors, its changes encoded by ``encoding``.
    ``transport``: where parts are packed (a CUDA one keeps the changes on the device);
    ``backlog_limit``: ``patch.encode_backlog_bytes`` (None: by the snapshot's size)."""

    def __init__(self, plan: SyncPlan, compare: Compare, encoding: PartEncoder, transport: torch.device, backlog_limit: int | None) -> None:
        self.plan, self.compare, self.encoding, self.transport = plan, compare, encoding, transport
        self.snapshot = compare.snapshot
        self._diverged = False  # ``diverged``
        self._backlog: Backlog | None = None  # the last collect's, while its changes are encoded
        self._comparing: asyncio.Future[Any] | None = None  # a compare on the compare thread
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="weightsync-compare")  # started as first needed
        self._closed = False
        # what a compare reads: the state and the snapshot
        tensors = plan.state.tensors
        sizes = {k: plan.receiver_dtype(k).itemsize for k in plan.tracked}
        self.read_bytes = sum(tensors[k].numel() * (tensors[k].element_size() + size) for k, size in sizes.items())
        snapshot_bytes = sum(tensors[k].numel() * size for k, size in sizes.items())
        self.backlog_limit = max(BACKLOG_MIN, snapshot_bytes // BACKLOG_SHARE) if backlog_limit is None else backlog_limit

    # -- the snapshot's lifecycle ------------------------------------------------------
    def capture(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the snapshot: what the receivers hold after the bootstrap."""
        self.compare.capture(tensors)

    @property
    def diverged(self) -> bool:
        """A collect began comparing and did not hand its changes over (it failed or was
        cancelled): the snapshot may hold changes no receiver was sent. Until ``recapture``,
        a patch from it would leave receivers silently behind on those elements."""
        return self._diverged

    async def recapture(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """The snapshot anew from ``tensors`` (checked first), in place, once any compare a
        cancelled collect left running has ended: what receivers resynced to it will hold.
        Read after ``after`` (default: the caller's current streams now), as ``collect``."""
        after = self._mark(tensors) if after is None else after
        self.plan.check_tensors(tensors)
        await self.settle()
        await asyncio.to_thread(self._recaptured, tensors, after)
        self._diverged = False

    def _recaptured(self, tensors: dict[str, torch.Tensor], after: Mark) -> None:
        after.wait()
        self.compare.recapture(tensors)

    async def settle(self) -> None:
        """Until the compare of a cancelled collect, still running on its thread, is done,
        and the snapshot's write-back with it."""
        running, self._comparing = self._comparing, None
        if running is not None:
            await asyncio.wait([running])
            if not running.cancelled():
                running.exception()  # its collect is gone: what it raised is retrieved here
        await self.snapshot.wait_writeback()

    @property
    def backlog_bytes(self) -> int:
        """Collected bytes waiting for the encoder threads now (the last collect's)."""
        return 0 if self._backlog is None else self._backlog.pending

    async def close(self) -> None:
        """Once a compare under way has ended, stop the compare thread. Idempotent; a
        collect after it raises."""
        self._closed = True
        await self.settle()
        self._thread.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._thread.shutdown, True)

    # -- a version's compare -------------------------------------------------------------
    async def collect(
        self, tensors: dict[str, torch.Tensor], version: int, stream: CapturedStream | None = None, stats: SyncStats | None = None,
        after: Mark | None = None,
    ) -> tuple[list[Captured], SyncStats]:
        """Compare the model with the snapshot, collect the changes and advance the
        snapshot to ``version``: the only part that reads the model. Off the event loop's
        thread, each tensor's changes go to the encoder threads as soon as they are collected,
        so encoding runs beside the compare and a tensor's raw changes live only until they
        are coded; a state compared on the loop's thread is encoded with its parts.
        ``stream`` gets each ``Captured`` as it is collected, and is closed at the end
        (with the failure, if the compare fails). The compare reads the model once the
        work marked by ``after`` is done, on whichever thread it runs (default: what the
        caller's current streams hold now, as ``Sender.sync`` marks them when called)."""
        after = self._mark(tensors) if after is None else after
        stats = SyncStats(version, "patch") if stats is None else stats
        started = time.perf_counter()
        try:
            if self._closed:
                raise WeightSyncError("the patch builder is closed")
            self.plan.check_tensors(tensors)
            await self.settle()
            if self._diverged:
                raise WeightSyncError("the snapshot diverged from the receivers in a failed collect: recapture() first")
        except BaseException as e:
            if stream is not None:
                stream.close(e)
            raise
        self._diverged = True  # until the changes are handed over
        if not self.encoding.encoder.streams or self._inline(tensors):
            # Encoded with their part, after the compare: the device encoder codes a part at
            # once; beside a compare on the event loop's thread, an encoder thread's Python
            # would hold the GIL the loop needs.
            def later(changes: Changes) -> Captured:
                return Captured(changes.captured_nbytes(), None, changes)

            captured = await self._compared(tensors, stats, later, stream, after)
        else:
            # Each tensor's changes go to the encoder threads; once they are on the stream, the
            # compare waits while too many bytes wait to be encoded ahead of them (``Backlog``).
            backlog = self._backlog = Backlog(self.backlog_limit)

            def submit(changes: Changes) -> Captured:
                encoded = backlog.add(changes.pending_nbytes(), self.encoding.submit(changes))
                return Captured(changes.captured_nbytes(), encoded)

            def pace() -> None:
                stats.backlog_wait_seconds += backlog.wait()

            captured = await self._compared(tensors, stats, submit, stream, after, pace)
        self._diverged = False
        stats.build_seconds = time.perf_counter() - started
        return captured, stats

    async def _compared(
        self,
        tensors: dict[str, torch.Tensor],
        stats: SyncStats,
        emit: Callable[[Changes], Captured],
        stream: CapturedStream | None,
        after: Mark,
        pace: Callable[[], None] | None = None,
    ) -> list[Captured]:
        """``_streamed`` on the caller's thread for a small CPU state (``_inline``), else on
        the compare thread, shielded: a cancelled collect cannot stop its thread, which goes
        on moving the snapshot; the next collect waits for it (``settle``) and finds it diverged."""
        if self._inline(tensors):
            return self._streamed(tensors, stats, emit, stream, after, pace)
        self._comparing = self._on_thread(self._streamed, tensors, stats, emit, stream, after, pace)
        try:
            captured = await asyncio.shield(self._comparing)
        except BaseException as e:  # cancelled: what the thread still streams comes after this end
            if stream is not None:
                stream.close(e)
            raise
        self._comparing = None
        return captured

    def _on_thread(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """``fn(*args)`` on the compare thread, in this context (as ``asyncio.to_thread``)."""
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        return asyncio.get_running_loop().run_in_executor(self._thread, call)

    def _streamed(
        self,
        tensors: dict[str, torch.Tensor],
        stats: SyncStats,
        emit: Callable[[Changes], Captured],
        stream: CapturedStream | None,
        after: Mark,
        pace: Callable[[], None] | None = None,
    ) -> list[Captured]:
        """The compare, once this thread's streams wait for ``after``, each item also put on
        ``stream``, which is closed however it ends, and ``pace`` called after each."""

        def handed(changes: Changes) -> Captured:
            item = emit(changes)
            if stream is not None:
                stream.put(item)
            if pace is not None:
                pace()
            return item

        try:
            after.wait()  # before the first read of the model
            captured = self.compare.collect(tensors, stats, handed)
        except BaseException as e:
            if stream is not None:
                stream.close(e)
            raise
        if stream is not None:
            stream.close()
        return captured

    def _mark(self, tensors: dict[str, torch.Tensor]) -> Mark:
        """The caller's current streams now, on the devices of the tracked ``tensors``."""
        return Mark.now(tensors[k] for k in self.plan.tracked if k in tensors)

    def _inline(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether to compare on the caller's thread: a small state of plain CPU tensors,
        where the hand-off to a worker thread (~0.3 ms idle, a few ms on a busy host, the
        GIL changing hands at every kernel) costs more than blocking the loop that long.
        DTensors (whose gathers may need the loop) and CUDA tensors always go to a thread."""
        if self.read_bytes > INLINE_READ_BYTES or self.snapshot.device.type != "cpu" or self.transport.type != "cpu":
            return False
        return all((t := tensors.get(key)) is not None and t.device.type == "cpu" and not is_dtensor(t) for key in self.plan.tracked)
