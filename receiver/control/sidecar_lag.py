"""Bounded staleness across a shared-memory region: ``AttachedModel.reading(max_lag=k)``.

An engine attached to a receiver sidecar's region (``attach.py``) cannot ask the trainer,
or the sidecar's upstream, what the latest version is. So the sidecar tells it: its
``LatestPublisher`` task writes into the region's header (``Region.publish_latest``) the
trainer's latest version as its ``Receiver`` hears it (``latest_version``: heartbeats, the
versions it receives, its questions' answers), as of when that was known current, and the
``max_age`` past which that knowledge is not current (two heartbeat intervals). The engine's
``bounded_reading`` then applies the in-process rule (``Receiver.reading(max_lag=...)``):
it yields the version held only when it is at most ``k`` behind the latest, and that
latest is current; otherwise it waits, outside the read hold so that the sidecar's commits
go on, up to ``timeout`` (``WeightSyncTimeout``, saying which of the two it waited for).

Knowledge that is not current is never vouched for: the engine waits for the sidecar to
refresh it. The sidecar does: its heartbeats refresh it every interval while they come at
their pace, and when they do not (after the sidecar was stopped, its event loop blocked,
or its upstream went quiet) the publisher asks the upstream itself, as an in-process
reader would, one question at a time, backing off to ``peer_timeout`` between questions
while the knowledge stays old. A sidecar stopped (SIGSTOP), killed, or cut off from its
upstream publishes nothing new: its knowledge ages past ``max_age`` and every bounded read
times out, while ``reading()`` without ``max_lag`` yields the weights held, as ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from protocol.errors import ConfigError, SharedMemoryError, WeightSyncError, WeightSyncTimeout
from protocol.host.shm import Heard, Region

from ..stats import LagWaits

if TYPE_CHECKING:
    from .service import Receiver

POLL = (0.001, 0.02)  # an engine waiting re-reads the header this often, backing off from the first to the second


def check_bound(max_lag: int, max_age: float | None) -> None:
    """``ConfigError`` for a bound that is not one."""
    if type(max_lag) is not int or max_lag < 0:
        raise ConfigError(f"max_lag must be an int >= 0 (versions), got {max_lag!r}")
    if max_age is not None and (type(max_age) not in (int, float) or not max_age > 0 or not math.isfinite(max_age)):
        raise ConfigError(f"max_age must be a number of seconds > 0, got {max_age!r}")


@contextlib.contextmanager
def bounded_reading(region: Region, max_lag: int, timeout: float | None, max_age: float | None, waits: LagWaits) -> Iterator[int | None]:
    """Hold ``region``'s weights still once they are at most ``max_lag`` versions behind the
    latest its owner published, that latest current (heard at most ``max_age`` seconds
    ago; None: the owner's own ``max_age``); yields the version held. Waits outside the
    hold, re-reading the header, for at most ``timeout`` seconds (None: as long as it takes).
    ``SharedMemoryError`` if the owner publishes no latest; ``WeightSyncError`` if it
    stopped (the region closed) before the bound was met."""
    clock = time.monotonic
    began_at = clock()
    deadline = None if timeout is None else began_at + timeout
    began: tuple[int | None, int | None] | None = None  # when a wait began: the version held, the latest
    pause = POLL[0]
    while True:
        heard = _published(region)
        if _within(region.version, heard, max_lag, max_age):
            left = None if deadline is None else max(0.0, deadline - clock())
            with region.reading(left) as held:
                heard = _published(region)
                if _within(held, heard, max_lag, max_age):
                    if began is not None:
                        waits.waited(*began, clock() - began_at)
                    yield held
                    return
        if began is None:
            began = region.version, heard.version
        if region.closed:
            raise WeightSyncError(_why(region, heard, max_lag, max_age, "and never will be: its sidecar stopped (attach again to follow a new one)"))
        now = clock()
        if deadline is not None and now >= deadline:
            waits.waited(*began, now - began_at, timed_out=True)
            raise WeightSyncTimeout(_why(region, heard, max_lag, max_age, f"after {timeout:.3g}s"))
        time.sleep(pause if deadline is None else min(pause, deadline - now))
        pause = min(2 * pause, POLL[1])


def _published(region: Region) -> Heard:
    heard = region.latest()
    if heard is None:
        raise SharedMemoryError(
            f"region {region.name!r}: its owner (pid {region.owner_pid}) publishes no trainer's latest version, so "
            "reading(max_lag=...) has nothing to bound by: a receiver sidecar of an older weightsync, or one that follows "
            "no trainer (--load-strategy ipc_snapshot); read without max_lag, or restart the sidecar with this weightsync"
        )
    return heard


def _within(held: int | None, heard: Heard, max_lag: int, max_age: float | None) -> bool:
    """The in-process rule (``Receiver.reading``): a version held, the latest current, at most ``max_lag`` behind it."""
    current = heard.age() <= (heard.max_age if max_age is None else max_age)
    return held is not None and current and (heard.version is None or held >= heard.version - max_lag)


def _why(region: Region, heard: Heard, max_lag: int, max_age: float | None, when: str) -> str:
    bound = heard.max_age if max_age is None else max_age
    held, age = region.version, heard.age()
    head = f"region {region.name!r} holds v{held}, not within max_lag={max_lag} of the trainer's latest {when}: "
    if not math.isfinite(age):
        why = f"its sidecar (pid {heard.publisher}) has not heard the trainer's latest version as current yet (is it connected?)"
    elif age > bound:
        why = (f"its sidecar's (pid {heard.publisher}) knowledge of the trainer's latest (v{heard.version}) is {age:.3g}s old, "
               f"older than max_age={bound:.3g}s: the sidecar is stopped, stalled or cut off from its upstream")
        if region.owner_pid != heard.publisher:
            why += f"; pid {region.owner_pid} has taken the region over and publishes no latest (an older weightsync?)"
    else:
        why = f"v{held} is more than {max_lag} versions behind v{heard.version} (its sidecar heard it {age:.3g}s ago)"
    return head + why


class LatestPublisher:
    """The receiver sidecar's task: the trainer's latest version, as ``receiver`` hears it,
    published into ``region`` (see the module doc) at once when it changes and at least
    every quarter heartbeat interval (the age of what was heard changes with each heartbeat).
    Its owner (the daemon) runs ``run()`` and surfaces its failure; cancelling it also
    cancels its question in flight. One per region: a region has one publisher."""

    def __init__(self, region: Region, receiver: Receiver, max_age: float) -> None:
        self.region, self.receiver, self.max_age = region, receiver, max_age
        self.asks = 0  # questions asked because the knowledge was older than max_age
        self._asking: asyncio.Task[None] | None = None

    def publish(self) -> int | None:
        """Publish what the receiver heard now; returns the version published."""
        r = self.receiver
        version = r.latest_version
        self.region.publish_latest(version, time.monotonic() - r.latest_age, self.max_age)
        return version

    async def run(self) -> None:
        r = self.receiver
        period = r.heartbeat_interval / 4
        delay, next_ask = self.max_age, 0.0  # between questions while the knowledge stays old: doubling up to peer_timeout
        try:
            while True:
                published = self.publish()
                if self._asking is not None and self._asking.done():
                    self._asking.result()  # a question failing is no error (refresh_latest); anything else is
                    self._asking = None
                now = time.monotonic()
                if r.latest_age <= self.max_age:
                    delay, next_ask = self.max_age, 0.0
                elif self._asking is None and r.connected and now >= next_ask:
                    self.asks += 1
                    self._asking = asyncio.ensure_future(r.refresh_latest(r.peer_timeout))
                    next_ask, delay = now + delay, min(2 * delay, max(r.peer_timeout, self.max_age))
                await r.latest_news(published, period)
        finally:
            if self._asking is not None:
                self._asking.cancel()
