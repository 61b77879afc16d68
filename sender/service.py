"""The sender daemon: one trainer, many receivers, over a ZeroMQ ROUTER socket.

``sync()`` builds a version once (a patch, or the buckets) and returns; each receiver's
pump task sends it what it is missing, bounded by credits (versions in flight), so a
slow or dead receiver never blocks the trainer. Receivers behind the ring of recent
patches, or that reject a message, are resynced with a bootstrap of the current version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import zmq
import zmq.asyncio

from protocol.buffers import Buffer
from protocol.checksum import state_digest
from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError, WeightSyncError
from protocol.framing import Message, MessageType, decode_message
from protocol.limits import Limits
from protocol.metadata import ModelMetadata
from protocol.security import CurveServer, check_transport
from protocol.state import ModelState, StateLike, materialize, resolve_state

from .base import Stamper, check_next_version, error_message, plan_for
from .bucket import BucketBuilder
from .patch import Changes, PatchBuilder
from .peers import Peer
from .plan import Source, SyncPlan
from .socket import PeerGone, RouterSocket
from .stats import SyncStats

log = logging.getLogger(__name__)

STALL_GRACE = 0.5  # seconds a heartbeat tick may be late before the loop counts as stalled


@dataclass
class _RingEntry:
    base: int | None
    version: int
    frames: list[Buffer]


class Sender:
    """The trainer-side daemon. An async context manager; see ``start``, ``sync``, ``close``.

    ``config`` is the seed's YAML shape (a path, mapping or ``SyncConfig``). The first
    receiver's metadata fixes the receivers' dtypes: every later receiver must match it.

    ``curve`` (``protocol.security.CurveServer``) encrypts the connection and admits only
    receivers whose public key it allows; a refused key is logged and counted in
    ``rejected_handshakes``. Without it, binding beyond loopback is a ``ConfigError``
    unless ``insecure_plaintext``. ``limits`` bounds what receivers may send (default:
    derived from the model at ``start``).
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        config: SyncConfig | Any = None,
        *,
        trainable_keys: Iterable[str] | None = None,
        ring_size: int = 8,
        max_inflight: int = 2,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        context: zmq.asyncio.Context | None = None,
        stats_history: int = 1000,
        curve: CurveServer | None = None,
        insecure_plaintext: bool = False,
        limits: Limits | None = None,
    ) -> None:
        if ring_size < 1 or max_inflight < 1:
            raise ConfigError("ring_size and max_inflight must be at least 1")
        check_transport(endpoint, curve, insecure_plaintext, role="sender")
        self.curve, self._limits = curve, limits
        self.rejected_handshakes = 0  # CURVE handshakes refused: key not in the allowlist
        self.rejected_keys: set[str] = set()
        self.config = load_config(config)
        self.strategy = self.config.type
        self._endpoint = endpoint
        self._trainable_keys = None if trainable_keys is None else list(trainable_keys)
        self.ring_size, self.max_inflight = ring_size, max_inflight
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self._context = context or zmq.asyncio.Context.instance()
        self.stamp = Stamper()
        self.version: int | None = None
        self.stats: collections.OrderedDict[int, SyncStats] = collections.OrderedDict()
        self._stats_history = stats_history
        self._model: StateLike | None = None
        self._state: ModelState | None = None
        self._plan: SyncPlan | None = None
        self._builder: PatchBuilder | BucketBuilder | None = None
        self._ring: collections.deque[_RingEntry] = collections.deque(maxlen=ring_size)
        self._retained: dict[str, torch.Tensor] | None = None  # bucket mode: the current version
        self._held: dict[str, torch.Tensor] | None = None  # the current version, before any receiver
        self._bucket_frames: tuple[int, list[list[Buffer]]] | None = None  # bucket mode: its messages
        self._resync: tuple[int | None, list[Message]] | None = None
        self._digest: tuple[int | None, str] | None = None
        self._peers: dict[bytes, Peer] = {}
        self._encoding: asyncio.Task[None] | None = None  # the newest patch being encoded
        self._encoding_bases: set[int | None] = set()  # base versions of the patches being encoded
        self._greeting: dict[bytes, asyncio.Task[None]] = {}  # HELLOs being answered
        self._lock = asyncio.Lock()  # the snapshot / retained version: builds vs bootstraps
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
    def receivers(self) -> dict[str, dict[str, object]]:
        """Connected receivers by identity, with their acknowledged version and queue."""
        return {p.name: p.describe() for p in self._peers.values()}

    async def start(self, model: StateLike, *, version: int | None = None) -> Sender:
        """Bind the socket and serve receivers with ``model``'s weights.

        ``version`` is the version ``model`` already holds (e.g. a resumed checkpoint).
        """
        if self._socket is not None:
            raise WeightSyncError("sender already started")
        self._model, self.version = model, version
        self._state = resolve_state(model, self._trainable_keys)
        self._hold(self._state.tensors)
        limits = self._limits or Limits.for_control(self._state.tensors)
        self._socket = RouterSocket(self._context, self._endpoint, curve=self.curve, limits=limits, on_reject=self._rejected)
        self._spawn(self._serve(), "serve")
        self._spawn(self._heartbeat(), "heartbeat")
        log.info("sender %s serving %s (%s, version %s)", self.session[:8], self.endpoint, self.strategy, version)
        return self

    def _rejected(self, address: str, public_key: str) -> None:
        """A receiver's CURVE key was refused (called from the ZAP thread, which logs it)."""
        self.rejected_handshakes += 1
        self.rejected_keys.add(public_key)

    async def sync(self, model: StateLike, version: int) -> SyncStats:
        """Capture ``version`` from ``model`` once for every receiver and return its stats.

        Returns as soon as the changes are collected and the snapshot has moved (patch),
        or the buckets are built (bucket): the model may change again. Encoding and
        sending go on in the background; ``stats.wire_bytes`` and ``encode_seconds`` are
        filled in once the patch is encoded (``await sender.flush()`` waits for that).
        """
        self._check_running()
        check_next_version(self.version, version)
        tensors = resolve_state(model).tensors
        self._model = model
        async with self._lock:
            stats = await self._build(tensors, version)
            self.version = version
            self._resync = self._digest = None
        self.stats[version] = stats
        while len(self.stats) > self._stats_history:
            self.stats.popitem(last=False)
        for peer in self._peers.values():
            peer.wake.set()
        return stats

    async def wait_acked(self, version: int, timeout: float | None = None) -> None:
        """Wait until every connected receiver has applied ``version`` (or a later one)."""

        def done() -> bool:
            self._check_running()
            return all(p.acked is not None and p.acked >= version for p in self._peers.values())

        async with self._acked:
            await asyncio.wait_for(self._acked.wait_for(done), timeout)

    async def wait_for_receivers(self, count: int, timeout: float | None = None) -> None:
        """Wait until at least ``count`` receivers are connected."""
        async with self._acked:
            await asyncio.wait_for(self._acked.wait_for(lambda: self._check_running() or len(self._peers) >= count), timeout)

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
        tasks = list(self._tasks) + [p.task for p in self._peers.values() if p.task]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._socket is not None:
            await self._socket.aclose()
        log.info("sender %s closed", self.session[:8])

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- building ---------------------------------------------------------------------
    async def _build(self, tensors: dict[str, torch.Tensor], version: int) -> SyncStats:
        builder = self._builder
        if builder is None:  # no receiver yet: nothing to diff against, only the version moves
            self._hold(tensors)
            return SyncStats(version, self.strategy)
        if isinstance(builder, PatchBuilder):
            changes, stats = await builder.collect(tensors, version)
            base, previous = self.version, self._encoding
            self._encoding_bases.add(base)
            self._encoding = self._spawn(self._encode(previous, changes, version, base, stats), f"encode-v{version}")
            return stats
        started = time.perf_counter()
        self._retained = await asyncio.to_thread(builder.retain, tensors)
        messages, stats = builder.build(self._retained, version, copy=False)
        frames_list = [self.stamp(m) for m in await asyncio.to_thread(list, messages)]
        self._bucket_frames = (version, frames_list)
        stats.messages, stats.wire_bytes = len(frames_list), sum(len(f) for fr in frames_list for f in fr)
        stats.build_seconds = time.perf_counter() - started
        return stats

    async def _encode(
        self, previous: asyncio.Task[None] | None, changes: list[Changes], version: int, base: int | None, stats: SyncStats
    ) -> None:
        """Encode a collected version into the ring, after the versions before it."""
        if previous is not None:
            await previous
        assert isinstance(self._builder, PatchBuilder)
        msg = await self._builder.encode(changes, version, base, stats)
        frames = self.stamp(msg)
        self._ring.append(_RingEntry(base, version, frames))
        self._encoding_bases.discard(base)
        stats.messages, stats.wire_bytes = 1, sum(len(f) for f in frames)
        for peer in self._peers.values():
            peer.wake.set()

    async def flush(self) -> None:
        """Wait until every synced version is encoded and queued for the receivers."""
        if self._encoding is not None:
            await asyncio.shield(self._encoding)

    def _hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of the current version until the first receiver says which dtypes
        it wants: the weights may move on before it joins, and it must get this version."""
        held = self._held
        if held is None or held.keys() != tensors.keys():
            self._held = {k: materialize(t).detach().clone() for k, t in tensors.items()}
            return
        for key, t in tensors.items():
            held[key].copy_(materialize(t).detach())

    def _source(self) -> Source:
        """Tensors of the current version at rest: the snapshot or retained copy for
        tracked keys, the model for frozen ones (which training does not change)."""
        assert self._state is not None
        model = resolve_state(self._model).tensors if self._model is not None else self._state.tensors
        if isinstance(self._builder, PatchBuilder):
            held = self._builder.snapshot.tensors
        else:
            held = self._retained or {}
        return lambda key: held[key] if key in held else model[key]

    def _release_resync(self) -> None:
        """Drop the cached bootstrap once every receiver has its version and none is joining
        or waiting for a resync: kept, it would hold a second copy of the model until the
        next sync. A later joiner gets it rebuilt."""
        cached = self._resync
        if cached is None or cached[0] is None or self._greeting:
            return
        if all(p.acked is not None and p.acked >= cached[0] and not p.needs_resync for p in self._peers.values()):
            self._resync = None

    async def _resync_messages(self) -> list[Message]:
        """A bootstrap of the current version: the init-sync keys, plus every tracked key
        once the trainer has moved past its initial weights. Cached per version."""
        async with self._lock:
            if self._resync is not None and self._resync[0] == self.version:
                return self._resync[1]
            plan = self._plan
            assert plan is not None
            if isinstance(self._builder, PatchBuilder):
                await self._builder.snapshot.wait_writeback()
            keys = plan.bootstrap_keys() if plan.init_sync.enabled else []
            if self.version is not None:
                keys = [k for k in plan.state.tensors if k in set(keys) | set(plan.tracked)]
            _, messages = plan.bootstrap(self.version, self._source(), keys)
            built = await asyncio.to_thread(list, messages)
            self._resync = (self.version, built)
            return built

    async def _state_digest(self) -> str:
        """Digest of the current version at the receivers' dtypes, as a receiver computes it."""
        async with self._lock:
            if self._digest is not None and self._digest[0] == self.version:
                return self._digest[1]
            plan = self._plan
            assert plan is not None
            if isinstance(self._builder, PatchBuilder):
                await self._builder.snapshot.wait_writeback()
            source, aliases = self._source(), plan.state.aliases

            def compute() -> str:
                view = {k: source(aliases.get(k, k)).to(plan.receiver_dtype(k)) for k in plan.metadata.keys}
                return state_digest(view, list(plan.metadata.keys))

            digest = await asyncio.to_thread(compute)
            self._digest = (self.version, digest)
            return digest

    # -- serving ----------------------------------------------------------------------
    def _spawn(self, coro: Any, name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro, name=f"weightsync-sender-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._closed:
            return
        error = task.exception()
        if error is not None:
            log.error("sender task %s failed: %r", task.get_name(), error, exc_info=error)
            self._failure = error
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._acked:
            self._acked.notify_all()

    def _check_running(self) -> bool:
        if self._failure is not None:
            raise WeightSyncError(f"sender failed: {self._failure!r}") from self._failure
        if self._closed or self._socket is None:
            raise WeightSyncError("sender is not running (call start(), and not after close())")
        return False

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            identity, frames = await self._socket.recv()
            try:
                msg = decode_message(frames)
            except WeightSyncError as e:
                log.warning("dropping a bad message from %r: %s", identity, e)
                continue
            peer = self._peers.get(identity)
            if peer is not None:
                peer.last_seen = time.monotonic()
            if msg.type is MessageType.HELLO:
                # Handled in its own task: a bootstrap can take a while to build, and the
                # other receivers' acks and heartbeats must keep flowing meanwhile.
                previous = self._greeting.pop(identity, None)
                if previous is not None:
                    previous.cancel()
                self._greeting[identity] = self._spawn(self._on_hello(identity, msg), f"hello-{identity!r}")
            elif peer is None:
                if identity in self._greeting:
                    continue  # its HELLO is being answered: heartbeats meanwhile are expected
                if msg.type is not MessageType.BYE:  # e.g. after a sender restart: ask it to say HELLO
                    self._try_send(Peer(identity), self.stamp(Message(MessageType.ERROR, body={"code": "unknown_peer", "message": "say HELLO"})))
            elif msg.type in (MessageType.ACK, MessageType.HEARTBEAT):
                # Heartbeats repeat the applied version, so a lost ACK is never waited on forever.
                if msg.version is not None and (peer.acked is None or msg.version > peer.acked):
                    peer.ack(msg.version)
                    await self._notify()
                elif msg.type is MessageType.ACK:
                    peer.ack(msg.version)
                self._release_resync()
            elif msg.type is MessageType.NACK:
                log.warning("receiver %s rejected an update at v%s: %s", peer.name, msg.version, msg.body.get("message"))
                peer.ack(msg.version)
                peer.inflight.clear()  # it drops whatever else is queued until the resync
                peer.needs_resync = True
            elif msg.type is MessageType.DIGEST_REQUEST:
                self._spawn(self._answer_digest(peer, msg), f"digest-{peer.name}")
            elif msg.type is MessageType.BYE:
                await self._drop(peer, "said goodbye")
            elif msg.type is MessageType.ERROR:
                log.error("receiver %s reported: %s", peer.name, msg.body.get("message"))

    async def _answer_digest(self, peer: Peer, request: Message) -> None:
        """Tell a receiver the current version and, when asked, its state digest: what a
        paused receiver updates to, and what ``verify_checksum`` compares against."""
        version, digest = self.version, None
        if request.body.get("digest") is True:
            for _ in range(3):  # the trainer may sync meanwhile: the pair must be consistent
                version = self.version
                digest = await self._state_digest()
                if self.version == version:
                    break
            else:
                digest = None
        reply = Message(MessageType.DIGEST, version=version, body={"nonce": request.body.get("nonce"), "digest": digest})
        try:
            self._try_send(peer, self.stamp(reply))
        except PeerGone:
            await self._drop(peer, "disconnected")

    async def _on_hello(self, identity: bytes, hello: Message) -> None:
        assert self._state is not None
        old = self._peers.pop(identity, None)
        if old is not None and old.task is not None:
            old.task.cancel()
        peer = Peer(identity)
        try:
            await self._greet(peer, hello)
        except WeightSyncError as e:  # this receiver cannot be served; the others carry on
            log.error("receiver %s refused: %s", peer.name, e)
            self._try_send(peer, self.stamp(error_message(e)))
        finally:
            if self._greeting.get(identity) is asyncio.current_task():
                del self._greeting[identity]

    async def _greet(self, peer: Peer, hello: Message) -> None:
        identity = peer.identity
        async with self._lock:  # a sync() (or another first HELLO) must not move the held version mid-capture
            await self._adopt(hello)
        assert self._plan is not None
        applied, digest, session = hello.body.get("applied"), hello.body.get("digest"), hello.body.get("session")
        known = {self.version} | {e.base for e in self._ring} | self._encoding_bases
        greeting: list[Message]
        if session == self.session and applied in known:
            greeting, version = [], applied  # it was with us: the ring catches it up
        elif applied == self.version and self.version is not None and digest == await self._state_digest():
            greeting, version = [], applied  # already current (e.g. after a sender restart)
        else:
            greeting, version = await self._resync_messages(), self.version
        welcome = self._plan.welcome(self.strategy, version, len(greeting))
        peer.sent = version
        peer.acked = None if greeting else version
        peer.inflight = [version] if greeting else []
        self._peers[identity] = peer
        peer.task = asyncio.get_running_loop().create_task(self._pump(peer, [welcome, *greeting]))
        log.info("receiver %s joined at v%s (bootstrap: %d buckets)", peer.name, applied, len(greeting))
        await self._notify()

    async def _adopt(self, hello: Message) -> None:
        """The first receiver fixes the plan; later ones must match it exactly."""
        assert self._state is not None
        if self._plan is None:
            plan = plan_for(self._state, hello, self.config)
            builder: PatchBuilder | BucketBuilder
            held = self._held
            assert held is not None
            if self.strategy == "patch":
                builder = PatchBuilder(plan, self.config.patch)
                await asyncio.to_thread(builder.capture, held)
            else:
                builder = BucketBuilder(plan, self.config.bucket)
                self._retained = await asyncio.to_thread(builder.retain, held)
            self._plan, self._builder = plan, builder
            self._held = None  # the snapshot (or retained copy) holds the version from now on
            return
        theirs = ModelMetadata.from_body(hello.body)
        ours = self._plan.metadata
        if theirs != ours:
            for key, shape, dtype in zip(theirs.keys, theirs.shapes, theirs.dtypes):
                if key not in ours or ours.shapes[ours.ordinal(key)] != shape or ours.dtypes[ours.ordinal(key)] != dtype:
                    raise MetadataMismatchError(f"key {key!r}: this receiver differs from the others ({list(shape)}, {dtype})")
            raise MetadataMismatchError("this receiver's keys differ from the other receivers'")

    async def _pump(self, peer: Peer, greeting: list[Message]) -> None:
        """Send ``peer`` what it is missing, never more than ``max_inflight`` versions ahead."""
        try:
            await self._deliver_all(peer, [self.stamp(m) for m in greeting])
            # A bootstrap is a whole model copy: this coroutine lives as long as the peer,
            # so it keeps no reference to what it has queued (ZeroMQ holds what it still needs).
            del greeting
            while True:
                while len(peer.inflight) < self.max_inflight:
                    batch = await self._next_for(peer)
                    if batch is None:
                        break
                    version = batch[0]
                    await self._deliver_all(peer, batch[1])
                    del batch
                    peer.sent = version
                    peer.inflight.append(version)
                await peer.wake.wait()
                peer.wake.clear()
        except PeerGone:
            await self._drop(peer, "disconnected")

    async def _next_for(self, peer: Peer) -> tuple[int | None, list[list[Buffer]]] | None:
        if not peer.needs_resync:
            if peer.sent == self.version:
                return None
            if isinstance(self._builder, PatchBuilder):
                for entry in self._ring:
                    if entry.base == peer.sent:
                        return entry.version, [entry.frames]
                if peer.sent in self._encoding_bases:
                    return None  # its next patch is being encoded; the encoder wakes it
            elif self._bucket_frames is not None and (peer.sent is None or peer.sent < self._bucket_frames[0]):
                return self._bucket_frames
        peer.needs_resync = False
        peer.resyncs += 1
        log.info("resyncing receiver %s from v%s to v%s", peer.name, peer.acked, self.version)
        return self.version, [self.stamp(m) for m in await self._resync_messages()]

    async def _deliver_all(self, peer: Peer, messages: list[list[Buffer]]) -> None:
        for frames in messages:
            await self._deliver(peer, frames)

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
            return self._socket.try_send(peer.identity, frames)
        except PeerGone:
            if peer.identity in self._peers:
                raise
            return True  # not a registered peer (an ERROR to a stranger): nothing to undo

    async def _drop(self, peer: Peer, why: str) -> None:
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
            log.info("receiver %s dropped: %s", peer.name, why)
            if peer.task is not None and peer.task is not asyncio.current_task():
                peer.task.cancel()
            await self._notify()

    async def _heartbeat(self) -> None:
        tick = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            # Woken late, this loop was blocked (a long GIL-holding call, say): the peers'
            # messages are still queued, unread. Judge silence on the next tick instead.
            stalled, tick = now - tick > 2 * self.heartbeat_interval + STALL_GRACE, now
            for peer in list(self._peers.values()):
                if now - peer.last_seen > self.peer_timeout and not stalled:
                    await self._drop(peer, f"silent for {now - peer.last_seen:.1f}s")
                    continue
                try:
                    self._try_send(peer, self.stamp(Message(MessageType.HEARTBEAT, version=self.version)))
                except PeerGone:
                    await self._drop(peer, "disconnected")

