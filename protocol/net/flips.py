"""One flip for the fleet: every receiver commits a version at the word of its server.

Under ``commit="together"`` a receiver stages each version in the background and reports it
staged (``messages.Ack.staged``, and again with each heartbeat). The server *flips* version
``v`` (``Beat.flipped``: sent to every receiver at once, then repeated by every heartbeat, so
one lost is not waited on) once every receiver connected when ``v`` was published has
staged it, or ``quorum`` of them, or, ``stage_timeout`` after publication, with those that
have: the others are named (``Flip.missing``) and resynced. Each receiver then commits from
its staged copy: no transfer inside the window between the first commit and the last.

A version flipped flips every one before it. Receivers joining after a publication are not
waited for; a bootstrap (a first join, a resync) commits on arrival.

Through a relay (``follow``: its flips are decided by its upstream's), "staged" means the
whole subtree: the relay reports a version staged upward only once it staged it itself and
its own flip of it is *ready*: every receiver below it staged it, or ``stage_timeout``
(``RELAY_SHARE`` of its upstream's, from when it first forwarded the version) went without
some, then named upward (``Ack.missing``, as ``"child"`` or ``"child/grandchild"``) and
resynced by the relay at the flip. So a stalled leaf holds the trainer's flip at most the
trainer's ``stage_timeout``, and normally only its relay's share of it: a relay that is
itself late past the trainer's timeout is left out whole (named, resynced) instead. When the
flip reaches a relay it flips its own receivers at once, before its own commit.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from protocol.errors import ConfigError

HISTORY = 64  # decided flips kept (``Flips.history``)
# A relay's stage_timeout, of its upstream's (said in WELCOME): it decides its receivers'
# staging first, so the trainer's flip names the leaf that stalled rather than the relay.
RELAY_SHARE = 0.5
STAGE_TIMEOUT = 30.0  # seconds: a server's default, and what a relay assumes of an upstream that does not say


@dataclass
class Flip:
    """One version's flip: who it waits for, who staged, and how it was decided."""

    version: int
    cohort: frozenset[str]  # the receivers connected at publication
    published_at: float  # monotonic
    staged: set[str] = field(default_factory=set)
    decided_at: float | None = None
    # who it flipped without: cohort members that never staged it (timed out, or gone), then
    # those a relay's report went without below it ("relay/leaf")
    missing: tuple[str, ...] = ()
    done: asyncio.Event = field(default_factory=asyncio.Event)
    below: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a staged relay's ``Ack.missing``
    ready_at: float | None = None  # ``Flips.follow``: when every receiver staged it, or the timeout went without some

    @property
    def seconds(self) -> float | None:
        """From publication to the flip."""
        return None if self.decided_at is None else self.decided_at - self.published_at

    @property
    def unstaged(self) -> frozenset[str]:
        """Cohort members that have not staged it: resynced if it flips without them."""
        return self.cohort - self.staged

    def left_out(self) -> tuple[str, ...]:
        """Who it goes without, if it flipped now: see ``missing``."""
        nested = (f"{name}/{m}" for name in sorted(self.staged & self.cohort) for m in self.below.get(name, ()))
        return (*sorted(self.unstaged), *nested)


class Flips:
    """The server's flips: ``published`` opens one a version, ``staged`` and ``left`` may
    decide it, ``due`` decides the ones past ``stage_timeout``; each returns the flips it
    decided (the server then tells every receiver, and resyncs the ``missing``)."""

    def __init__(self, quorum: int | None = None, stage_timeout: float = STAGE_TIMEOUT, *, follow: bool = False) -> None:
        """``follow``: decided only by ``decide`` (a relay flips its children at its
        upstream's word), never by its receivers' reports or a timeout: those make a flip
        *ready* instead (``ready``, ``on_ready``), which a relay reports upward as staged."""
        self.follow = follow
        self.on_ready: Callable[[Flip], None] | None = None  # follow: told of each flip that became ready
        if quorum is not None and (type(quorum) is not int or quorum < 1):
            raise ConfigError(f"quorum must be None (every receiver) or an int >= 1, got {quorum!r}")
        if not stage_timeout > 0:
            raise ConfigError(f"stage_timeout must be > 0 seconds, got {stage_timeout!r}")
        self.quorum, self.stage_timeout = quorum, float(stage_timeout)
        self.flipped: int | None = None
        self.open: dict[int, Flip] = {}
        self.history: collections.OrderedDict[int, Flip] = collections.OrderedDict()

    def published(self, version: int, receivers: Iterable[str], now: float | None = None) -> list[Flip]:
        """``version`` is out to ``receivers``: its flip waits for them. Published again
        (a relay opens it when it forwards the version, then moves to it), the first stands."""
        flip = self.open.get(version) or Flip(version, frozenset(receivers), time.monotonic() if now is None else now)
        self.open[version] = flip
        return self._check(time.monotonic() if now is None else now)

    def staged(self, receiver: str, version: int, now: float | None = None, *, below: Iterable[str] = ()) -> list[Flip]:
        """``receiver`` holds ``version`` staged (reports repeat: idempotent); ``below``: a
        relay's ``Ack.missing``, the receivers below it that its report went without."""
        flip = self.open.get(version)
        if flip is not None:
            flip.staged.add(receiver)
            if below := tuple(below):
                flip.below[receiver] = below
            else:
                flip.below.pop(receiver, None)
        return self._check(time.monotonic() if now is None else now)

    def left(self, receiver: str, now: float | None = None) -> list[Flip]:
        """``receiver`` disconnected: no flip waits for it any more."""
        for flip in self.open.values():
            if receiver in flip.cohort and receiver not in flip.staged:
                flip.cohort = flip.cohort - {receiver}
        return self._check(time.monotonic() if now is None else now)

    def due(self, now: float | None = None) -> list[Flip]:
        """Decide the flips past ``stage_timeout`` with the receivers that staged
        (``follow``: make them ready)."""
        now = time.monotonic() if now is None else now
        late = [f for f in self.open.values() if now - f.published_at >= self.stage_timeout]
        if self.follow:
            self._ready_now(late, now)
            return []
        return self._decide(max(f.version for f in late), now) if late else []

    def ready(self, version: int) -> Flip | None:
        """``follow``: ``version``'s flip if its receivers are done staging it (all staged,
        or the timeout went without some: ``Flip.left_out``), else None. A version with no
        flip here (none of its receivers to wait for) is ready: a bare ``Flip``."""
        flip = self.record(version)
        if flip is None:
            return Flip(version, frozenset(), 0.0, ready_at=0.0)
        return flip if flip.ready_at is not None or flip.decided_at is not None else None

    def record(self, version: int) -> Flip | None:
        return self.open.get(version) or self.history.get(version)

    def decide(self, version: int, now: float | None = None) -> list[Flip]:
        """Flip ``version`` now, whoever staged it."""
        if version not in self.open and (self.flipped is not None and version <= self.flipped):
            return []
        self.open.setdefault(version, Flip(version, frozenset(), time.monotonic() if now is None else now))
        return self._decide(version, time.monotonic() if now is None else now)

    def _check(self, now: float) -> list[Flip]:
        if self.follow:
            self._ready_now([f for f in self.open.values() if self._ready(f)], now)
            return []
        ready = [f.version for f in self.open.values() if self._ready(f)]
        return self._decide(max(ready), now) if ready else []

    def _ready_now(self, flips: list[Flip], now: float) -> None:
        for flip in flips:
            if flip.ready_at is None:
                flip.ready_at = now
                if self.on_ready is not None:
                    self.on_ready(flip)

    def _ready(self, flip: Flip) -> bool:
        staged = len(flip.staged & flip.cohort)
        if self.quorum is not None and staged >= min(self.quorum, len(flip.cohort)):
            return True
        return flip.cohort <= flip.staged

    def _decide(self, version: int, now: float) -> list[Flip]:
        """Flip ``version`` and every open one before it."""
        decided = []
        for v in sorted(v for v in self.open if v <= version):
            flip = self.open.pop(v)
            flip.decided_at = now
            flip.missing = flip.left_out()
            flip.done.set()
            self.history[v] = flip
            decided.append(flip)
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)
        self.flipped = version if self.flipped is None else max(self.flipped, version)
        return decided
