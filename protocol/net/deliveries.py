"""What a version server counts for its operators (``sender/serve/metrics.py`` exports it): when each
recent version was published and when every receiver connected then had it, each receiver's
lag, resyncs and NACKs. Bounded whatever the receivers do: the versions kept, the NACK
reasons (untrusted text from receivers) and the deliveries in flight have fixed caps.
"""

from __future__ import annotations

import collections
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

VERSIONS_KEPT = 256  # published versions remembered (their time), for lag
DELIVERIES_KEPT = 32  # versions whose delivery to every receiver is still awaited
NACK_REASONS_KEPT = 32  # distinct NACK reasons counted; any further one counts as "other"
_REASON = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


@dataclass
class ServerCounts:
    """Cumulative counts of a server's life (they never go down)."""

    resyncs: int = 0  # bootstraps sent to receivers that were behind the ring or NACKed
    behind: int = 0  # receivers' asks (NACK BEHIND) for the versions after theirs, acted on
    ring_resends: int = 0  # patches sent again from the ring to receivers that asked (BEHIND)
    bucket_resends: int = 0  # bucket versions sent again, as they were, to receivers that asked (BEHIND)
    nacks: dict[str, int] = field(default_factory=dict)  # NACKs received, by the reason they gave

    def nack(self, reason: str) -> None:
        """Count a NACK; a reason that is not an identifier, or one past the cap, is "other"."""
        named = len(self.nacks) - ("other" in self.nacks)
        if not _REASON.fullmatch(reason) or (reason not in self.nacks and named >= NACK_REASONS_KEPT - 1):
            reason = "other"
        self.nacks[reason] = self.nacks.get(reason, 0) + 1


class Deliveries:
    """The recent versions' publication times and their delivery to the receivers connected
    when each was published: ``on_delivered(version, seconds)`` once the last of them has
    acknowledged it (or left)."""

    def __init__(self, on_delivered: Callable[[int, float], None] | None = None) -> None:
        self.on_delivered = on_delivered
        self._published: collections.OrderedDict[int, float] = collections.OrderedDict()
        self._waiting: collections.OrderedDict[int, tuple[float, set[bytes]]] = collections.OrderedDict()

    def published(self, version: int, receivers: Iterable[bytes], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._published[version] = now
        while len(self._published) > VERSIONS_KEPT:
            self._published.popitem(last=False)
        waiting = set(receivers)
        if waiting:
            self._waiting[version] = (now, waiting)
            while len(self._waiting) > DELIVERIES_KEPT:
                self._waiting.popitem(last=False)

    def acked(self, identity: bytes, version: int | None, now: float | None = None) -> None:
        """``identity`` holds ``version`` (and so every version before it)."""
        if version is not None:
            self._settle(identity, lambda v: v <= version, now)

    def left(self, identity: bytes, now: float | None = None) -> None:
        self._settle(identity, lambda v: True, now)

    def _settle(self, identity: bytes, covered: Callable[[int], bool], now: float | None) -> None:
        now = time.monotonic() if now is None else now
        for version, (at, waiting) in list(self._waiting.items()):
            if covered(version) and identity in waiting:
                waiting.discard(identity)
                if not waiting:
                    del self._waiting[version]
                    if self.on_delivered is not None:
                        self.on_delivered(version, now - at)

    def lag(self, acked: int | None, current: int | None, now: float | None = None) -> tuple[int, float]:
        """How far a receiver at ``acked`` is behind ``current``: the published versions it
        lacks (of those remembered) and the seconds since the oldest of them was published."""
        if current is None or (acked is not None and acked >= current):
            return 0, 0.0
        now = time.monotonic() if now is None else now
        lacking = [at for v, at in self._published.items() if acked is None or v > acked]
        if not lacking:  # behind, but on no version remembered here (e.g. the one given to start)
            return 1, 0.0
        return len(lacking), now - lacking[0]
