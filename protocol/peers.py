"""Per-receiver bookkeeping of a version server (the sender daemon, or a relay)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


@dataclass
class Peer:
    """One connected receiver, as the sender sees it.

    ``acked`` is the version it confirmed; ``sent`` the version it will be at once
    everything already queued for it is applied; ``inflight`` the versions sent but not
    yet acknowledged, which bounds how far ahead of it the sender runs (credits).
    """

    identity: bytes
    acked: int | None = None
    sent: int | None = None
    inflight: list[int | None] = field(default_factory=list)
    needs_resync: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    resyncs: int = 0

    @property
    def name(self) -> str:
        return self.identity.decode(errors="replace")

    def ack(self, version: int | None) -> None:
        self.acked = version
        self.inflight = [v for v in self.inflight if v is not None and (version is None or v > version)]
        self.wake.set()

    def describe(self) -> dict[str, object]:
        return {
            "acked": self.acked,
            "sent": self.sent,
            "inflight": len(self.inflight),
            "resyncs": self.resyncs,
            "idle_seconds": round(time.monotonic() - self.last_seen, 3),
        }
