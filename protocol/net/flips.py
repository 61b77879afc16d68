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
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from protocol.errors import ConfigError

HISTORY = 64  # decided flips kept (``Flips.history``)


@dataclass
class Flip:
    """One version's flip: who it waits for, who staged, and how it was decided."""

    version: int
    cohort: frozenset[str]  # the receivers connected at publication
    published_at: float  # monotonic
    staged: set[str] = field(default_factory=set)
    decided_at: float | None = None
    missing: tuple[str, ...] = ()  # cohort members it flipped without (timed out, or gone)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def seconds(self) -> float | None:
        """From publication to the flip."""
        return None if self.decided_at is None else self.decided_at - self.published_at


class Flips:
    """The server's flips: ``published`` opens one a version, ``staged`` and ``left`` may
    decide it, ``due`` decides the ones past ``stage_timeout``; each returns the flips it
    decided (the server then tells every receiver, and resyncs the ``missing``)."""

    def __init__(self, quorum: int | None = None, stage_timeout: float = 30.0, *, follow: bool = False) -> None:
        """``follow``: decided only by ``decide`` (a relay flips its children when it has
        flipped itself, at its upstream's word), never by its receivers' reports or a timeout."""
        self.follow = follow
        if quorum is not None and (type(quorum) is not int or quorum < 1):
            raise ConfigError(f"quorum must be None (every receiver) or an int >= 1, got {quorum!r}")
        if not stage_timeout > 0:
            raise ConfigError(f"stage_timeout must be > 0 seconds, got {stage_timeout!r}")
        self.quorum, self.stage_timeout = quorum, float(stage_timeout)
        self.flipped: int | None = None
        self.open: dict[int, Flip] = {}
        self.history: collections.OrderedDict[int, Flip] = collections.OrderedDict()

    def published(self, version: int, receivers: Iterable[str], now: float | None = None) -> list[Flip]:
        flip = Flip(version, frozenset(receivers), time.monotonic() if now is None else now)
        self.open[version] = flip
        return self._check(flip.published_at)

    def staged(self, receiver: str, version: int, now: float | None = None) -> list[Flip]:
        """``receiver`` holds ``version`` staged (reports repeat: idempotent)."""
        flip = self.open.get(version)
        if flip is not None:
            flip.staged.add(receiver)
        return self._check(time.monotonic() if now is None else now)

    def left(self, receiver: str, now: float | None = None) -> list[Flip]:
        """``receiver`` disconnected: no flip waits for it any more."""
        for flip in self.open.values():
            if receiver in flip.cohort and receiver not in flip.staged:
                flip.cohort = flip.cohort - {receiver}
        return self._check(time.monotonic() if now is None else now)

    def due(self, now: float | None = None) -> list[Flip]:
        """Decide the flips past ``stage_timeout`` with the receivers that staged."""
        if self.follow:
            return []
        now = time.monotonic() if now is None else now
        late = [f for f in self.open.values() if now - f.published_at >= self.stage_timeout]
        return self._decide(max(f.version for f in late), now) if late else []

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
            return []
        ready = [f.version for f in self.open.values() if self._ready(f)]
        return self._decide(max(ready), now) if ready else []

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
            flip.missing = tuple(sorted(flip.cohort - flip.staged))
            flip.done.set()
            self.history[v] = flip
            decided.append(flip)
        while len(self.history) > HISTORY:
            self.history.popitem(last=False)
        self.flipped = version if self.flipped is None else max(self.flipped, version)
        return decided
