"""The trainer-side staleness bound: how far behind a receiver may be when a version is synced.

``Sender(..., max_lag=k, lag_policy=...)``: before version ``v`` is built, every connected
receiver (and, through relays, every receiver below them) should have applied ``v - k``.
``lag_policy`` says what happens when one has not:

- ``"off"`` (the default): nothing; the receivers behind are counted (``over``);
- ``"wait"``: the sync waits, at most ``lag_timeout`` seconds, then raises a
  ``LagTimeoutError`` naming the receivers still behind (nothing was built or published);
- ``"drop"``: the sync goes on; once ``v`` is published, the receivers behind stop catching
  up version by version and are resynced to it (or a later one) once they have room
  (``VersionServer.skip``).

A receiver still taking its first bootstrap has applied nothing: it counts as behind.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal, get_args

from protocol.errors import ConfigError, LagTimeoutError, WeightSyncTimeout
from protocol.net.peers import Peer
from protocol.net.server import VersionServer

log = logging.getLogger(__name__)

LagPolicy = Literal["off", "wait", "drop"]


@dataclass
class LagCounts:
    """What the policy did, for metrics and ``python -m sender status`` (they never go down)."""

    waits: int = 0  # syncs that waited for receivers
    wait_seconds: float = 0.0  # time those waits took, in all
    timeouts: int = 0  # waits that ran out (LagTimeoutError)
    drops: int = 0  # receivers left behind, to be resynced
    over: int = 0  # receivers found behind the bound (any policy)


class LagBound:
    """``max_lag`` and ``lag_policy`` of one ``Sender``, applied by ``before`` ahead of each version."""

    def __init__(self, max_lag: int | None, policy: str, timeout: float) -> None:
        if policy not in get_args(LagPolicy):
            raise ConfigError(f"lag_policy must be one of {', '.join(get_args(LagPolicy))}, got {policy!r}")
        if max_lag is not None and (type(max_lag) is not int or max_lag < 1):
            raise ConfigError(f"max_lag must be an int >= 1 (versions; 0 would wait for a version not yet published), got {max_lag!r}")
        if policy != "off" and max_lag is None:
            raise ConfigError(f"lag_policy={policy!r} needs a max_lag")
        if not timeout > 0:
            raise ConfigError(f"lag_timeout must be > 0 seconds, got {timeout!r}")
        self.max_lag, self.policy, self.timeout = max_lag, policy, float(timeout)
        self.counts = LagCounts()

    def behind(self, server: VersionServer, version: int) -> list[Peer]:
        """The connected receivers that have not applied ``version - max_lag`` (themselves, or one below them)."""
        if self.max_lag is None:
            return []
        floor = version - self.max_lag
        return [p for p in server.peers.values() if not p.subtree_acked(floor)]

    async def before(self, server: VersionServer, version: int) -> list[Peer]:
        """Apply the policy ahead of building ``version``: wait (``"wait"``), or return the
        receivers to leave behind once it is published (``"drop"``: ``leave``)."""
        late = self.behind(server, version)
        if not late:
            return []
        self.counts.over += len(late)
        if self.policy == "wait":
            await self._wait(server, version, late)
        return late if self.policy == "drop" else []

    def leave(self, server: VersionServer, version: int, late: list[Peer]) -> tuple[str, ...]:
        """``version`` is published: the receivers ``before`` found behind are resynced to it
        (or a later one) when they have room, instead of catching up version by version."""
        names = tuple(p.name for p in late)
        if not names:
            return names
        for peer in late:
            server.skip(peer)
        self.counts.drops += len(late)
        log.warning("v%s: receivers more than max_lag=%s versions behind, left to be resynced: %s", version, self.max_lag,
                    ", ".join(names), extra={"version": version, "receivers": list(names)})
        return names

    async def _wait(self, server: VersionServer, version: int, late: list[Peer]) -> None:
        assert self.max_lag is not None
        floor = version - self.max_lag
        self.counts.waits += 1
        started = time.monotonic()
        try:
            await server.wait_acked(floor, self.timeout, tree=True)
        except WeightSyncTimeout:
            self.counts.timeouts += 1
            still = {p.name: p.acked for p in self.behind(server, version)} or {p.name: p.acked for p in late}
            raise LagTimeoutError(
                f"v{version} not built: after {self.timeout:.3g}s these receivers (or ones below them) have still not applied "
                f"v{floor} (max_lag={self.max_lag}): " + ", ".join(f"{n} at v{a}" for n, a in sorted(still.items())),
                receivers=still,
            ) from None
        finally:
            self.counts.wait_seconds += time.monotonic() - started
