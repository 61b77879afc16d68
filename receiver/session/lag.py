"""How far behind the trainer this receiver is: the latest version as heard, and when to ask.

The trainer's latest version reaches a receiver through the protocol itself: every
heartbeat of its upstream names the upstream's version and, from a relay, the trainer's
(``messages.Beat``); an answer to a DIGEST_REQUEST says the same; each version this
receiver receives is one too. ``Latest`` keeps the newest of these and how fresh that
knowledge is, for ``Receiver.reading(max_lag=...)``; ``LagWatch`` decides when a receiver
that heard of a version it never received (or received in part) asks for it (NACK
``BEHIND``) instead of waiting for the next version to expose the gap, and when, those
resends lost too, it asks for a resync instead (NACK ``LOST``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from protocol.wire.messages import BEHIND, LOST

RESENDS = 2  # asks for a resend (``BEHIND``) at one held version before a resync is asked for (``LOST``)
RESEND, RESYNC = "resend", "resync"  # how a version asked for came (``LagWatch.applied``): the receiver's metrics label


class Latest:
    """The newest version the trainer has published, as this receiver last heard, and when.

    Versions only grow within one upstream lineage; ``reset`` starts over (a new session:
    a restarted trainer may number from lower). Heard from a heartbeat, the knowledge is
    current only if that heartbeat came at the heartbeats' pace: heartbeats that queued up
    while this process was stopped or its event loop blocked arrive in a burst, and the
    newest of them may be older than the interval suggests, so a beat that comes sooner
    than half an interval after the one before, or later than two, refreshes the version
    but not its age (the reader that needs it current asks). An answer to a question is
    current as of when the question was asked.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.version: int | None = None
        self.current_at = -math.inf  # monotonic time as of which ``version`` is known to be the latest
        self._beat_at = -math.inf  # arrival of the last paced heartbeat
        self._listeners: list[Callable[[int], None]] = []

    def listen(self, news: Callable[[int], None]) -> None:
        """Call ``news(version)`` whenever a newer version is heard of (a relay tells its own receivers at once)."""
        self._listeners.append(news)

    def reset(self) -> None:
        self.version, self.current_at, self._beat_at = None, -math.inf, -math.inf

    def saw(self, version: int | None) -> bool:
        """A version exists (announced, its first part arrived, received, applied, or named
        by the upstream); True if it is news."""
        if version is None or (self.version is not None and version <= self.version):
            return False
        self.version = version
        for news in self._listeners:
            news(version)
        return True

    def beat(self, version: int | None, now: float | None = None, *, paced: bool = True) -> bool:
        """A heartbeat said ``version`` is the latest; True if it is news. One not ``paced``
        (sent at once because something moved: ``Beat.news``) says the version, not the pace."""
        now = time.monotonic() if now is None else now
        if paced:
            gap, self._beat_at = now - self._beat_at, now
            if self.interval / 2 <= gap <= 2 * self.interval:
                self.current_at = now
        return self.saw(version)

    def answered(self, version: int | None, asked_at: float) -> bool:
        """An answer to a question asked at ``asked_at`` said ``version`` is the latest."""
        self.current_at = max(self.current_at, asked_at)
        return self.saw(version)

    def age(self, now: float | None = None) -> float:
        """Seconds since ``version`` was last known to be the latest (inf: never)."""
        return (time.monotonic() if now is None else now) - self.current_at


class LagWatch:
    """When a receiver behind its upstream asks again for what follows its version, and how.

    Asked on every heartbeat tick. A receiver is behind when its upstream's version is
    newer than the one it holds while it receives, stages and applies nothing. A heartbeat
    can overtake the version it names, and a version on its way shows as data arriving, so
    it asks only once it has been behind, with no data arriving, for ``2 * interval``. It
    asks again, if still behind, after twice as long each time, up to ``cap`` seconds.

    The first ``resends`` asks at one held version ask for what follows it to be sent again
    (``BEHIND``: from the upstream's ring, or its bucket version); what a path that loses
    them loses again would be asked for forever, so the next ask at the same version is
    for a resync (``LOST``), whose bootstrap travels as other messages. ``applied`` closes
    an ask: the version that answered it came sent again (``RESEND``) or by a resync
    (``RESYNC``). Called from the event loop only (``Follower._tick``, ``Follower._record``).
    """

    def __init__(self, interval: float, cap: float, resends: int = RESENDS) -> None:
        self.interval, self.cap, self.resends = interval, max(cap, 2 * interval), resends
        self.asks = 0  # asks sent, for the receiver's life
        self._since: float | None = None  # when it was first seen behind (None: it is not)
        self._next: float | None = None  # when the next ask is due while behind
        self._delay = 2 * interval
        self._held: int | None = None  # the version held at the last ask
        self._tries = 0  # asks made while holding ``_held``
        self._open = False  # an ask no version applied since has answered

    def due(self, now: float, upstream: int | None, applied: int | None, *, busy: bool, quiet: float) -> str | None:
        """The reason to ask with now (``BEHIND`` or ``LOST``), or None: ``upstream`` is the
        upstream's version, ``applied`` this receiver's, ``busy`` a version in hand
        (received, staged or being applied), ``quiet`` seconds since data last arrived."""
        if upstream is None or applied is None or upstream <= applied or busy:
            self._since, self._next, self._delay = None, None, 2 * self.interval
            return None
        if self._since is None:
            self._since = now
        wait = 2 * self.interval
        if quiet < wait or now - self._since < wait or (self._next is not None and now < self._next):
            return None
        self._next = now + self._delay
        self._delay = min(2 * self._delay, self.cap)
        if applied != self._held:
            self._held, self._tries = applied, 0
        self._tries += 1
        self.asks += 1
        self._open = True
        return BEHIND if self._tries <= self.resends else LOST

    def applied(self, resync: bool) -> str | None:
        """A version was applied (``resync``: by a bootstrap): how it answered the ask
        still open (``RESEND`` or ``RESYNC``), or None when no ask was open."""
        if not self._open:
            return None
        self._open = False
        return RESYNC if resync else RESEND
