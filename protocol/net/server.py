"""Serving versions to receivers over a ROUTER: what the sender daemon and a relay share.

A ``VersionServer`` knows nothing of where versions come from. It is composed with a
``VersionSource`` (the trainer's, ``sender/serve/source.py``; a relay's receiver,
``receiver/session/relay.py``) that answers what only the source knows: is this receiver's HELLO
acceptable and what WELCOME does it get (``admit``), what is a bootstrap of the current
version (``bootstrap``), what is its state digest (``digest``). Whoever owns the server
puts each new version in front of it (``moved``, ``publish_patch``, ``publish_buckets``).
The server does the rest: handshakes, one pump task per receiver bounded by credits
(versions in flight), so a slow or dead receiver never blocks the others, a ring of
recent patches to catch receivers up (each patch served part by part as its parts are
published, before the last one is encoded), resyncs by bootstrap, heartbeats, and timeouts.
Its parts: the ring (``ring.py``), each receiver's pump (``pump.py``) and the rest of its
session (``sessions.py``: HELLO, what it sends, heartbeats); ``VersionSource`` is in ``source.py``.

A receiver that refuses a version (NACK) is resynced; one that refuses the resyncs too
gets each next one later (``resync_backoff``), and after ``max_resyncs`` in a row with no
ACK between, it is dropped with a ``ResyncLimitError`` (logged, and sent to it as an
ERROR): whole models are not sent forever to a receiver that will not take them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from protocol.errors import ConfigError, PeerGone, WeightSyncError, WeightSyncTimeout
from protocol.net.context import shared_context
from protocol.net.deliveries import Deliveries, ServerCounts
from protocol.net.flips import Flip, Flips
from protocol.net.peers import Peer
from protocol.net.pump import Pump
from protocol.net.ring import PatchRing
from protocol.net.security import CurveServer, check_transport
from protocol.net.sessions import Sessions
from protocol.net.sockets import RouterSocket
from protocol.net.source import VersionSource
from protocol.progress import Progress
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, Stamper
from protocol.wire.limits import Limits
from protocol.wire.messages import Beat

log = logging.getLogger(__name__)

_Server = TypeVar("_Server", bound="VersionServer")


class VersionServer:
    """Serves the versions of a ``VersionSource`` (given to ``start``) to any number of receivers.

    ``curve`` (``protocol.net.security.CurveServer``) encrypts the connection and admits only
    receivers whose public key it allows; a refused key is logged and counted in
    ``rejected_handshakes``. Without it, binding beyond loopback is a ``ConfigError``
    unless ``insecure_plaintext``.

    The ring keeps the last ``ring_size`` patches to catch up a receiver that fell behind,
    and of those only as many, newest first, as add up to ``ring_bytes`` (None: no byte
    cap): a receiver further behind is resynced, which a cap of a bootstrap's size makes
    never more bytes than the patches it would have needed.

    ``resync_backoff`` (first, largest; seconds, doubling) spaces the resyncs of a receiver
    that NACKs them one after another, and ``max_resyncs`` caps how many it is sent in a
    row (no ACK between) before it is dropped with a ``ResyncLimitError``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        role: str = "sender",
        ring_size: int = 8,
        ring_bytes: int | None = None,
        max_inflight: int = 2,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        context: zmq.asyncio.Context | None = None,
        curve: CurveServer | None = None,
        insecure_plaintext: bool = False,
        resync_backoff: tuple[float, float] = (0.05, 2.0),
        max_resyncs: int = 8,
        flips: Flips | None = None,
    ) -> None:
        if ring_size < 1 or max_inflight < 1:
            raise ConfigError("ring_size and max_inflight must be at least 1")
        if ring_bytes is not None and (type(ring_bytes) is not int or ring_bytes < 0):
            raise ConfigError(f"ring_bytes must be None or an int >= 0, got {ring_bytes!r}")
        if type(max_resyncs) is not int or max_resyncs < 1:
            raise ConfigError(f"max_resyncs must be an int of at least 1, got {max_resyncs!r}")
        if len(resync_backoff) != 2 or not 0 <= resync_backoff[0] <= resync_backoff[1]:
            raise ConfigError(f"resync_backoff must be (first, largest) seconds with 0 <= first <= largest, got {resync_backoff!r}")
        self.resync_backoff, self.max_resyncs = (float(resync_backoff[0]), float(resync_backoff[1])), max_resyncs
        self.role = role  # in log lines and errors
        self._source: VersionSource | None = None
        check_transport(endpoint, curve, insecure_plaintext, role=role)
        self.curve = curve
        self.rejected_handshakes = 0  # CURVE handshakes refused: key not in the allowlist
        self.rejected_keys: set[str] = set()
        self.bytes_sent = 0  # every message queued for a receiver: this server's egress
        self._endpoint = endpoint
        self.ring_size, self.max_inflight = ring_size, max_inflight
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self._context = context or shared_context()
        self.stamp = Stamper()
        self.version: int | None = None
        # The trainer's newest version where this server's own can lag it (a relay: its
        # upstream's latest as last heard); told to receivers with each heartbeat.
        self.upstream_latest: Callable[[], int | None] | None = None
        # commit="together": receivers stage each version and commit it when it flips (``flips.py``)
        self.flips = flips
        self.on_flip: Callable[[Flip], None] | None = None  # told of each flip decided (the Sender fills its stats)
        self._ring = PatchRing(ring_size, ring_bytes)
        self._bucket_frames: tuple[int, list[list[Buffer]]] | None = None  # bucket mode: the current version's messages
        self._resync: tuple[int | None, list[Message]] | None = None
        self._moved = asyncio.Event()  # set (and replaced) each time the version moves: deferred bootstraps retry
        self.counts = ServerCounts()  # resyncs and NACKs, for metrics
        self.deliveries = Deliveries()  # publication and delivery times, receivers' lag (set its on_delivered)
        self.transfers: dict[bytes, Progress] = {}  # whole models going to receivers now, by identity (metrics)
        self._digest: tuple[int | None, str | None] | None = None
        self._peers: dict[bytes, Peer] = {}
        self._pump = Pump(self, self._ring)
        self._sessions = Sessions(self, self._peers, self._ring, self._pump)
        self.lock = asyncio.Lock()  # the version at rest: new versions vs bootstraps and digests
        self._acked = asyncio.Condition()
        self._socket: RouterSocket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._closed = False

    # -- public API -----------------------------------------------------------------
    @property
    def latest(self) -> int | None:
        """The newest version the trainer has published, as this server knows it: its own,
        or, for a relay, its upstream's when that is newer."""
        upstream = None if self.upstream_latest is None else self.upstream_latest()
        if upstream is None or (self.version is not None and self.version >= upstream):
            return self.version
        return upstream

    def beat(self, news: bool = False) -> Message:
        """A heartbeat to a receiver: this server's version, the trainer's latest where that
        differs, and under ``flips`` the newest version flipped; ``news``: sent at once, off
        the heartbeats' pace (``announce``)."""
        latest = self.latest
        flipped = None if self.flips is None else self.flips.flipped
        body = Beat(None if latest == self.version else latest, flipped, news)
        return Message(MessageType.HEARTBEAT, version=self.version, body=body.to_body())

    def announce(self) -> None:
        """Tell every receiver now what is latest (a heartbeat marked ``news``): a version was
        published or flipped, or, for a relay, its upstream named a newer one. A receiver
        waiting for credit (``max_inflight``), or busy, learns of it before its bytes come,
        so that ``Receiver.reading(max_lag=)`` never counts on what it has not heard of."""
        if self._socket is None:
            return
        beat = self.beat(news=True)
        for peer in list(self._peers.values()):
            with contextlib.suppress(PeerGone):  # its pump finds it gone and drops it
                self.try_send(peer, self.stamp(beat))

    def flipped(self, decided: list[Flip]) -> None:
        """``decided`` flips were made: every receiver is told now (the heartbeats repeat it),
        and the receivers a flip went without are resynced (those below a relay, by it)."""
        if not decided:
            return
        names = {m for flip in decided for m in flip.unstaged}
        for peer in list(self._peers.values()):
            if peer.name in names:
                self.skip(peer)
        self.announce()
        for flip in decided:
            log.log(logging.WARNING if flip.missing else logging.DEBUG, "v%s flipped after %.3fs%s", flip.version, flip.seconds or 0.0,
                    f" without {', '.join(flip.missing)} (not staged: resynced)" if flip.missing else "",
                    extra={"version": flip.version, "missing": list(flip.missing)})
            if self.on_flip is not None:
                self.on_flip(flip)

    async def wait_flipped(self, version: int, timeout: float | None = None) -> Flip:
        """Wait until ``version`` (or a later one) has flipped; its record."""
        if self.flips is None:
            raise WeightSyncError(f"this {self.role} does not commit versions together")
        flips = self.flips

        async def flipped() -> None:
            while flips.flipped is None or flips.flipped < version:
                self.check_running()
                record = flips.record(version)
                if record is not None:
                    await record.done.wait()
                else:
                    await asyncio.sleep(self.heartbeat_interval)

        try:
            await asyncio.wait_for(flipped(), timeout)
        except asyncio.TimeoutError:
            raise WeightSyncTimeout(f"timed out after {timeout:.3g}s waiting for v{version} to flip") from None
        record = flips.record(version)
        assert record is not None or flips.flipped is not None
        return record if record is not None else Flip(version, frozenset(), 0.0)

    @property
    def endpoint(self) -> str:
        """The bound address, with the real port once started."""
        return self._socket.endpoint if self._socket else self._endpoint

    @property
    def session(self) -> str:
        return self.stamp.session

    @property
    def source(self) -> VersionSource:
        """Where the versions served come from (given to ``start``)."""
        if self._source is None:
            raise WeightSyncError(f"{self.role} is not started")
        return self._source

    @property
    def failure(self) -> BaseException | None:
        """What stopped this server (a background task's error, logged), or None."""
        return self._failure

    @property
    def ring_bytes(self) -> int | None:
        """The ring's byte cap (None: none); a ``Sender`` given none sets its state's size."""
        return self._ring.max_bytes

    @ring_bytes.setter
    def ring_bytes(self, value: int | None) -> None:
        self._ring.max_bytes = value

    @property
    def peers(self) -> Mapping[bytes, Peer]:
        """The connected receivers by identity (read-only: the server's own records)."""
        return types.MappingProxyType(self._peers)

    @property
    def receivers(self) -> dict[str, dict[str, object]]:
        """Connected receivers by identity, with their acknowledged version and queue."""
        return {p.name: p.describe() for p in self._peers.values()}

    def subtree(self) -> tuple[int, int | None]:
        """How many receivers this server feeds, directly or through relays, and the
        lowest version any of them has applied (None while one has none)."""
        peers = list(self._peers.values())
        count = sum(1 + p.below for p in peers)
        versions = [p.acked for p in peers] + [p.below_acked for p in peers if p.below]
        if not versions or any(v is None for v in versions):
            return count, None
        return count, min(v for v in versions if v is not None)

    def skip(self, peer: Peer) -> None:
        """Stop catching ``peer`` up version by version: what it is sent next, once it has
        room (``max_inflight``), is a resync to the newest version (the sender's lag policy,
        ``drop``). What is already queued for it still arrives."""
        peer.skipped = True
        peer.wake.set()

    async def wait_acked(self, version: int, timeout: float | None = None, *, tree: bool = False) -> None:
        """Wait until every connected receiver has applied ``version`` (or a later one);
        with ``tree``, every receiver below the relays among them too (relays report it
        with their heartbeats, so each level adds up to a heartbeat interval)."""

        def done() -> bool:
            self.check_running()
            if tree:
                return all(p.subtree_acked(version) for p in self._peers.values())
            return all(p.acked is not None and p.acked >= version for p in self._peers.values())

        async with self._acked:
            try:
                await asyncio.wait_for(self._acked.wait_for(done), timeout)
            except asyncio.TimeoutError:
                raise WeightSyncTimeout(f"timed out after {timeout:.3g}s waiting for every receiver to apply v{version}") from None

    async def wait_for_receivers(self, count: int, timeout: float | None = None) -> None:
        """Wait until at least ``count`` receivers are connected."""
        async with self._acked:
            try:
                await asyncio.wait_for(self._acked.wait_for(lambda: self.check_running() or len(self._peers) >= count), timeout)
            except asyncio.TimeoutError:
                raise WeightSyncTimeout(f"timed out after {timeout:.3g}s waiting for {count} receivers ({len(self._peers)} connected)") from None

    async def close(self) -> None:
        """Say goodbye to the receivers, stop every task and close the socket."""
        if self._closed:
            return
        self._closed = True
        if self._socket is not None:
            for peer in list(self._peers.values()):
                try:
                    self.try_send(peer, self.stamp(Message(MessageType.BYE)))
                except PeerGone:
                    pass
        tasks = list(self._tasks)  # every pump, greeting and digest answer is among them
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._socket is not None:
            await self._socket.aclose()
        log.info("%s %s closed", self.role, self.session[:8])

    async def __aenter__(self: _Server) -> _Server:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- for the owner: what it serves ----------------------------------------------------
    def start(self, source: VersionSource, limits: Limits) -> None:
        """Bind the socket and serve what ``source`` holds; ``limits`` bound what receivers may send."""
        if self._socket is not None:
            raise WeightSyncError(f"{self.role} already started")
        self._source = source
        self._socket = RouterSocket(self._context, self._endpoint, curve=self.curve, limits=limits, on_reject=self._rejected)
        self.spawn(self._sessions.serve(self._socket), "serve")
        self.spawn(self._sessions.heartbeat(), "heartbeat")

    def moved(self, version: int | None) -> None:
        """The current version is now ``version`` (call under ``lock``); receivers behind
        it are served what ``publish_patch`` / ``publish_buckets`` give, or resynced."""
        self.version = version
        self._resync = self._digest = None
        if version is not None:
            self.deliveries.published(version, self._peers)
            if self.flips is not None and (self.flips.flipped is None or version > self.flips.flipped):
                self.flipped(self.flips.published(version, [p.name for p in self._peers.values()]))
        self.announce()
        self._wake_all()
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    def expect_patch(self, base: int | None) -> None:
        """A patch from ``base`` is being prepared: receivers at ``base`` wait for it
        (``publish_patch``) instead of being resynced."""
        self._ring.expect(base)

    def publish_patch(self, base: int | None, version: int, frames: list[Buffer], *, last: bool = True) -> None:
        """The next part of the patch from ``base`` to ``version`` is ready (``last``: its
        final one): receivers at ``base`` get it now, and the parts after it as they come.
        Parts are published in order, one patch at a time."""
        if self._ring.publish(base, version, frames, last):
            self._wake_all()

    def abandon_patch(self, base: int | None, version: int) -> None:
        """The patch from ``base`` to ``version`` will not be finished (its compare failed):
        out of the ring, and the pumps sending it stop. A receiver left with its first parts
        holds them, unwritten, until the next version resyncs it by bootstrap."""
        self._ring.abandon(base, version)

    def publish_buckets(self, version: int, messages: list[list[Buffer]]) -> None:
        """Bucket mode: every receiver behind ``version`` gets these messages."""
        self._bucket_frames = (version, messages)
        self._wake_all()

    def forget(self) -> None:
        """Drop the ring and the buckets (a new lineage, a bootstrap from upstream): every
        receiver behind the current version is resynced."""
        self._ring.clear()
        self._bucket_frames = None

    @property
    def buckets(self) -> tuple[int, list[list[Buffer]]] | None:
        """Bucket mode: the current version and its messages (``publish_buckets``)."""
        return self._bucket_frames

    def _wake_all(self) -> None:
        for peer in self._peers.values():
            peer.wake.set()

    def _rejected(self, address: str, public_key: str) -> None:
        """A receiver's CURVE key was refused (called from the ZAP thread, which logs it)."""
        self.rejected_handshakes += 1
        self.rejected_keys.add(public_key)

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        """Start a background task owned by this server: kept until it ends, cancelled and
        awaited by ``close``; one that fails fails the server (``check_running`` raises it
        to the owner, from ``sync``, ``wait_acked`` ...), logged."""
        task = asyncio.get_running_loop().create_task(coro, name=f"weightsync-{self.role}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._closed:
            return
        error = task.exception()
        if error is not None:
            log.error("%s task %s failed: %r", self.role, task.get_name(), error, exc_info=error)
            self._failure = error
            self.spawn(self.notify(), "notify")  # waiters (wait_acked, ...) raise it now

    async def notify(self) -> None:
        async with self._acked:
            self._acked.notify_all()

    def check_running(self) -> bool:
        """Raise why this server is not serving (failed, not started, closed); else False."""
        if self._failure is not None:
            raise WeightSyncError(f"{self.role} failed: {self._failure!r}") from self._failure
        if self._closed or self._socket is None:
            raise WeightSyncError(f"{self.role} is not running (call start(), and not after close())")
        return False

    # -- the version at rest ------------------------------------------------------------
    def release_resync(self) -> None:
        """Drop the cached bootstrap once every receiver has its version and none is joining
        or waiting for a resync: kept, it would hold a second copy of the model until the
        next version. A later joiner gets it rebuilt."""
        cached = self._resync
        if cached is None or cached[0] is None or self._sessions.greeting:
            return
        if all(p.acked is not None and p.acked >= cached[0] and not p.needs_resync for p in self._peers.values()):
            self._resync = None

    async def resync_messages(self) -> tuple[int | None, list[Message]]:
        """A bootstrap of the current version and that version, cached per version. A source
        that cannot build one now (``VersionSource.bootstrap``: None) is asked again each
        time the version moves, outside the lock (the move takes it): the bootstrap is then
        of a later version than the one current when this was called."""
        while True:
            async with self.lock:
                if self._resync is not None and self._resync[0] == self.version:
                    return self._resync
                built = await self.source.bootstrap(self.version)
                if built is not None:
                    self._resync = (self.version, built)
                    return self._resync
                moved = self._moved
            await moved.wait()

    async def state_digest(self) -> str | None:
        """Digest of the current version at the receivers' dtypes, as a receiver computes it."""
        async with self.lock:
            if self._digest is not None and self._digest[0] == self.version:
                return self._digest[1]
            digest = await self.source.digest(self.version)
            self._digest = (self.version, digest)
            return digest

    # -- for its parts (sessions.py, pump.py): sending, dropping, failing --------------
    def try_send(self, peer: Peer, frames: list[Buffer]) -> bool:
        """Queue ``frames`` for ``peer`` if its queue has room; ``PeerGone`` if it is registered and gone."""
        assert self._socket is not None
        try:
            queued = self._socket.try_send(peer.identity, frames)
        except PeerGone:
            if peer.identity in self._peers:
                raise
            return True  # not a registered peer (an ERROR to a stranger): nothing to undo
        if queued:
            self.bytes_sent += sum(len(f) for f in frames)
        return queued

    async def drop(self, peer: Peer, why: str) -> None:
        """Forget ``peer`` (if still registered), stop its pump and wake the waiters."""
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
            self.deliveries.left(peer.identity)
            if self.flips is not None:
                self.flipped(self.flips.left(peer.name))
            self.transfers.pop(peer.identity, None)
            log.info("receiver %s dropped: %s", peer.name, why, extra={"receiver": peer.name, "reason": why, "version": peer.acked})
            if peer.task is not None and peer.task is not asyncio.current_task():
                peer.task.cancel()
            await self.notify()

    def fail(self, error: BaseException) -> None:
        """Record what stops this server: ``check_running`` raises it to the owner from now on."""
        self._failure = error
