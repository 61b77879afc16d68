"""The receiver daemon: follows one sender, applies its versions in the background.

Receiving, decoding and validating run off the event loop; a version is committed
under the write side of ``lock`` and only then published as ``version``. Lost
connections (no message within ``peer_timeout``) are re-established with backoff,
resuming from the applied version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import zmq
import zmq.asyncio

from protocol.buffers import Buffer
from protocol.checksum import state_digest
from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, IntegrityError, MetadataMismatchError, ProtocolError, StaleVersionError, WeightSyncError
from protocol.framing import Message, MessageType, decode_message, encode_message, peek_type
from protocol.state import StateLike, resolve_state

from .factory import make_receiver
from .rwlock import ReadWriteLock
from .socket import DealerSocket
from .stats import ApplyStats

log = logging.getLogger(__name__)

STALL_GRACE = 0.5  # seconds a heartbeat tick may be late before the loop counts as stalled
_REJECTED = (StaleVersionError, ProtocolError, IntegrityError)  # the sender can fix these with a resync
_FATAL = (MetadataMismatchError, ConfigError)  # reconnecting would not help


class _Reconnect(Exception):
    """The connection to the sender is lost or was reset: start a new session."""


class Receiver:
    """The rollout-side daemon. An async context manager; see ``start`` and ``close``.

    Rollouts run inference under ``async with receiver.reading():`` (or
    ``receiver.lock.reading_sync()`` from a thread) and never see a half-applied version.
    """

    def __init__(
        self,
        model: StateLike,
        endpoint: str,
        config: SyncConfig | Any = None,
        *,
        identity: str | None = None,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        reconnect_backoff: tuple[float, float] = (0.05, 2.0),
        context: zmq.asyncio.Context | None = None,
        stats_history: int = 1000,
    ) -> None:
        self.model = model
        self.endpoint = endpoint
        self.config = load_config(config)
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self.reconnect_backoff = reconnect_backoff
        self._context = context or zmq.asyncio.Context.instance()
        self.lock = ReadWriteLock()
        self.strategy = make_receiver(self.config)
        self.strategy.write_guard = self.lock.writing
        self.stats: collections.OrderedDict[int, ApplyStats] = collections.OrderedDict()
        self._stats_history = stats_history
        self.version: int | None = None
        self.pending_version: int | None = None  # being received or applied now
        self.connected = False
        self.reconnects = 0
        self._handshakes = 0
        self._hooks: list[Callable[[int | None], Any]] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._failure: BaseException | None = None
        self._socket: DealerSocket | None = None
        self._closed = False

    # -- public API -----------------------------------------------------------------
    async def start(self, timeout: float | None = 30.0) -> Receiver:
        """Connect, say HELLO with this model's metadata, and apply the bootstrap if one
        is needed. Returns once the first handshake is done; raises if it fails."""
        if self._task is not None:
            raise WeightSyncError("receiver already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"weightsync-receiver-{self.identity}")
        self._task.add_done_callback(self._run_done)
        await self._wait(lambda: self._ready.is_set(), timeout)
        return self

    def reading(self) -> AbstractAsyncContextManager[None]:
        """Hold the model still: no version is committed while inside."""
        return self.lock.reading()

    def on_update(self, hook: Callable[[int | None], Any]) -> None:
        """Call ``hook(version)`` after each version is committed (async hooks are awaited)."""
        self._hooks.append(hook)

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until ``version`` (or a later one) is applied; returns the applied version."""
        await self._wait(lambda: self.version is not None and self.version >= version, timeout)
        assert self.version is not None
        return self.version

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._socket is not None:
            self._socket.try_send(encode_message(Message(MessageType.BYE, version=self.version)))
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        log.info("receiver %s closed at v%s", self.identity, self.version)

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------------
    async def _wait(self, predicate: Callable[[], bool], timeout: float | None) -> None:
        def check() -> bool:
            if self._failure is not None:
                raise WeightSyncError(f"receiver {self.identity} failed: {self._failure}") from self._failure
            return predicate()

        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(check), timeout)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _run_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("receiver %s stopped: %r", self.identity, self._failure)
        if not self._closed:
            asyncio.get_running_loop().create_task(self._notify())

    async def _run(self) -> None:
        delay = self.reconnect_backoff[0]
        while True:
            handshakes = self._handshakes
            try:
                await self._session()
            except _Reconnect as e:
                log.warning("receiver %s: %s; reconnecting in %.2fs", self.identity, e, delay)
            except _FATAL as e:
                self._failure = e
                await self._notify()
                raise
            finally:
                self.connected = False
            self.reconnects += 1
            if self._handshakes != handshakes:  # that session worked: start backing off afresh
                delay = self.reconnect_backoff[0]
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_backoff[1])

    async def _session(self) -> None:
        # The digest first: HELLO must be the first message of a session, before any heartbeat.
        digest = await self._digest() if self.version is not None else None
        sock = self._socket = DealerSocket(self._context, self.endpoint, self.identity.encode())
        inbox: asyncio.Queue[Sequence[Buffer] | BaseException] = asyncio.Queue()
        last_seen = [time.monotonic()]

        async def read() -> None:
            while True:
                frames = await sock.recv()
                last_seen[0] = time.monotonic()
                kind = peek_type(frames)
                if kind is MessageType.HEARTBEAT:
                    continue
                if kind is MessageType.BYE:
                    inbox.put_nowait(_Reconnect("the sender said goodbye"))
                elif kind is MessageType.ERROR and _error_code(frames) == "unknown_peer":
                    inbox.put_nowait(_Reconnect("the sender does not know this receiver (restarted?)"))
                else:
                    inbox.put_nowait(frames)

        async def beat() -> None:
            tick = time.monotonic()
            while True:
                await asyncio.sleep(self.heartbeat_interval)
                sock.try_send(encode_message(Message(MessageType.HEARTBEAT, version=self.version)))
                now = time.monotonic()
                # Woken late, this loop was blocked and the sender's messages are still
                # unread: a stalled loop is not a dead sender. Judge on the next tick.
                stalled, tick = now - tick > 2 * self.heartbeat_interval + STALL_GRACE, now
                silent = now - last_seen[0]
                if silent > self.peer_timeout and not stalled:
                    inbox.put_nowait(_Reconnect(f"no message from the sender for {silent:.1f}s"))

        async def recv() -> Sequence[Buffer]:
            item = await inbox.get()
            if isinstance(item, BaseException):
                raise item
            return item

        tasks = [asyncio.create_task(read()), asyncio.create_task(beat())]
        def ended(task: asyncio.Task[None]) -> None:  # a reader that dies must end the session, not hang it
            if not task.cancelled():
                inbox.put_nowait(_Reconnect(f"socket task failed: {task.exception()!r}"))

        for t in tasks:
            t.add_done_callback(ended)
        try:
            await self._handshake(sock, recv, digest)
            await self._follow(sock, recv)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            sock.close()
            self._socket = None

    async def _digest(self) -> str:
        tensors = resolve_state(self.model).tensors
        async with self.lock.reading():
            return await asyncio.to_thread(state_digest, tensors, list(tensors))

    async def _handshake(self, sock: DealerSocket, recv: Callable[[], Any], digest: str | None) -> None:
        version = await asyncio.wait_for(
            self.strategy.init_receiver(self.model, recv, sock.send, receiver_id=self.identity, digest=digest),
            self.peer_timeout + 60.0,
        )
        self.connected = True
        self._handshakes += 1
        boot = self.strategy.last_stats
        self.strategy.last_stats = None
        if boot is not None and boot.kind == "bootstrap":
            self._record(boot)
        if (boot is not None and boot.kind == "bootstrap") or version != self.version:
            await self._publish(version, sock)
        else:  # resumed where it was: nothing new to announce to hooks, only to the sender
            sock.try_send(encode_message(Message(MessageType.ACK, version=version)))
        self._ready.set()
        log.info("receiver %s connected to %s at v%s", self.identity, self.endpoint, version)

    async def _follow(self, sock: DealerSocket, recv: Callable[[], Any]) -> None:
        awaiting_resync = False
        while True:
            try:
                pending = await self.strategy.receive(self.model, recv)
                self.pending_version = pending.version
                await self.strategy.commit(self.model, pending)
            except _REJECTED as e:
                if not awaiting_resync:  # one NACK per incident: the sender resyncs once
                    log.warning("receiver %s rejected an update at v%s: %s", self.identity, self.version, e)
                    nack = Message(MessageType.NACK, version=self.version, body={"reason": type(e).__name__, "message": str(e)})
                    sock.try_send(encode_message(nack))
                    awaiting_resync = True
                continue
            finally:
                self.pending_version = None
            awaiting_resync = False
            self._record(pending.stats)
            await self._publish(pending.version, sock)

    def _record(self, stats: ApplyStats) -> None:
        if stats.version is not None:
            self.stats[stats.version] = stats
            while len(self.stats) > self._stats_history:
                self.stats.popitem(last=False)

    async def _publish(self, version: int | None, sock: DealerSocket) -> None:
        self.version = version
        sock.try_send(encode_message(Message(MessageType.ACK, version=version)))
        for hook in self._hooks:
            try:
                result = hook(version)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("on_update hook failed at v%s", version)
        await self._notify()


def _error_code(frames: Sequence[Buffer]) -> str | None:
    try:
        return str(decode_message(frames).body.get("code"))
    except WeightSyncError:
        return None
