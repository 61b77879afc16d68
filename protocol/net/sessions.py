"""A version server's side of each receiver's session: its HELLO answered (in a task of its
own, the receiver registered and its pump started), what it sends handled (ACKs and
heartbeats, NACKs: a resync follows, digest and description requests, goodbyes, errors),
heartbeats sent to it, and its silence judged. What it is sent of the versions is its pump's."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from protocol.errors import UNKNOWN_PEER, ConfigError, PeerGone, ProtocolError, WeightSyncError
from protocol.net.deliveries import Deliveries, ServerCounts
from protocol.net.flips import Flip, Flips
from protocol.net.heartbeat import ticks
from protocol.net.peers import Peer
from protocol.net.pump import Pump
from protocol.net.ring import PatchRing
from protocol.net.sockets import RouterSocket
from protocol.net.source import VersionSource
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, Stamper, decode_message
from protocol.wire.messages import BEHIND, LOST, Ack, Description, DigestReply, DigestRequest, ErrorReport, Hello, Nack

log = logging.getLogger(__name__)


class SessionsHost(Protocol):
    """The version server as its receivers' sessions see it (``VersionServer``)."""

    role: str
    stamp: Stamper
    version: int | None
    heartbeat_interval: float
    peer_timeout: float
    counts: ServerCounts
    deliveries: Deliveries
    lock: asyncio.Lock

    @property
    def session(self) -> str: ...

    @property
    def source(self) -> VersionSource: ...

    @property
    def latest(self) -> int | None: ...

    flips: Flips | None

    def beat(self) -> Message: ...

    def flipped(self, decided: list[Flip]) -> None: ...

    def spawn(self, coro: Any, name: str) -> asyncio.Task[None]: ...

    def try_send(self, peer: Peer, frames: list[Buffer]) -> bool: ...

    async def drop(self, peer: Peer, why: str) -> None: ...

    async def notify(self) -> None: ...

    def release_resync(self) -> None: ...

    async def resync_messages(self) -> tuple[int | None, list[Message]]: ...

    async def state_digest(self) -> str | None: ...


class Sessions:
    """Reads ``server``'s socket (``serve``) and answers each receiver: registers it in
    ``peers`` (the server's own records) once its HELLO is answered, then ``pump`` serves it;
    beats and judges silence (``heartbeat``)."""

    def __init__(self, server: SessionsHost, peers: dict[bytes, Peer], ring: PatchRing, pump: Pump) -> None:
        self._server = server
        self._peers = peers
        self._ring = ring
        self._pump = pump
        self.greeting: dict[bytes, asyncio.Task[None]] = {}  # HELLOs being answered

    async def serve(self, socket: RouterSocket) -> None:
        """Handle every message that arrives on ``socket``, the server's ROUTER."""
        server = self._server
        while True:
            identity, frames, source = await socket.recv()
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
                previous = self.greeting.pop(identity, None)
                if previous is not None:
                    previous.cancel()
                self.greeting[identity] = server.spawn(self._on_hello(identity, msg, source), f"hello-{identity!r}")
            elif peer is None and request is not None and request.metadata is True:
                self._describe_to(identity, request)  # before HELLO: what a receiver must declare
            elif peer is None:
                if identity in self.greeting:
                    continue  # its HELLO is being answered: heartbeats meanwhile are expected
                if msg.type is not MessageType.BYE:  # e.g. after a restart: ask it to say HELLO
                    server.try_send(Peer(identity), server.stamp(ErrorReport(UNKNOWN_PEER, "say HELLO").to_message()))
            elif msg.type in (MessageType.ACK, MessageType.HEARTBEAT):
                below_changed = peer.report_below(msg.body)
                if server.flips is not None and (ack := _ack(msg)) is not None:
                    if ack.below is not None and not peer.subtree:
                        await self._refuse_old_relay(peer)
                        continue
                    if ack.staged is not None:
                        server.flipped(server.flips.staged(peer.name, ack.staged, below=ack.missing))
                # Heartbeats repeat the applied version, so a lost ACK is never waited on forever.
                if msg.version is not None and (peer.acked is None or msg.version > peer.acked):
                    peer.ack(msg.version)
                    server.deliveries.acked(peer.identity, msg.version)
                    await server.notify()
                elif msg.type is MessageType.ACK:
                    peer.ack(msg.version)
                if msg.type is MessageType.ACK:  # it applied something: its resyncs start afresh
                    peer.refused = 0
                if below_changed:
                    await server.notify()
                server.release_resync()
            elif msg.type is MessageType.NACK and _reason(msg) == BEHIND:
                self._behind(peer, msg.version)
            elif msg.type is MessageType.NACK:
                what = "lost what was sent again, asks for a resync" if _reason(msg) == LOST else "rejected an update"
                log.warning("receiver %s %s at v%s: %s", peer.name, what, msg.version, _reported(Nack, msg),
                            extra={"receiver": peer.name, "version": msg.version})
                server.counts.nack(_reason(msg))
                peer.ack(msg.version)
                peer.inflight.clear()  # it drops whatever else is queued until the resync
                peer.needs_resync = True
            elif request is not None:
                server.spawn(self._answer_digest(peer, request), f"digest-{peer.name}")
            elif msg.type is MessageType.BYE:
                await server.drop(peer, "said goodbye")
            elif msg.type is MessageType.ERROR:
                log.error("receiver %s reported: %s", peer.name, _reported(ErrorReport, msg))

    async def _refuse_old_relay(self, peer: Peer) -> None:
        """A relay that predates ``Hello.subtree`` reports a version staged before the
        receivers below it have: a flip would go before them. Refused, and told why."""
        server = self._server
        error = ConfigError(f"this {server.role} commits versions together (commit='together') through relays: relay {peer.name} "
                            "reports a version staged before its own receivers have (it predates that); upgrade it")
        log.error("receiver %s refused: %s", peer.name, error)
        try:
            server.try_send(peer, server.stamp(ErrorReport.of(error).to_message()))
        except PeerGone:
            pass
        await server.drop(peer, "a relay that predates flips through relays")

    def _behind(self, peer: Peer, version: int | None) -> None:
        """``peer`` holds ``version`` and heard of a later one it never received (a message
        lost with a connection): what it was sent after ``version`` is sent again, from the
        ring, or else a resync. Acting on it twice is harmless: a receiver drops versions it holds."""
        now = time.monotonic()
        if peer.needs_resync or version is None or (peer.acked is not None and version < peer.acked):
            return  # a resync is coming anyway, or the ask is older than what it acknowledged since
        if now - peer.behind_at < self._server.heartbeat_interval:
            return  # bounded work: one ask a heartbeat interval, however many arrive
        peer.behind_at = now
        log.info("receiver %s is behind at v%s (this %s is at v%s): sending what follows again", peer.name, version,
                 self._server.role, self._server.version, extra={"receiver": peer.name, "version": version})
        self._server.counts.behind += 1
        peer.ack(version)
        if peer.sent is not None and (peer.resend_to is None or peer.sent > peer.resend_to):
            peer.resend_to = peer.sent  # what its pump sends again up to this version is a resend (counted there)
        peer.sent = version
        peer.inflight.clear()
        peer.wake.set()

    def _describe_to(self, identity: bytes, request: DigestRequest) -> None:
        reply = Description(request.nonce, self._server.source.describe())
        try:
            self._server.try_send(Peer(identity), self._server.stamp(reply.to_message(self._server.version)))
        except PeerGone:
            pass

    async def _answer_digest(self, peer: Peer, request: DigestRequest) -> None:
        """Tell a receiver the current version and, when asked, its state digest: what a
        paused receiver updates to, and what ``verify_checksum`` compares against."""
        server = self._server
        version, digest = server.version, None
        if request.digest is True:
            for _ in range(3):  # a new version may arrive meanwhile: the pair must be consistent
                version = server.version
                try:
                    digest = await server.state_digest()
                except WeightSyncError as e:  # none now (a relay asleep): the answer says so, the server carries on
                    log.info("%s has no digest of v%s for receiver %s: %s", server.role, version, peer.name, e)
                    digest = None
                    break
                if server.version == version:
                    break
            else:
                digest = None
        latest = server.latest
        reply = DigestReply(request.nonce, digest, None if latest == version else latest).to_message(version)
        try:
            server.try_send(peer, server.stamp(reply))
        except PeerGone:
            await server.drop(peer, "disconnected")

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
            self._server.try_send(peer, self._server.stamp(ErrorReport.of(e).to_message()))
        finally:
            if self.greeting.get(identity) is asyncio.current_task():
                del self.greeting[identity]

    async def _greet(self, peer: Peer, hello: Message) -> None:
        server = self._server
        identity = peer.identity
        said = Hello.from_body(hello.body)
        if server.flips is not None and not said.flip:
            raise ConfigError(f"this {server.role} commits versions together (commit='together'): receiver {peer.name} cannot stage "
                              "a version and wait for the word to commit it (it predates that); upgrade it")
        async with server.lock:  # a new version must not move what is at rest mid-check
            welcome = await server.source.admit(said)
        applied, digest, session = said.applied, said.digest, said.session
        known = {server.version} | self._ring.bases()
        greeting: list[Message]
        if session == server.session and applied in known:
            greeting, version = [], applied  # it was with us: the ring catches it up
        elif applied == server.version and server.version is not None and digest is not None and digest == await server.state_digest():
            greeting, version = [], applied  # already current (e.g. after a restart)
        else:
            version, greeting = await server.resync_messages()
        flips = server.flips
        timeout = None if flips is None else flips.stage_timeout
        welcome_message = replace(welcome, bootstrap=len(greeting), together=flips is not None, stage_timeout=timeout).to_message(version)
        peer.subtree = said.subtree
        peer.sent = version
        peer.acked = None if greeting else version
        peer.inflight = [version] if greeting else []
        self._peers[identity] = peer
        peer.task = server.spawn(self._pump.run(peer, [welcome_message, *greeting]), f"pump-{peer.name}")
        log.info("receiver %s joined at v%s (bootstrap: %d buckets)", peer.name, applied, len(greeting),
                 extra={"receiver": peer.name, "version": version, "applied": applied, "bootstrap_buckets": len(greeting)})
        await server.notify()

    async def heartbeat(self) -> None:
        """Beat to every receiver, and to those whose HELLO is being answered; drop the silent."""
        server = self._server
        async for now, stalled in ticks(server.heartbeat_interval):  # a stalled tick judges no silence
            if server.flips is not None:
                server.flipped(server.flips.due(now))
            for peer in list(self._peers.values()):
                if (silent := peer.silence(now, server.heartbeat_interval)) > server.peer_timeout and not stalled:
                    await server.drop(peer, f"silent for {silent:.1f}s")
                    continue
                try:
                    server.try_send(peer, server.stamp(server.beat()))
                except PeerGone:
                    await server.drop(peer, "disconnected")
            # A HELLO being answered (a large model's snapshot, kernels compiled on a cold
            # start) can take longer than the receiver's peer_timeout: it must hear that we
            # are alive, or it reconnects and its new HELLO starts the answer over.
            for identity in [i for i in self.greeting if i not in self._peers]:
                server.try_send(Peer(identity), server.stamp(server.beat()))


def _ack(msg: Message) -> Ack | None:
    """An ACK's or a receiver's HEARTBEAT's body (``Ack.staged``, ``below``); None if unreadable."""
    try:
        return Ack.from_body(msg.body, msg.type)
    except ProtocolError:
        return None


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
