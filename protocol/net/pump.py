"""Each receiver's pump: what a version server sends one receiver, in order, bounded by credits.

A pump is one task per receiver, so a slow or dead receiver never blocks the others: its
greeting (WELCOME, and a bootstrap if it needs one), then each next version it lacks, from the
ring's patches (part by part as they are published), the bucket version, or a resync, never
more than ``max_inflight`` versions ahead of what it acknowledged. A whole model going to it
is followed as its kernel acknowledges the bytes (``Pump._watch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from protocol.errors import PeerGone, ResyncLimitError, TransportError, WeightSyncError
from protocol.net.deliveries import ServerCounts
from protocol.net.peers import Peer
from protocol.net.ring import PatchRing, RingEntry
from protocol.net.sockets import TcpLink
from protocol.progress import Progress
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, Stamper
from protocol.wire.messages import ErrorReport

log = logging.getLogger(__name__)

WATCH_EVERY = 0.25  # seconds between reads of a receiver's TCP counters while a whole model goes to it
WATCH_LIMIT = 3600.0  # seconds a transfer's progress is followed at most


class PumpHost(Protocol):
    """The version server as its pumps see it (``VersionServer``)."""

    role: str
    stamp: Stamper
    version: int | None
    max_inflight: int
    peer_timeout: float
    resync_backoff: tuple[float, float]
    max_resyncs: int
    counts: ServerCounts
    transfers: dict[bytes, Progress]

    @property
    def peers(self) -> Mapping[bytes, Peer]: ...

    @property
    def buckets(self) -> tuple[int, list[list[Buffer]]] | None:
        """Bucket mode: the current version and its messages."""

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]: ...

    def fail(self, error: BaseException) -> None:
        """Record what stops the server."""

    def try_send(self, peer: Peer, frames: list[Buffer]) -> bool: ...

    async def drop(self, peer: Peer, why: str) -> None: ...

    async def resync_messages(self) -> tuple[int | None, list[Message]]: ...


class Pump:
    """Sends each receiver of ``server`` what it is missing, from ``ring`` and the rest of
    what the server holds (``run``, one task per receiver)."""

    def __init__(self, server: PumpHost, ring: PatchRing) -> None:
        self._server = server
        self._ring = ring

    async def run(self, peer: Peer, greeting: list[Message]) -> None:
        """Send ``peer`` what it is missing, never more than ``max_inflight`` versions ahead.

        A pump never ends with its peer still registered: a receiver that cannot be served
        (a ``WeightSyncError``: resyncs refused too often, a bootstrap this server cannot
        build now) is dropped and sent the error; anything else (a bug, or a ``TransportError``:
        this server's own socket failed) drops the peer and fails the server (``spawn``)."""
        server = self._server
        try:
            await self._deliver_all(peer, [server.stamp(m) for m in greeting], "bootstrap" if len(greeting) > 1 else "")
            # A bootstrap is a whole model copy: this coroutine lives as long as the peer,
            # so it keeps no reference to what it has queued (ZeroMQ holds what it still needs).
            del greeting
            while True:
                while len(peer.inflight) < server.max_inflight:
                    batch = await self._next_for(peer)
                    if batch is None:
                        break
                    version, what = batch
                    del batch
                    if isinstance(what, RingEntry):
                        if not await self._deliver_entry(peer, what):
                            continue  # abandoned: the peer is still at its base
                    else:
                        await self._deliver_all(peer, what, f"v{version}")
                    del what
                    peer.sent = version
                    peer.inflight.append(version)
                await peer.wake.wait()
                peer.wake.clear()
        except PeerGone:
            await server.drop(peer, "disconnected")
        except TransportError as e:  # this server's socket failed, not one receiver: it fails the server
            server.fail(e)
            await server.drop(peer, f"its pump failed: {e!r}")
            raise
        except WeightSyncError as e:
            log.error("%s cannot serve receiver %s: %s: %s", server.role, peer.name, type(e).__name__, e)
            with contextlib.suppress(PeerGone):
                server.try_send(peer, server.stamp(ErrorReport.of(e).to_message()))
            await server.drop(peer, f"{type(e).__name__}: {e}")
        except Exception as e:
            server.fail(e)  # before the drop wakes the waiters: they must see it, not one receiver fewer
            await server.drop(peer, f"its pump failed: {e!r}")
            raise

    async def _next_for(self, peer: Peer) -> tuple[int | None, RingEntry | list[list[Buffer]]] | None:
        server = self._server
        if not peer.needs_resync and not peer.skipped:
            for entry in self._ring:  # from the current version too: a patch whose first parts are out
                if entry.base == peer.sent:
                    if peer.resend_to is not None and entry.version <= peer.resend_to:
                        server.counts.ring_resends += 1  # it asked for it again (BEHIND): lost on the way
                    return entry.version, entry
            buckets = server.buckets  # (a relay's, under commit="together", goes on before the relay commits it)
            if buckets is not None and (peer.sent is None or peer.sent < buckets[0]):
                if peer.resend_to is not None and buckets[0] <= peer.resend_to:
                    server.counts.bucket_resends += 1  # it asked for it again (BEHIND): lost on the way
                return buckets
            if peer.sent == server.version or (peer.sent is not None and server.version is not None and peer.sent > server.version):
                return None  # it has all there is (a relay's patch goes on before the relay commits it)
            if self._ring.pending(peer.sent):
                return None  # its next patch is being prepared; publish_patch wakes it
        if peer.needs_resync:  # it NACKed: resync, later each time it refuses again, and not forever
            if peer.refused >= server.max_resyncs:
                raise ResyncLimitError(
                    f"receiver {peer.name} refused {peer.refused} resyncs in a row (this {server.role} is at v{server.version}); "
                    "dropped, see its log for why it rejects them"
                )
            if peer.refused:
                first, largest = server.resync_backoff
                await asyncio.sleep(min(first * 2 ** (peer.refused - 1), largest))
            peer.refused += 1
        elif peer.skipped and peer.sent == server.version:
            peer.skipped = False  # what it was sent already reaches the newest version
            return None
        peer.needs_resync = peer.skipped = False
        peer.resyncs += 1
        server.counts.resyncs += 1
        log.info("resyncing receiver %s from v%s to v%s", peer.name, peer.acked, server.version,
                 extra={"receiver": peer.name, "version": server.version, "from_version": peer.acked})
        version, messages = await server.resync_messages()  # (a deferred one is of a later version)
        return version, [server.stamp(m) for m in messages]

    async def _deliver_entry(self, peer: Peer, entry: RingEntry) -> bool:
        """Every part of a patch, each as soon as it is published; False if it was abandoned first."""
        sent = 0
        while True:
            while sent < len(entry.messages):
                await self._deliver(peer, entry.messages[sent])
                sent += 1
            if entry.complete:
                return True
            if entry.abandoned:
                return False
            await entry.grown.wait()

    async def _deliver_all(self, peer: Peer, messages: list[list[Buffer]], what: str = "") -> None:
        """Queue whole-model messages (a bootstrap, a resync, a bucket version) for ``peer``;
        one that takes long logs its progress (``what`` names it): over TCP on Linux as the
        receiver's kernel acknowledges the bytes (``_watch``, beside the pump), elsewhere as
        they are queued."""
        total = sum(len(f) for frames in messages for f in frames)
        progress = Progress(log, f"{self._server.role} sending {what or 'messages'} to receiver {peer.name}", total, peer=peer.name)
        self._server.transfers[peer.identity] = progress
        link = peer.link
        start = None if link is None else link.counts()
        if link is not None and start is not None:
            self._server.spawn(self._watch(peer, link, start[0], progress), f"progress-{peer.name}")
        for frames in messages:
            await self._deliver(peer, frames)
            if start is None:
                progress.advance(sum(len(f) for f in frames))
        if start is None:
            self._finished(peer, progress)

    def _finished(self, peer: Peer, progress: Progress) -> None:
        progress.finish()
        if self._server.transfers.get(peer.identity) is progress:
            del self._server.transfers[peer.identity]

    async def _watch(self, peer: Peer, link: TcpLink, start: int, progress: Progress) -> None:
        """``progress`` of a transfer to ``peer`` as its kernel acknowledges our bytes, until
        all are (heartbeats counted too: a bound, not a byte count), the connection closes or
        the peer leaves; polled at most 4 times a second, for at most ``WATCH_LIMIT``."""
        total = progress.total or 0
        done = 0
        deadline = time.monotonic() + WATCH_LIMIT
        while self._server.peers.get(peer.identity) is peer and peer.link is link and time.monotonic() < deadline:
            counts = link.counts()
            if counts is None:
                return
            acked = min(total, counts[0] - start)
            progress.advance(max(0, acked - done))
            done = max(done, acked)
            if done >= total:
                break
            await asyncio.sleep(WATCH_EVERY)
        self._finished(peer, progress)

    async def _deliver(self, peer: Peer, frames: list[Buffer]) -> None:
        """Queue ``frames`` for ``peer``, waiting (never blocking the loop) while its queue is full."""
        delay = 0.001
        while not self._server.try_send(peer, frames):
            if time.monotonic() - peer.last_seen > self._server.peer_timeout:
                raise PeerGone(peer.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
