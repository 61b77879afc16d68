"""Per-receiver bookkeeping of a version server (the sender daemon, or a relay)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ProtocolError
from protocol.wire.messages import Ack


@dataclass
class Peer:
    """One connected receiver, as the sender sees it.

    ``acked`` is the version it confirmed; ``sent`` the version it will be at once
    everything already queued for it is applied; ``inflight`` the versions sent but not
    yet acknowledged, which bounds how far ahead of it the sender runs (credits).
    ``refused`` counts the resyncs it was sent since it last NACKed without an ACK
    between: the server spaces them out and gives up past its ``max_resyncs``.
    A relay also reports the receivers below it: how many (``below``) and the lowest
    version any of them has applied (``below_acked``; None until all have one).
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
    refused: int = 0  # resyncs sent since it NACKed, with no ACK between (bounded by the server)
    below: int = 0
    below_acked: int | None = None

    @property
    def name(self) -> str:
        return self.identity.decode(errors="replace")

    def ack(self, version: int | None) -> None:
        self.acked = version
        self.inflight = [v for v in self.inflight if v is not None and (version is None or v > version)]
        self.wake.set()

    def report_below(self, body: Mapping[Any, Any]) -> bool:
        """Take a relay's ``below`` (``messages.Ack``) from its ACK or HEARTBEAT body
        (untrusted: anything malformed is ignored); True if it changed."""
        try:
            below = Ack.from_body(body).below
        except ProtocolError:
            return False
        if below is None:
            return False
        count, acked = below
        changed = (count, acked) != (self.below, self.below_acked)
        self.below, self.below_acked = count, acked
        return changed

    def subtree_acked(self, version: int) -> bool:
        """It, and every receiver below it, has applied ``version`` (or a later one)."""
        mine = self.acked is not None and self.acked >= version
        return mine and (self.below == 0 or (self.below_acked is not None and self.below_acked >= version))

    def describe(self) -> dict[str, object]:
        return {
            "acked": self.acked,
            "below": self.below,
            "below_acked": self.below_acked,
            "sent": self.sent,
            "inflight": len(self.inflight),
            "resyncs": self.resyncs,
            "idle_seconds": round(time.monotonic() - self.last_seen, 3),
        }
