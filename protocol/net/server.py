"""Serving versions to receivers over a ROUTER: what the sender daemon and a relay share.

A ``VersionServer`` knows nothing of where versions come from. It is composed with a
``VersionSource`` (the trainer's, ``sender/source.py``; a relay's receiver,
``receiver/relay.py``) that answers what only the source knows: is this receiver's HELLO
acceptable and what WELCOME does it get (``admit``), what is a bootstrap of the current
version (``bootstrap``), what is its state digest (``digest``). Whoever owns the server
puts each new version in front of it (``moved``, ``publish_patch``, ``publish_buckets``).
The server does the rest: handshakes, one pump task per receiver bounded by credits
(versions in flight), so a slow or dead receiver never blocks the others, a ring of
recent patches to catch receivers up (each patch served part by part as its parts are
published, before the last one is encoded), resyncs by bootstrap, heartbeats, and timeouts.

A receiver that refuses a version (NACK) is resynced; one that refuses the resyncs too
gets each next one later (``resync_backoff``), and after ``max_resyncs`` in a row with no
ACK between, it is dropped with a ``ResyncLimitError`` (logged, and sent to it as an
ERROR): whole models are not sent forever to a receiver that will not take them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import zmq
import zmq.asyncio

from protocol.errors import (
    UNKNOWN_PEER,
    ConfigError,
    PeerGone,
    ProtocolError,
    ResyncLimitError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
)
from protocol.net.context import shared_context
from protocol.net.deliveries import Deliveries, ServerCounts
from protocol.net.heartbeat import ticks
from protocol.net.peers import Peer
from protocol.net.security import CurveServer, check_transport
from protocol.net.sockets import RouterSocket, TcpLink
from protocol.progress import Progress
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, Stamper, decode_message
from protocol.wire.limits import Limits
from protocol.wire.messages import Description, DigestReply, DigestRequest, ErrorReport, Hello, Nack, Welcome
from protocol.wire.metadata import ModelMetadata

log = logging.getLogger(__name__)

_Server = TypeVar("_Server", bound="VersionServer")


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


WATCH_EVERY = 0.25  # seconds between reads of a receiver's TCP counters while a whole model goes to it
WATCH_LIMIT = 3600.0  # seconds a transfer's progress is followed at most


class VersionSource(Protocol):
    """What a ``VersionServer`` asks of where its versions come from. ``admit``,
    ``bootstrap`` and ``digest`` are called under the server's ``lock``: the version at
    rest does not move while they run."""

    async def admit(self, hello: Hello) -> Welcome:
        """Check a receiver's HELLO; the WELCOME it gets (the server fills in the bootstrap
        size). Raise a ``WeightSyncError`` to refuse it: it is sent to the receiver."""
        ...

    async def bootstrap(self, version: int | None) -> list[Message] | None:
        """The BOOTSTRAP messages of ``version``, the current one; None where they cannot be
        built now (a sharded trainer's are gathered at its next version, in lockstep): the
        server asks again once the version has moved, for that version."""
        ...

    async def digest(self, version: int | None) -> str | None:
        """The state digest of ``version``, the current one, at the receivers' dtypes; None
        where it is not known (a receiver claiming the version is then resynced)."""
        ...

    def describe(self) -> ModelMetadata | None:
        """The keys and shapes a receiver must declare in HELLO, with the dtypes held here
        (None before there is a model). A receiver that derives its own layout from the
        trainer's names asks for them first (``receiver.vllm``)."""
        ...


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
        self.ring_size, self.ring_bytes, self.max_inflight = ring_size, ring_bytes, max_inflight
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self._context = context or shared_context()
        self.stamp = Stamper()
        self.version: int | None = None
        self._ring: collections.deque[RingEntry] = collections.deque(maxlen=ring_size)
        self._pending_bases: set[int | None] = set()  # bases of patches still being prepared
        self._bucket_frames: tuple[int, list[list[Buffer]]] | None = None  # bucket mode: the current version's messages
        self._resync: tuple[int | None, list[Message]] | None = None
        self._moved = asyncio.Event()  # set (and replaced) each time the version moves: deferred bootstraps retry
        self.counts = ServerCounts()  # resyncs and NACKs, for metrics
        self.deliveries = Deliveries()  # publication and delivery times, receivers' lag (set its on_delivered)
        self.transfers: dict[bytes, Progress] = {}  # whole models going to receivers now, by identity (metrics)
        self._digest: tuple[int | None, str | None] | None = None
        self._peers: dict[bytes, Peer] = {}
        self._greeting: dict[bytes, asyncio.Task[None]] = {}  # HELLOs being answered
        self.lock = asyncio.Lock()  # the version at rest: new versions vs bootstraps and digests
        self._acked = asyncio.Condition()
        self._socket: RouterSocket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None
        self._closed = False

    # -- public API -----------------------------------------------------------------
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
                    self._try_send(peer, self.stamp(Message(MessageType.BYE)))
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
        self.spawn(self._serve(), "serve")
        self.spawn(self._heartbeat(), "heartbeat")

    def moved(self, version: int | None) -> None:
        """The current version is now ``version`` (call under ``lock``); receivers behind
        it are served what ``publish_patch`` / ``publish_buckets`` give, or resynced."""
        self.version = version
        self._resync = self._digest = None
        if version is not None:
            self.deliveries.published(version, self._peers)
        self._wake_all()
        moved, self._moved = self._moved, asyncio.Event()
        moved.set()

    def expect_patch(self, base: int | None) -> None:
        """A patch from ``base`` is being prepared: receivers at ``base`` wait for it
        (``publish_patch``) instead of being resynced."""
        self._pending_bases.add(base)

    def publish_patch(self, base: int | None, version: int, frames: list[Buffer], *, last: bool = True) -> None:
        """The next part of the patch from ``base`` to ``version`` is ready (``last``: its
        final one): receivers at ``base`` get it now, and the parts after it as they come.
        Parts are published in order, one patch at a time."""
        newest = self._ring[-1] if self._ring else None
        if newest is not None and not newest.complete and (newest.base, newest.version) == (base, version):
            newest.add(frames, last)
            self._trim_ring()
            return
        self._ring.append(RingEntry(base, version, [frames], complete=last))
        self._pending_bases.discard(base)
        self._trim_ring()
        self._wake_all()

    def abandon_patch(self, base: int | None, version: int) -> None:
        """The patch from ``base`` to ``version`` will not be finished (its compare failed):
        out of the ring, and the pumps sending it stop. A receiver left with its first parts
        holds them, unwritten, until the next version resyncs it by bootstrap."""
        self._pending_bases.discard(base)
        newest = self._ring[-1] if self._ring else None
        if newest is not None and not newest.complete and (newest.base, newest.version) == (base, version):
            self._ring.pop()
            newest.abandon()

    def _trim_ring(self) -> None:
        """Drop the oldest patches past ``ring_bytes`` (the newest always stays: receivers
        at its base need it). A pump already sending one holds its frames until it is done."""
        if self.ring_bytes is None:
            return
        total = 0
        for kept, entry in enumerate(reversed(self._ring)):
            total += entry.nbytes
            if kept and total > self.ring_bytes:
                for _ in range(len(self._ring) - kept):
                    self._ring.popleft()
                return

    def publish_buckets(self, version: int, messages: list[list[Buffer]]) -> None:
        """Bucket mode: every receiver behind ``version`` gets these messages."""
        self._bucket_frames = (version, messages)
        self._wake_all()

    def forget(self) -> None:
        """Drop the ring and the buckets (a new lineage, a bootstrap from upstream): every
        receiver behind the current version is resynced."""
        self._ring.clear()
        self._bucket_frames = None

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
            self.spawn(self._notify(), "notify")  # waiters (wait_acked, ...) raise it now

    async def _notify(self) -> None:
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
    def _release_resync(self) -> None:
        """Drop the cached bootstrap once every receiver has its version and none is joining
        or waiting for a resync: kept, it would hold a second copy of the model until the
        next version. A later joiner gets it rebuilt."""
        cached = self._resync
        if cached is None or cached[0] is None or self._greeting:
            return
        if all(p.acked is not None and p.acked >= cached[0] and not p.needs_resync for p in self._peers.values()):
            self._resync = None

    async def _resync_messages(self) -> tuple[int | None, list[Message]]:
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

    async def _state_digest(self) -> str | None:
        """Digest of the current version at the receivers' dtypes, as a receiver computes it."""
        async with self.lock:
            if self._digest is not None and self._digest[0] == self.version:
                return self._digest[1]
            digest = await self.source.digest(self.version)
            self._digest = (self.version, digest)
            return digest

    # -- serving ----------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            identity, frames, source = await self._socket.recv()
            try:
                msg = decode_message(frames)
            except WeightSyncError as e:
                log.warning("dropping a bad message from %r: %s", identity, e)
                continue
            peer = self._peers.get(identity)
            if peer is not None:
                peer.heard(source)
            request: DigestRequest | None = None
            if msg.type is MessageType.DIGEST_REQUEST:
                try:
                    request = DigestRequest.from_body(msg.body)
                except ProtocolError as e:
                    log.warning("dropping a bad message from %r: %s", identity, e)
                    continue
            if msg.type is MessageType.HELLO:
                # Handled in its own task: a bootstrap can take a while to build, and the
                # other receivers' acks and heartbeats must keep flowing meanwhile.
                previous = self._greeting.pop(identity, None)
                if previous is not None:
                    previous.cancel()
                self._greeting[identity] = self.spawn(self._on_hello(identity, msg, source), f"hello-{identity!r}")
            elif peer is None and request is not None and request.metadata is True:
                self._describe_to(identity, request)  # before HELLO: what a receiver must declare
            elif peer is None:
                if identity in self._greeting:
                    continue  # its HELLO is being answered: heartbeats meanwhile are expected
                if msg.type is not MessageType.BYE:  # e.g. after a restart: ask it to say HELLO
                    self._try_send(Peer(identity), self.stamp(ErrorReport(UNKNOWN_PEER, "say HELLO").to_message()))
            elif msg.type in (MessageType.ACK, MessageType.HEARTBEAT):
                below_changed = peer.report_below(msg.body)
                # Heartbeats repeat the applied version, so a lost ACK is never waited on forever.
                if msg.version is not None and (peer.acked is None or msg.version > peer.acked):
                    peer.ack(msg.version)
                    self.deliveries.acked(peer.identity, msg.version)
                    await self._notify()
                elif msg.type is MessageType.ACK:
                    peer.ack(msg.version)
                if msg.type is MessageType.ACK:  # it applied something: its resyncs start afresh
                    peer.refused = 0
                if below_changed:
                    await self._notify()
                self._release_resync()
            elif msg.type is MessageType.NACK:
                log.warning("receiver %s rejected an update at v%s: %s", peer.name, msg.version, _reported(Nack, msg),
                            extra={"receiver": peer.name, "version": msg.version})
                self.counts.nack(_reason(msg))
                peer.ack(msg.version)
                peer.inflight.clear()  # it drops whatever else is queued until the resync
                peer.needs_resync = True
            elif request is not None:
                self.spawn(self._answer_digest(peer, request), f"digest-{peer.name}")
            elif msg.type is MessageType.BYE:
                await self._drop(peer, "said goodbye")
            elif msg.type is MessageType.ERROR:
                log.error("receiver %s reported: %s", peer.name, _reported(ErrorReport, msg))

    def _describe_to(self, identity: bytes, request: DigestRequest) -> None:
        reply = Description(request.nonce, self.source.describe())
        try:
            self._try_send(Peer(identity), self.stamp(reply.to_message(self.version)))
        except PeerGone:
            pass

    async def _answer_digest(self, peer: Peer, request: DigestRequest) -> None:
        """Tell a receiver the current version and, when asked, its state digest: what a
        paused receiver updates to, and what ``verify_checksum`` compares against."""
        version, digest = self.version, None
        if request.digest is True:
            for _ in range(3):  # a new version may arrive meanwhile: the pair must be consistent
                version = self.version
                try:
                    digest = await self._state_digest()
                except WeightSyncError as e:  # none now (a relay asleep): the answer says so, the server carries on
                    log.info("%s has no digest of v%s for receiver %s: %s", self.role, version, peer.name, e)
                    digest = None
                    break
                if self.version == version:
                    break
            else:
                digest = None
        reply = DigestReply(request.nonce, digest).to_message(version)
        try:
            self._try_send(peer, self.stamp(reply))
        except PeerGone:
            await self._drop(peer, "disconnected")

    async def _on_hello(self, identity: bytes, hello: Message, source: int) -> None:
        old = self._peers.pop(identity, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        peer = Peer(identity)
        peer.heard(source)
        try:
            await self._greet(peer, hello)
        except WeightSyncError as e:  # this receiver cannot be served; the others carry on
            log.error("receiver %s refused: %s", peer.name, e)
            self._try_send(peer, self.stamp(ErrorReport.of(e).to_message()))
        finally:
            if self._greeting.get(identity) is asyncio.current_task():
                del self._greeting[identity]

    async def _greet(self, peer: Peer, hello: Message) -> None:
        identity = peer.identity
        said = Hello.from_body(hello.body)
        async with self.lock:  # a new version must not move what is at rest mid-check
            welcome = await self.source.admit(said)
        applied, digest, session = said.applied, said.digest, said.session
        known = {self.version} | {e.base for e in self._ring} | self._pending_bases
        greeting: list[Message]
        if session == self.session and applied in known:
            greeting, version = [], applied  # it was with us: the ring catches it up
        elif applied == self.version and self.version is not None and digest is not None and digest == await self._state_digest():
            greeting, version = [], applied  # already current (e.g. after a restart)
        else:
            version, greeting = await self._resync_messages()
        welcome_message = replace(welcome, bootstrap=len(greeting)).to_message(version)
        peer.sent = version
        peer.acked = None if greeting else version
        peer.inflight = [version] if greeting else []
        self._peers[identity] = peer
        peer.task = self.spawn(self._pump(peer, [welcome_message, *greeting]), f"pump-{peer.name}")
        log.info("receiver %s joined at v%s (bootstrap: %d buckets)", peer.name, applied, len(greeting),
                 extra={"receiver": peer.name, "version": version, "applied": applied, "bootstrap_buckets": len(greeting)})
        await self._notify()

    async def _pump(self, peer: Peer, greeting: list[Message]) -> None:
        """Send ``peer`` what it is missing, never more than ``max_inflight`` versions ahead.

        A pump never ends with its peer still registered: a receiver that cannot be served
        (a ``WeightSyncError``: resyncs refused too often, a bootstrap this server cannot
        build now) is dropped and sent the error; anything else (a bug, or a ``TransportError``:
        this server's own socket failed) drops the peer and fails the server (``_spawn``)."""
        try:
            await self._deliver_all(peer, [self.stamp(m) for m in greeting], "bootstrap" if len(greeting) > 1 else "")
            # A bootstrap is a whole model copy: this coroutine lives as long as the peer,
            # so it keeps no reference to what it has queued (ZeroMQ holds what it still needs).
            del greeting
            while True:
                while len(peer.inflight) < self.max_inflight:
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
            await self._drop(peer, "disconnected")
        except TransportError as e:  # this server's socket failed, not one receiver: it fails the server
            self._failure = e
            await self._drop(peer, f"its pump failed: {e!r}")
            raise
        except WeightSyncError as e:
            log.error("%s cannot serve receiver %s: %s: %s", self.role, peer.name, type(e).__name__, e)
            with contextlib.suppress(PeerGone):
                self._try_send(peer, self.stamp(ErrorReport.of(e).to_message()))
            await self._drop(peer, f"{type(e).__name__}: {e}")
        except Exception as e:
            self._failure = e  # before the drop wakes the waiters: they must see it, not one receiver fewer
            await self._drop(peer, f"its pump failed: {e!r}")
            raise

    async def _next_for(self, peer: Peer) -> tuple[int | None, RingEntry | list[list[Buffer]]] | None:
        if not peer.needs_resync:
            for entry in self._ring:  # from the current version too: a patch whose first parts are out
                if entry.base == peer.sent:
                    return entry.version, entry
            if peer.sent == self.version:
                return None
            if peer.sent in self._pending_bases:
                return None  # its next patch is being prepared; publish_patch wakes it
            if self._bucket_frames is not None and (peer.sent is None or peer.sent < self._bucket_frames[0]):
                return self._bucket_frames
        if peer.needs_resync:  # it NACKed: resync, later each time it refuses again, and not forever
            if peer.refused >= self.max_resyncs:
                raise ResyncLimitError(
                    f"receiver {peer.name} refused {peer.refused} resyncs in a row (this {self.role} is at v{self.version}); "
                    "dropped, see its log for why it rejects them"
                )
            if peer.refused:
                first, largest = self.resync_backoff
                await asyncio.sleep(min(first * 2 ** (peer.refused - 1), largest))
            peer.refused += 1
        peer.needs_resync = False
        peer.resyncs += 1
        self.counts.resyncs += 1
        log.info("resyncing receiver %s from v%s to v%s", peer.name, peer.acked, self.version,
                 extra={"receiver": peer.name, "version": self.version, "from_version": peer.acked})
        version, messages = await self._resync_messages()  # (a deferred one is of a later version)
        return version, [self.stamp(m) for m in messages]

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
        progress = Progress(log, f"{self.role} sending {what or 'messages'} to receiver {peer.name}", total, peer=peer.name)
        self.transfers[peer.identity] = progress
        link = peer.link
        start = None if link is None else link.counts()
        if link is not None and start is not None:
            self.spawn(self._watch(peer, link, start[0], progress), f"progress-{peer.name}")
        for frames in messages:
            await self._deliver(peer, frames)
            if start is None:
                progress.advance(sum(len(f) for f in frames))
        if start is None:
            self._finished(peer, progress)

    def _finished(self, peer: Peer, progress: Progress) -> None:
        progress.finish()
        if self.transfers.get(peer.identity) is progress:
            del self.transfers[peer.identity]

    async def _watch(self, peer: Peer, link: TcpLink, start: int, progress: Progress) -> None:
        """``progress`` of a transfer to ``peer`` as its kernel acknowledges our bytes, until
        all are (heartbeats counted too: a bound, not a byte count), the connection closes or
        the peer leaves; polled at most 4 times a second, for at most ``WATCH_LIMIT``."""
        total = progress.total or 0
        done = 0
        deadline = time.monotonic() + WATCH_LIMIT
        while self._peers.get(peer.identity) is peer and peer.link is link and time.monotonic() < deadline:
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
        while not self._try_send(peer, frames):
            if time.monotonic() - peer.last_seen > self.peer_timeout:
                raise PeerGone(peer.name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    def _try_send(self, peer: Peer, frames: list[Buffer]) -> bool:
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

    async def _drop(self, peer: Peer, why: str) -> None:
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
            self.deliveries.left(peer.identity)
            self.transfers.pop(peer.identity, None)
            log.info("receiver %s dropped: %s", peer.name, why, extra={"receiver": peer.name, "reason": why, "version": peer.acked})
            if peer.task is not None and peer.task is not asyncio.current_task():
                peer.task.cancel()
            await self._notify()

    async def _heartbeat(self) -> None:
        async for now, stalled in ticks(self.heartbeat_interval):  # a stalled tick judges no silence
            for peer in list(self._peers.values()):
                if (silent := peer.silence(now, self.heartbeat_interval)) > self.peer_timeout and not stalled:
                    await self._drop(peer, f"silent for {silent:.1f}s")
                    continue
                try:
                    self._try_send(peer, self.stamp(Message(MessageType.HEARTBEAT, version=self.version)))
                except PeerGone:
                    await self._drop(peer, "disconnected")
            # A HELLO being answered (a large model's snapshot, kernels compiled on a cold
            # start) can take longer than the receiver's peer_timeout: it must hear that we
            # are alive, or it reconnects and its new HELLO starts the answer over.
            for identity in [i for i in self._greeting if i not in self._peers]:
                self._try_send(Peer(identity), self.stamp(Message(MessageType.HEARTBEAT, version=self.version)))


def _reason(msg: Message) -> str:
    """A NACK's reason (untrusted: ``ServerCounts.nack`` bounds it), "unreadable" if it has none."""
    try:
        return Nack.from_body(msg.body).reason
    except ProtocolError:
        return "unreadable"


def _reported(record: type[Nack] | type[ErrorReport], msg: Message) -> str:
    """The text a receiver's NACK or ERROR carries, for the log (a malformed one says so)."""
    try:
        return record.from_body(msg.body).message
    except ProtocolError as e:
        return f"(unreadable: {e})"
