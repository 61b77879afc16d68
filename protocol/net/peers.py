"""Per-receiver bookkeeping of a version server (the sender daemon, or a relay)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protocol.errors import ProtocolError
from protocol.net.sockets import TcpLink
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
    skipped: bool = False  # left behind by the sender's lag policy: its next version is a resync to the newest
    last_seen: float = field(default_factory=time.monotonic)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    resyncs: int = 0
    refused: int = 0  # resyncs sent since it NACKed, with no ACK between (bounded by the server)
    below: int = 0
    below_acked: int | None = None
    source: int | None = None  # the fd of the connection its messages last came on
    link: TcpLink | None = None  # that connection, if it is TCP (Linux)
    acked_bytes: int | None = None  # what its kernel had acknowledged of ours at the last look
    acked_at: float | None = None  # monotonic time of its last ACK (or heartbeat moving its version)
    joined_at: float = field(default_factory=time.monotonic)
    behind_at: float = float("-inf")  # monotonic time of the last BEHIND acted on (one an interval at most)
    resend_to: int | None = None  # the furthest version it had been sent when it asked (BEHIND): up to it, a resend
    subtree: bool = False  # its HELLO said a relay's staged report waits for its receivers (``Hello.subtree``)

    @property
    def name(self) -> str:
        return self.identity.decode(errors="replace")

    def heard(self, fd: int) -> None:
        """A message from it arrived, on the connection with fd ``fd``."""
        self.last_seen = time.monotonic()
        if fd != self.source:
            self.source, self.link, self.acked_bytes = fd, TcpLink.of(fd), None

    def silence(self, now: float, beat: float) -> float:
        """Seconds without a sign of life at ``now``, judged every ``beat`` seconds.

        A message is one; so is, over TCP on Linux, its kernel acknowledging more of our
        bytes since the last look. On a slow link with a deep queue the acknowledgements
        its TCP waits for sit behind the version we are sending it, so its heartbeats can
        arrive later than peer_timeout while it takes in every byte. The counter is read
        only once a beat has passed without a message."""
        if now - self.last_seen > beat and self.link is not None:
            counts = self.link.counts()
            if counts is None:  # closed (its next message names the new one)
                self.source = self.link = None
            else:
                if self.acked_bytes is not None and counts[0] != self.acked_bytes:
                    self.last_seen = max(self.last_seen, now - beat)
                self.acked_bytes = counts[0]
        return now - self.last_seen

    def ack(self, version: int | None) -> None:
        self.acked = version
        self.acked_at = time.monotonic()
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
