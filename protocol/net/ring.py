"""The ring of recent patches a version server catches receivers up from.

Each patch is kept from its first part on (``RingEntry`` grows as parts are published, and
pumps serve it part by part); the ring holds the last ``size`` patches, and of those only as
many, newest first, as add up to ``max_bytes``. The bases of patches still being prepared are
kept too: a receiver at one waits for its patch instead of being resynced.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from dataclasses import dataclass, field

from protocol.wire.buffers import Buffer


@dataclass
class RingEntry:
    """A patch from ``base`` to ``version``: its messages (parts) so far, framed; a patch is
    served while it is still being encoded, part by part, until ``complete``."""

    base: int | None
    version: int
    messages: list[list[Buffer]]
    complete: bool = True
    abandoned: bool = False  # it will never be complete (``VersionServer.abandon_patch``)
    grown: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) at each new part

    @property
    def nbytes(self) -> int:
        return sum(len(f) for frames in self.messages for f in frames)

    def add(self, frames: list[Buffer], last: bool) -> None:
        self.messages.append(frames)
        self.complete = last
        self._grow()

    def abandon(self) -> None:
        self.abandoned = True
        self._grow()

    def _grow(self) -> None:
        grown, self.grown = self.grown, asyncio.Event()
        grown.set()


class PatchRing:
    """The last ``size`` patches, newest last, within ``max_bytes`` (None: no byte cap), and
    the bases of the patches still being prepared."""

    def __init__(self, size: int, max_bytes: int | None) -> None:
        self.max_bytes = max_bytes
        self._entries: collections.deque[RingEntry] = collections.deque(maxlen=size)
        self._pending_bases: set[int | None] = set()  # bases of patches still being prepared

    def __iter__(self) -> Iterator[RingEntry]:
        return iter(self._entries)

    @property
    def newest(self) -> RingEntry | None:
        return self._entries[-1] if self._entries else None

    def bases(self) -> set[int | None]:
        """Every version a patch here, or one being prepared, starts from."""
        return {e.base for e in self._entries} | self._pending_bases

    def pending(self, base: int | None) -> bool:
        """A patch from ``base`` is being prepared (``expect``), not yet published."""
        return base in self._pending_bases

    def expect(self, base: int | None) -> None:
        self._pending_bases.add(base)

    def publish(self, base: int | None, version: int, frames: list[Buffer], last: bool) -> bool:
        """Add the next part of the patch from ``base`` to ``version``; True if it starts a
        new patch (the pumps at ``base`` must be woken; those sending it wait on ``grown``)."""
        newest = self.newest
        if newest is not None and not newest.complete and (newest.base, newest.version) == (base, version):
            newest.add(frames, last)
            self._trim()
            return False
        self._entries.append(RingEntry(base, version, [frames], complete=last))
        self._pending_bases.discard(base)
        self._trim()
        return True

    def abandon(self, base: int | None, version: int) -> None:
        """The patch from ``base`` to ``version`` will not be finished: out of the ring, and
        the pumps sending it stop."""
        self._pending_bases.discard(base)
        newest = self.newest
        if newest is not None and not newest.complete and (newest.base, newest.version) == (base, version):
            self._entries.pop()
            newest.abandon()

    def clear(self) -> None:
        """Drop every patch (the bases still being prepared stay expected)."""
        self._entries.clear()

    def _trim(self) -> None:
        """Drop the oldest patches past ``max_bytes`` (the newest always stays: receivers
        at its base need it). A pump already sending one holds its frames until it is done."""
        if self.max_bytes is None:
            return
        total = 0
        for kept, entry in enumerate(reversed(self._entries)):
            total += entry.nbytes
            if kept and total > self.max_bytes:
                for _ in range(len(self._entries) - kept):
                    self._entries.popleft()
                return
