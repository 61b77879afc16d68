"""``on_update`` hooks, run in a task of their own so that the session never waits for them.

A receiver tells its hooks of each version it published, in order, one version at a time;
meanwhile its session goes on reading the socket (the next versions' parts, heartbeats,
flips, the trainer's latest version) and committing. A hook is told that ``version`` was
committed, not that the model still holds it: by the time a slow hook runs, a newer version
may be in; a hook that reads the weights does so under ``Receiver.reading()`` and reads
``Receiver.version`` there.

Bounds: an async hook is cancelled once it has run ``timeout`` seconds (logged, counted); a
sync hook runs on the event loop, cannot be stopped, and is reported (logged, counted) when
it ran longer than that. A hook that raises is logged and counted; the next hook and the
next version go on. Versions waiting for the hooks are bounded (``backlog``): past it, the
oldest waiting is skipped (logged, counted), so a hook slower than the trainer falls behind
by at most ``backlog`` versions and never holds memory without bound.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ConfigError

log = logging.getLogger(__name__)

Hook = Callable[[int | None], Any]
HOOK_TIMEOUT = 60.0  # seconds a hook may run, by default
HOOK_BACKLOG = 64  # versions that may wait for the hooks, by default


@dataclass
class HookCounts:
    """What the hooks did, for the receiver's life (``Receiver.hook_counts``)."""

    calls: int = 0
    failures: int = 0  # raised
    timeouts: int = 0  # ran past their timeout (async: cancelled; sync: reported)
    skipped: int = 0  # versions dropped from a full backlog, never told to the hooks
    last_error: str | None = None
    by_hook: dict[str, int] = field(default_factory=dict)  # failures and timeouts, by the hook's name

    def as_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "failures": self.failures, "timeouts": self.timeouts, "skipped": self.skipped,
                "last_error": self.last_error, "by_hook": dict(self.by_hook)}


class UpdateHooks:
    """The hooks of one receiver and the task that calls them.

    ``add`` may be called at any time (a hook added while versions wait is told of them
    too). ``published`` is called by the session for each version, never waits, and starts
    the task on the first call; ``close`` cancels it (the hook running is cancelled, the
    versions still waiting are dropped) and is idempotent. ``idle()`` waits until every
    version published so far has been told to every hook. One task at a time: versions are
    told in the order they were published, each to every hook in the order added.
    """

    def __init__(self, identity: str, *, timeout: float = HOOK_TIMEOUT, backlog: int = HOOK_BACKLOG) -> None:
        if timeout <= 0 or backlog < 1:
            raise ConfigError("hook timeout must be > 0 and backlog >= 1")
        self.identity, self.timeout, self.backlog = identity, timeout, backlog
        self.hooks: list[tuple[Hook, float]] = []
        self.counts = HookCounts()
        self._waiting: collections.deque[int | None] = collections.deque()
        self._more = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._telling = False  # a version is being told to the hooks now
        self._closed = False

    def add(self, hook: Hook, timeout: float | None = None) -> None:
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"a hook's timeout must be > 0 seconds, got {timeout!r}")
        self.hooks.append((hook, self.timeout if timeout is None else timeout))

    def published(self, version: int | None) -> None:
        """``version`` was committed and published: tell the hooks, in their task."""
        if self._closed or not self.hooks:
            return
        if len(self._waiting) >= self.backlog:
            dropped = self._waiting.popleft()
            self.counts.skipped += 1
            log.warning("receiver %s: on_update hooks are %d versions behind; v%s skipped", self.identity, self.backlog, dropped,
                        extra={"receiver": self.identity, "version": dropped})
        self._waiting.append(version)
        self._idle.clear()
        self._more.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"weightsync-receiver-hooks-{self.identity}")
            self._task.add_done_callback(self._ended)

    @property
    def waiting(self) -> int:
        """Versions published and not yet told to every hook (the one being told included)."""
        return len(self._waiting) + self._telling

    async def idle(self, timeout: float | None = None) -> None:
        """Wait until every version published so far has been told to every hook."""
        await asyncio.wait_for(self._idle.wait(), timeout)

    async def close(self) -> None:
        self._closed = True
        self._waiting.clear()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._idle.set()

    async def _run(self) -> None:
        while True:
            await self._more.wait()
            self._more.clear()
            while self._waiting:
                version = self._waiting.popleft()
                self._telling = True
                try:
                    for hook, timeout in list(self.hooks):
                        await self._call(hook, timeout, version)
                finally:
                    self._telling = False
            if not self._waiting:
                self._idle.set()

    async def _call(self, hook: Hook, timeout: float, version: int | None) -> None:
        name = getattr(hook, "__qualname__", repr(hook))
        self.counts.calls += 1
        began = time.monotonic()
        try:
            result = hook(version)
            if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
                await asyncio.wait_for(result, max(0.0, timeout - (time.monotonic() - began)))
            elif time.monotonic() - began > timeout:  # sync: it ran on the loop, and could not be stopped
                self._failed(name, version, f"a sync hook ran {time.monotonic() - began:.3g}s, past its timeout of {timeout:.3g}s "
                             "(it blocked the event loop: make it async)", timed_out=True)
        except asyncio.TimeoutError:
            self._failed(name, version, f"cancelled after its timeout of {timeout:.3g}s", timed_out=True)
        except Exception as e:
            self._failed(name, version, f"{type(e).__name__}: {e}", exc=e)

    def _failed(self, name: str, version: int | None, why: str, *, timed_out: bool = False, exc: BaseException | None = None) -> None:
        if timed_out:
            self.counts.timeouts += 1
        else:
            self.counts.failures += 1
        self.counts.last_error = f"{name} at v{version}: {why}"
        self.counts.by_hook[name] = self.counts.by_hook.get(name, 0) + 1
        log.error("receiver %s: on_update hook %s at v%s: %s", self.identity, name, version, why, exc_info=exc,
                  extra={"receiver": self.identity, "version": version})

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The task never ends by itself (each hook's error is caught): one that does is a bug, said loudly."""
        if not task.cancelled() and task.exception() is not None:
            self.counts.last_error = f"the hooks' task failed: {task.exception()!r}"
            log.error("receiver %s: the on_update hooks' task failed: %r", self.identity, task.exception())
            self._task = None  # the next version starts it again
            self._idle.set()
