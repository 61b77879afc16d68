"""A receiver's session loop: follows one upstream at a time, applying its versions.

Each connection is a ``Session`` (``receiver/session/session.py``); lost ones (nothing heard within
``peer_timeout``: no message, and over TCP no byte) are re-established with backoff,
resuming from the applied version, at the next of the ``Upstreams``. A session says HELLO,
takes the handshake (a bootstrap, if one is needed), then receives, gates and commits
versions, publishing each (ACK, ``on_update`` hooks, waiters). ``Receiver``
(``receiver/control/service.py``) owns one ``Follower`` and runs ``run`` as its task; the control
calls reach it through ``ControlState`` (what the loop asks) and the calls below.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import zmq.asyncio

from protocol.errors import (
    ConfigError,
    IntegrityError,
    LimitError,
    MetadataMismatchError,
    ProtocolError,
    ResyncLimitError,
    StaleVersionError,
)
from protocol.net.security import CurveClient
from protocol.progress import Progress
from protocol.state import StateLike, state_tensors
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, peek_type
from protocol.wire.limits import Limits
from protocol.wire.messages import BEHIND, Ack, ErrorReport, Nack

from ..apply.digest import digest_of
from ..lifecycle import ControlState
from ..metrics import ReceiverMetrics
from ..naming import NameMapping
from ..rwlock import ReadWriteLock
from ..stats import ApplyStats
from ..strategy.base import ReceiverBase
from ..strategy.pending import PendingVersion
from .incoming import WHOLE_MODEL, Incoming, model_bytes
from .lag import LagWatch, Latest
from .relay import Relay
from .session import Foreign, Leave, Reconnect, Session
from .updates import UpdateHooks
from .upstreams import Upstreams

log = logging.getLogger(__name__)

_REJECTED = (StaleVersionError, ProtocolError, IntegrityError)  # the sender can fix these with a resync
_FATAL = (MetadataMismatchError, ConfigError, ResyncLimitError)  # reconnecting would not help
FOREIGN_BACKOFF = 30.0  # seconds, at most, between tries of an upstream that is not a weightsync sender
HANDSHAKE_GRACE = 60.0  # seconds past peer_timeout for each message of a handshake (``_handshake``)
TRICKLE_BPS = 4096  # bytes a second that heartbeats alone never reach: more is a message in progress


class Wait(Protocol):
    """The receiver's wait: until ``predicate()`` holds, re-checked on each notification;
    ``fail``: raise once the receiver failed or closed."""

    def __call__(self, predicate: Callable[[], bool], timeout: float | None, *, fail: bool = True, what: str = "") -> Awaitable[None]: ...


@dataclass(frozen=True)
class Settings:
    """How each session connects and waits, fixed for the receiver's life (its arguments)."""

    identity: str
    heartbeat_interval: float
    peer_timeout: float
    reconnect_backoff: tuple[float, float]
    context: zmq.asyncio.Context
    curve: CurveClient | None
    limits: Limits
    hold: bool
    stats_history: int


@dataclass(frozen=True)
class Owner:
    """What a follower uses of the receiver that owns it: the strategy it commits through,
    the synced state and its lock, and the receiver's waiters, failure, metrics, relay and
    names. The strategy and the metrics are built after the follower (the strategy's
    commit gate is ``hold_bootstrap``; the metrics read the follower's state), so asked for."""

    strategy: Callable[[], ReceiverBase]
    state: Callable[[], StateLike]
    lock: ReadWriteLock
    wait: Wait
    notify: Callable[[], Awaitable[None]]
    fail: Callable[[BaseException], None]  # before waiters are woken: they raise it
    metrics: Callable[[], ReceiverMetrics]
    relay: Relay | None
    names: NameMapping | None


class Follower:
    """The session machinery of one receiver: its loop (``run``) and what it knows of the
    connection, which the control calls read and end (``receiver/control/controlled.py``)."""

    def __init__(self, settings: Settings, upstreams: Upstreams, lifecycle: ControlState, owner: Owner) -> None:
        self.settings, self.upstreams, self.lifecycle, self._owner = settings, upstreams, lifecycle, owner
        self.stats: collections.OrderedDict[int, ApplyStats] = collections.OrderedDict()
        self.updates = UpdateHooks(settings.identity)  # on_update's, told in their own task: the session never waits for them
        self.pending_version: int | None = None  # being received or applied now
        self.connected = False
        self.reconnects = 0
        self.handshakes = 0
        self.ready = asyncio.Event()  # the first handshake is done
        self.link: Session | None = None  # the connection to the upstream, while there is one
        self.in_session = False
        self.handshaking = False
        self.last_bootstrap: ApplyStats | None = None
        # the trainer's latest version as heard (``Receiver.reading(max_lag=...)``), and when to ask for one never received
        self.latest = Latest(settings.heartbeat_interval)
        self.lag = LagWatch(settings.heartbeat_interval, settings.peer_timeout)
        self._receiving = False  # a version's messages are arriving, or it is being decoded
        self._arriving = False  # a version written on arrival passed its gate; its later parts are still to come
        self._awaiting_resync = False  # a NACK was sent: the resync it asked for is coming
        self._staged: int | None = None  # commit="together": the version staged, waiting for its flip
        if owner.relay is not None:  # its receivers done staging: what this one holds staged is reported at once
            owner.relay.tell_upstream = self._report_staged

    @property
    def version(self) -> int | None:
        return self._owner.strategy().version

    async def run(self) -> None:
        """Sessions, one after another, until a fatal error (raised) or cancellation."""
        identity, backoff, owner = self.settings.identity, self.settings.reconnect_backoff, self._owner
        delay, cap = backoff[0], backoff[1]
        told: set[str] = set()  # upstreams already named as not a weightsync sender
        while True:
            await owner.wait(self.lifecycle.may_connect, None, fail=False)  # paused or asleep: no new session
            handshakes = self.handshakes
            try:
                await self._session()
            except Leave:
                self.connected = False
                log.info("receiver %s left the sender", identity)
                await owner.notify()
                continue
            except Foreign as e:
                cap = max(backoff[1], FOREIGN_BACKOFF)
                endpoint = str(self.upstreams.endpoint)
                level = logging.DEBUG if endpoint in told else logging.ERROR
                told.add(endpoint)
                log.log(level, "receiver %s: %s; trying again with a backoff of up to %.0fs (said once)", identity, e, cap)
            except Reconnect as e:
                log.warning("receiver %s: %s; reconnecting in %.2fs", identity, e, delay)
            except _FATAL as e:
                owner.fail(e)
                await owner.notify()
                raise
            finally:
                self.connected = False
            await owner.notify()
            self.reconnects += 1
            self.upstreams.lost()
            if self.handshakes != handshakes:  # that session worked: start backing off afresh
                delay, cap = backoff[0], backoff[1]
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap)

    async def _session(self) -> None:
        """One connection: HELLO (with the digest, computed first: HELLO must be the first
        message of a session, before any heartbeat), the handshake, then versions until
        the session ends (``Reconnect``, ``Leave``, or an error)."""
        s = self.settings
        self.in_session = self.handshaking = True
        # From here on, leave_session can end this session.
        self.latest.reset()  # another upstream, or a restarted one, may number its versions anew
        link = self.link = Session(
            s.identity, heartbeat=lambda: (self.version, self._report()),
            heartbeat_interval=s.heartbeat_interval, peer_timeout=s.peer_timeout,
            latest=self.latest, news=self._owner.notify, tick=self._tick,
        )
        goodbye: Message | None = None
        try:
            digest = await self.digest() if self.version is not None else None
            link.open(s.context, await self.upstreams.find(s.peer_timeout), curve=s.curve, limits=s.limits)
            try:
                await self._handshake(link, digest)
            except LimitError:
                raise  # this receiver's limits refuse the sender's bootstrap: asking again would not help
            except _REJECTED as e:  # a bootstrap that arrived damaged: ask again, from HELLO
                raise Reconnect(f"the handshake failed: {type(e).__name__}: {e}") from e
            self.handshaking = False
            await self._owner.notify()
            await self._follow(link)
        except Leave:
            goodbye = Message(MessageType.BYE, version=self.version)
            raise
        except _FATAL as e:  # this receiver stops: the sender logs why (ERROR) and drops it at once (BYE)
            link.try_send(ErrorReport.of(e).to_message(self.version))
            goodbye = Message(MessageType.BYE, version=self.version)
            raise
        finally:
            try:
                await link.close(goodbye)
            finally:
                self.link = None
                self.in_session = self.handshaking = False

    async def digest(self) -> str | None:
        """The state digest, or None when this receiver holds only part of the model
        (an engine's tensor-parallel rank: ``protocol.state.Placed``)."""
        strategy = self._owner.strategy()
        return await digest_of(state_tensors(self._owner.state()), self._owner.lock, strategy.metadata, strategy.aliases)

    async def hold_bootstrap(self, pending: PendingVersion) -> None:
        """A resync of a held receiver waits, staged, for ``update_weights``."""
        if self.version is None:
            return  # the first bootstrap: the model holds no version to keep serving
        self.pending_version = pending.version
        await self._owner.notify()
        try:
            await self._owner.wait(lambda: self.lifecycle.may_commit(pending.version, self.version), None, fail=False)
        finally:
            self.pending_version = None
        if self.lifecycle.leaving:
            raise Leave("asked to leave")

    async def _handshake(self, link: Session, digest: str | None) -> None:
        # Each message of the handshake (WELCOME, then every bootstrap part) within the
        # bound, not the whole: a large model's bootstrap takes as long as its bytes take.
        # The sender heartbeats while it answers, so silence (peer_timeout) means it is
        # gone; this bounds one that is alive but sends nothing. A held resync waiting,
        # staged, for update_weights receives nothing meanwhile, and is not bounded.
        # A message still arriving at more than heartbeats' rate extends the bound: on a
        # slow link one bucket can take longer than it (counted over TCP on Linux only).
        identity, endpoint, owner = self.settings.identity, self.upstreams.endpoint, self._owner
        strategy = owner.strategy()
        bound = self.settings.peer_timeout + HANDSHAKE_GRACE
        # A long bootstrap's progress: over TCP on Linux as its bytes arrive (a bucket can be
        # large), elsewhere message by message.
        incoming = Incoming(link, Progress(log, f"receiver {identity} bootstrap from {endpoint}", model_bytes(owner.state()), peer=identity))
        welcomed = False
        asked = received = 0  # calls of recv, messages it returned

        async def recv() -> Sequence[Buffer]:
            nonlocal welcomed, asked, received
            asked += 1
            before = link.bytes_received()
            while True:
                try:
                    frames = await asyncio.wait_for(link.recv(), bound)
                    received += 1
                    if welcomed:  # every message after WELCOME is a bootstrap part
                        nbytes = sum(len(f) for f in frames)
                        owner.metrics().bootstrap_bytes.inc(nbytes)
                        incoming.message(nbytes)
                    else:  # what follows WELCOME is the bootstrap: counted as its bytes arrive
                        incoming.watch()
                    welcomed = True
                    return frames
                except TimeoutError:
                    after = link.bytes_received()
                    if before is None or after is None or after - before < TRICKLE_BPS * bound:
                        raise Reconnect(f"no handshake message from the sender within {bound:.3g}s") from None
                    before = after

        held = self.version
        try:
            version = await strategy.init_receiver(owner.state(), recv, link.send, receiver_id=identity, digest=digest, flip=True)
        except MetadataMismatchError as e:
            if owner.names is None:
                raise
            raise MetadataMismatchError(owner.names.explain(str(e))) from e
        except ProtocolError as e:
            # Only the first message failing to decode (nothing asked after it) says the peer is no
            # weightsync sender; a bootstrap part's error, or a message over the limits, is not that.
            if (asked, received) != (1, 1) or isinstance(e, LimitError):
                raise
            raise Foreign(f"{endpoint} answered with something that is not a weightsync message ({e}): is it a weightsync "
                          "sender, of this protocol version?") from e
        finally:
            await incoming.close()
        self.connected = True
        self.handshakes += 1
        self.latest.saw(version)
        boot = strategy.last_stats
        strategy.last_stats = None
        self.last_bootstrap = boot if boot is not None and boot.kind == "bootstrap" else None
        if boot is not None and boot.kind == "bootstrap":
            self._record(boot)
        if (boot is not None and boot.kind == "bootstrap") or version != held:
            await self._publish(version, link)
        else:  # resumed where it was: nothing new to announce to hooks, only to the sender
            link.try_send(self._below().to_message(version))
        self.ready.set()
        log.info("receiver %s connected to %s at v%s", identity, endpoint, version,
                 extra={"receiver": identity, "endpoint": endpoint, "version": version})

    async def _follow(self, link: Session) -> None:
        identity, owner = self.settings.identity, self._owner
        strategy = owner.strategy()
        self._awaiting_resync = False
        last_type: list[MessageType | None] = [None]
        incoming: list[Incoming] = []  # a whole model arriving (a resync, a bucket version): its progress

        async def seen(*_: Any) -> Sequence[Buffer]:  # remembers what kind of message was rejected
            frames = await link.recv()
            self._receiving = True
            kind = last_type[0] = peek_type(frames)
            if kind in WHOLE_MODEL or incoming:
                if not incoming:
                    what = "resync" if kind is MessageType.BOOTSTRAP else "buckets"
                    progress = Progress(log, f"receiver {identity} {what} from {self.upstreams.endpoint}", model_bytes(owner.state()), peer=identity)
                    incoming.append(Incoming(link, progress))
                incoming[0].message(sum(len(f) for f in frames))
            return frames

        async def gate(pending: PendingVersion) -> None:
            self.pending_version = version = pending.version
            self.latest.saw(version)
            await owner.notify()
            # commit="together": staged, reported, and committed once the upstream flips it (a resync commits on arrival)
            together = link.together and version is not None and pending.type is not MessageType.BOOTSTRAP
            if together:
                self._staged = version
                link.try_send(self._report().to_message(self.version))

            def may() -> bool:  # paused: wait here, staged; together: until flipped, or the session ends (staged copy dropped)
                if link.broken is not None or self.lifecycle.leaving:
                    return True
                flipped = not together or (link.flipped is not None and version is not None and link.flipped >= version)
                return flipped and self.lifecycle.may_commit(version, self.version)

            try:
                await owner.wait(may, None, fail=False)
            finally:
                self._staged = None
            if link.broken is not None:
                raise link.broken
            if self.lifecycle.leaving:
                raise Leave("asked to leave")
            if together and owner.relay is not None and version is not None:  # flipped: its receivers commit with it
                owner.relay.flip(version)

        async def arriving(pending: PendingVersion) -> None:
            await gate(pending)
            self._arriving = True  # pending, yet not in hand: a part lost on the way must not silence ``_tick``

        while True:
            try:
                try:
                    # Written on arrival (bucket.load_instant), a version passes the gate before its first write.
                    pending = await strategy.receive(owner.state(), seen, before_write=arriving)
                    self._arriving = False
                finally:  # its transfer is over, whole or not: before the commit, so that nothing
                    if incoming:  # suspends between the commit and its record and publication
                        await incoming.pop().close()
                if not pending.written:
                    await gate(pending)
                await strategy.commit(owner.state(), pending)
            except _REJECTED as e:
                if strategy.torn:  # failed midway: the model holds no version (``version`` is None)
                    await owner.notify()
                if isinstance(e, StaleVersionError) and e.held:  # sent before a resync that overtook it, or a replay
                    log.debug("receiver %s dropped a version it holds: %s", identity, e)
                    continue
                # One NACK per incident: the sender resyncs once, and what it had in flight
                # is rejected meanwhile. A rejected resync itself is a new incident.
                if not self._awaiting_resync or last_type[0] is MessageType.BOOTSTRAP:
                    log.warning("receiver %s rejected an update at v%s: %s", identity, self.version, e)
                    self.nack(type(e).__name__, str(e))
                    self._awaiting_resync = True
                continue
            finally:
                self.pending_version = None
                self._receiving = self._arriving = False
            self._awaiting_resync = False
            self._record(pending.stats)
            await self._publish(pending.version, link)
            # Published: its staged changes (an index and a value each, decoded here) go now,
            # after the ACK, not when the next version replaces ``pending``. Whole tensors stay
            # until then: most are views of the received frames, whose memory the next
            # receive reuses; freed now, it goes back to the OS and that receive faults it in
            # afresh (docs/performance.md, *The memory pass's next sync*).
            pending.updates = [u for u in pending.updates if u.flat is None]

    def _tick(self, now: float) -> None:
        """Every heartbeat: a receiver that heard of a version it never received asks for what
        follows its own (``LagWatch``), rather than wait for the next version to show the gap."""
        link = self.link
        if link is None or self.handshaking:
            return
        quiet = now - link.data_at
        # A version in hand is busy; one written on arrival is in hand only once its last part is:
        # before, it is a version still arriving, and a part lost on the way shows as quiet.
        in_hand = self.pending_version is not None and not self._arriving
        busy = in_hand or self._awaiting_resync or (self._receiving and quiet < self.settings.peer_timeout)
        reason = self.lag.due(now, link.sender_version, self.version, busy=busy, quiet=quiet)
        if reason is not None:
            what = "what follows" if reason == BEHIND else "a resync: what was sent again was lost too"
            log.warning("receiver %s is at v%s, its upstream at v%s, and nothing arrived for %.1fs: asking for %s",
                        self.settings.identity, self.version, link.sender_version, quiet, what,
                        extra={"receiver": self.settings.identity, "version": self.version, "upstream_version": link.sender_version})
            if reason == BEHIND:  # the version in progress may come again from its first part (``ReceiverBase.resend_asked``)
                self._owner.strategy().resend_asked()
            else:
                self._awaiting_resync = True
            self.nack(reason, f"at v{self.version}; the upstream named v{link.sender_version}")

    def _below(self) -> Ack:
        """A relay tells its parent about the receivers below it (see ``Sender.wait_acked(tree=True)``)."""
        relay = self._owner.relay
        return Ack(None if relay is None else relay.server.subtree())

    def _report(self) -> Ack:
        """What ACKs and heartbeats say: ``_below``, and the version staged for a flip (a
        relay's, once its receivers staged it too: ``Relay.report``)."""
        relay = self._owner.relay
        return replace(self._below(), staged=self._staged) if relay is None else relay.report(self._staged)

    def _report_staged(self) -> None:
        """``Relay.tell_upstream``: its receivers are done staging; the version held staged goes up now, not a heartbeat later."""
        if self.link is not None and self._staged is not None:
            self.link.try_send(self._report().to_message(self.version))

    def _record(self, stats: ApplyStats) -> None:
        self._owner.metrics().applied(stats)
        if (how := self.lag.applied(stats.kind == "bootstrap")) is not None:  # it answered an ask (``_tick``)
            self._owner.metrics().recovered(how)
        if stats.version is not None:
            self.stats[stats.version] = stats
            while len(self.stats) > self.settings.stats_history:
                self.stats.popitem(last=False)

    async def _publish(self, version: int | None, link: Session) -> None:
        """``version`` is committed (the strategy holds it): tell the sender and the waiters,
        and queue it for the hooks, which run in their own task (``updates.py``): the
        session reads on, and commits the next version, while a slow hook runs."""
        self.latest.saw(version)
        link.try_send(self._below().to_message(version))
        await self._owner.notify()
        self.updates.published(version)

    # -- for the control calls (``receiver/control/controlled.py``) and ``Receiver.close`` ------------
    def nack(self, reason: str, message: str) -> None:
        """Ask the sender for a resync of its current version."""
        self._owner.metrics().nack(reason)
        if self.link is not None:
            self.link.try_send(Nack(reason, message).to_message(self.version))

    def say_goodbye(self) -> None:
        """Tell the upstream, if connected, that this receiver leaves (it closes)."""
        if self.link is not None:
            self.link.try_send(Message(MessageType.BYE, version=self.version))
