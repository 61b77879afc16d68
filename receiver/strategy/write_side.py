"""The model's write side as a receiver strategy holds it: a staged version written off the
event loop under ``write_guard`` and only then published, or, once any of it is written
and it fails, the model *torn*, the write side kept until a whole version is written over it."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import torch

from protocol.errors import MetadataMismatchError
from protocol.state import StateLike, state_tensors
from protocol.timing import DeviceSpan
from protocol.wire.metadata import ModelMetadata

from ..apply.commit import StagedUpdate, Target, commit
from ..stats import ApplyStats
from ..threads import in_thread
from .hooks import StrategyHooks
from .pending import PendingVersion

log = logging.getLogger(__name__)


class WriteSide:
    """``ReceiverBase``'s writes into the model and its torn state (its docstring says when
    a model is torn); ``ReceiverBase.__init__`` sets the attributes declared here."""

    version: int | None
    metadata: ModelMetadata | None
    aliases: dict[int, list[int]]
    last_stats: ApplyStats | None
    _hooks: StrategyHooks
    _torn: AbstractAsyncContextManager[Any] | None  # the write side, kept: a version failed midway

    @property
    def torn(self) -> bool:
        """A version failed midway while being written: the model holds no whole version."""
        return self._torn is not None

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """The model's write side: ``write_guard``, or the hold kept on it while the
        model is torn, which a clean exit ends (whatever runs inside rewrites or releases
        the whole model)."""
        if self._torn is None:
            async with self._hooks.write_guard():
                yield
            return
        yield
        await self.release_torn()

    async def release_torn(self) -> None:
        """Let readers in again over a torn model (``close`` does, with a warning): it
        still holds no whole version."""
        held, self._torn = self._torn, None
        if held is not None:
            await held.__aexit__(None, None, None)

    async def _take_write_side(
        self, pending: PendingVersion, before_write: Callable[[PendingVersion], Awaitable[None]] | None
    ) -> AbstractAsyncContextManager[Any]:
        if before_write is not None:
            await before_write(pending)
        if self._torn is not None:  # already held since the version that tore it
            return self._torn
        guard = self._hooks.write_guard()
        await guard.__aenter__()
        return guard

    async def _write_staged(self, targets: list[Target], pending: PendingVersion) -> None:
        started = time.perf_counter()
        await self._write(targets, pending.updates, pending.stats)
        pending.updates, pending.staged_bytes = [], 0  # one message's worth staged at a time
        pending.stats.apply_seconds += time.perf_counter() - started

    def _commit_timed(self, targets: list[Target], updates: list[StagedUpdate], stats: ApplyStats | None) -> None:
        """``commit``, its device time added to ``stats.apply_device_seconds`` (CUDA events
        on each target device; this waits for the writes to be done there)."""
        devices = {t.device for t in targets if t.device.type == "cuda"} or {torch.device("cpu")}
        with contextlib.ExitStack() as stack:
            spans = [stack.enter_context(DeviceSpan(d)) for d in devices]
            commit(targets, updates, self.aliases)
        if stats is not None:
            stats.apply_device_seconds += max(span.seconds() for span in spans)

    async def _write(self, targets: list[Target], updates: list[StagedUpdate], stats: ApplyStats | None = None) -> None:
        """Write ``updates`` off the event loop. A caller cancelled meanwhile waits for the
        thread (``in_thread``): the failure is recorded (``torn``) and the write side handed
        on only once nothing writes."""
        await in_thread(self._commit_timed, targets, updates, stats)

    def _publish_written(self, pending: PendingVersion) -> None:
        """The whole version is in the model: it is the version now, and each ``on_commit``
        hook (which may write too: an engine installs layers) is part of the write."""
        self.version = pending.version
        for hook in self._hooks.on_commit:
            hook(pending)

    async def _let_readers_in(self, held: AbstractAsyncContextManager[Any]) -> None:
        """A whole version was written under ``held``: the model is no longer torn."""
        self._torn = None
        await held.__aexit__(None, None, None)

    async def _failed_while_writing(self, held: AbstractAsyncContextManager[Any], wrote: bool, pending: PendingVersion) -> None:
        if not wrote and self._torn is None:  # nothing of it was written: as if it never came
            await held.__aexit__(*sys.exc_info())
            return
        if self._torn is None:
            log.error("v%s failed after parts of it were written: the model holds no whole version; "
                      "readers are kept out until one is written", pending.version)
        self._torn, self.version = held, None

    async def commit(self, model: StateLike, pending: PendingVersion) -> None:
        """Write a staged version into ``model`` (off the event loop, under
        ``write_guard``) and only then set ``version``; a write that fails or is
        cancelled midway leaves the model ``torn``. A version ``written`` on arrival is
        only recorded."""
        if pending.written:
            self.last_stats = pending.stats
            return
        targets = self.targets(model)
        held = await self._take_write_side(pending, None)
        try:
            started = time.perf_counter()
            await self._write(targets, pending.updates, pending.stats)
            pending.stats.apply_seconds = time.perf_counter() - started
            self._publish_written(pending)
        except BaseException:
            await self._failed_while_writing(held, True, pending)
            raise
        await self._let_readers_in(held)
        self.last_stats = pending.stats
        log.debug("applied %s", pending.stats)

    def targets(self, model: StateLike) -> list[Target]:
        """The model's tensors in metadata order; a model that changed shape is an error."""
        assert self.metadata is not None
        tensors = state_tensors(model)
        out: list[Target] = []
        for key, shape in zip(self.metadata.keys, self.metadata.shapes):
            t = tensors.get(key)
            if t is None or tuple(t.shape) != shape:
                raise MetadataMismatchError(f"key {key!r} is missing from the model or changed shape since init")
            out.append(t)
        return out
