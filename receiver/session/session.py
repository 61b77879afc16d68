"""One connection of a receiver to its upstream (the sender, or a relay): a session.

A ``Session`` owns what lives exactly as long as one connection: the DEALER socket, the
inbox the receiver reads messages from, the three tasks that feed and watch it (reading
and routing, heartbeats and the silence check, the socket's TCP connections and CURVE
handshake failures) and the DIGEST queries in flight. ``close`` stops all of them and
fails the queries left, so nothing of a session outlives it. A receiver's ``Follower``
opens one per connection (``receiver/session/follower.py``) and drives the handshake and the
versions through ``recv`` and ``send``.

What ends a session arrives through the inbox, in order with the messages, as an
exception ``recv`` raises: ``Reconnect`` (the upstream said goodbye, restarted, cannot
serve now, went silent, or a task died) or ``Leave`` (the receiver asked: ``leave``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence

import zmq.asyncio

from protocol.errors import UNKNOWN_PEER, WIRE_CODES, LimitError, StateError, WeightSyncError, WeightSyncTimeout
from protocol.net.heartbeat import ticks
from protocol.net.security import CurveClient
from protocol.net.sockets import DealerSocket
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, decode_message, encode_message, peek_type, peek_version
from protocol.wire.limits import Limits
from protocol.wire.messages import Ack, Beat, DigestReply, DigestRequest, ErrorReport, Welcome

from .lag import Latest

log = logging.getLogger(__name__)

_EARLIER_CONNECTION = frozenset({MessageType.PATCH, MessageType.BUCKET, MessageType.BOOTSTRAP})
Heartbeat = Callable[[], tuple["int | None", Ack]]  # the applied version, and what a relay reports below it
DATA_BPS = 4096  # bytes a second that heartbeats alone never reach: more is a message arriving


class Reconnect(Exception):
    """The connection to the upstream is lost or was reset: start a new session."""


class Foreign(Reconnect):
    """The upstream's first answer is not a weightsync message: not a weightsync sender (or
    one of another protocol version). Said once, then retried with a long backoff."""


class Leave(Exception):
    """End the session on purpose (sleep, pause): start no new one until allowed."""


class Session:
    """``identity``'s connection to one upstream, from ``open`` to ``close``.

    ``heartbeat()`` is asked, every ``heartbeat_interval``, what the heartbeat says, and
    ``tick(now)`` is called after it is sent; silence from the upstream for ``peer_timeout``
    (judged only on ticks the event loop was not stalled for) ends the session with
    ``Reconnect``. What the upstream says of the trainer's latest version (its heartbeats,
    its answers) goes to ``latest``, and ``news()`` is awaited when that is a newer version. Silence is no message and,
    over TCP on Linux, no byte either: a message larger than the link carries in
    ``peer_timeout`` is still arriving, and the heartbeats queue behind it. Created before
    ``open`` so that ``leave`` works while the receiver still prepares its HELLO.

    Concurrency: one reader (``recv``) at a time, the receiver's session loop; ``send``,
    ``try_send``, ``ask`` and ``leave`` may be called from any task of the loop.
    """

    def __init__(
        self,
        identity: str,
        *,
        heartbeat: Heartbeat,
        heartbeat_interval: float,
        peer_timeout: float,
        latest: Latest | None = None,
        news: Callable[[], Awaitable[None]] | None = None,
        tick: Callable[[float], None] | None = None,
    ) -> None:
        self.identity = identity
        self.endpoint: str | None = None
        self._heartbeat, self.heartbeat_interval, self.peer_timeout = heartbeat, heartbeat_interval, peer_timeout
        self.latest = latest if latest is not None else Latest(heartbeat_interval)
        self._news, self._tick = news, tick
        self._inbox: asyncio.Queue[Sequence[Buffer] | BaseException] = asyncio.Queue()
        self._socket: DealerSocket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._queries: dict[str, tuple[asyncio.Future[tuple[int | None, str | None]], float]] = {}
        self._last_seen = time.monotonic()
        self.data_at = self._last_seen  # when a message other than a heartbeat last arrived (or its bytes did)
        self.sender_version: int | None = None  # the version the upstream's last heartbeat named (its own)
        self.together = False  # its WELCOME said versions commit when it flips them
        self.flipped: int | None = None  # the newest version it flipped (its heartbeats say)
        self.broken: BaseException | None = None  # what ends this session, once queued (a waiter not reading the inbox sees it)

    @property
    def is_open(self) -> bool:
        return self._socket is not None

    def open(self, context: zmq.asyncio.Context, endpoint: str, *, curve: CurveClient | None, limits: Limits) -> None:
        """Connect to ``endpoint`` and start reading, beating and watching."""
        if self._socket is not None:
            raise WeightSyncError("this session is already open")
        self.endpoint = endpoint
        self._socket = DealerSocket(context, endpoint, self.identity.encode(), curve=curve, limits=limits)
        self._last_seen = time.monotonic()
        self._tasks = [
            asyncio.create_task(self._read(self._socket), name=f"weightsync-session-read-{self.identity}"),
            asyncio.create_task(self._beat(self._socket), name=f"weightsync-session-beat-{self.identity}"),
            asyncio.create_task(self._socket.watch(self.identity), name=f"weightsync-session-watch-{self.identity}"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    async def recv(self) -> Sequence[Buffer]:
        """The next message for the receiver; raises what ends the session (``Reconnect``,
        ``Leave``) or a ``LimitError`` for a message that was drained and dropped."""
        item = await self._inbox.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def send(self, frames: Sequence[Buffer]) -> None:
        await self._open_socket().send(frames)

    def bytes_received(self) -> int | None:
        """The connection's received-byte count (``DealerSocket.bytes_received``)."""
        return None if self._socket is None else self._socket.bytes_received()

    def try_send(self, msg: Message) -> None:
        """Queue ``msg`` if there is room; ACKs, NACKs and heartbeats repeat, so one lost is
        not waited on. A session not open sends nothing."""
        if self._socket is not None:
            self._socket.try_send(encode_message(msg))

    def leave(self, why: str) -> None:
        """End this session at the receiver's next ``recv``: it raises ``Leave(why)``."""
        self._inbox.put_nowait(Leave(why))

    async def ask(self, version: int | None, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        """The upstream's current version and, if ``digest``, its state digest (one round
        trip); ``WeightSyncTimeout`` after ``timeout``, ``WeightSyncError`` if the session
        ends first."""
        sock = self._open_socket()
        nonce = uuid.uuid4().hex
        reply: asyncio.Future[tuple[int | None, str | None]] = asyncio.get_running_loop().create_future()
        self._queries[nonce] = reply, time.monotonic()
        try:
            sock.try_send(encode_message(DigestRequest(nonce, digest=digest).to_message(version)))
            try:
                return await asyncio.wait_for(reply, timeout)
            except asyncio.TimeoutError:
                raise WeightSyncTimeout(f"the sender at {self.endpoint} did not answer within {timeout}s") from None
        finally:
            self._queries.pop(nonce, None)

    async def close(self, goodbye: Message | None = None) -> None:
        """Stop the tasks, fail the queries still waiting, and close the socket, after
        queuing ``goodbye`` (a BYE) if given."""
        if goodbye is not None:
            self.try_send(goodbye)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for reply, _ in self._queries.values():
            if not reply.done():
                reply.set_exception(WeightSyncError("the session with the sender ended before it answered"))
        if self._socket is not None:
            self._socket.close()
            self._socket = None

    # -- internals ----------------------------------------------------------------------
    def _open_socket(self) -> DealerSocket:
        if self._socket is None:
            raise WeightSyncError("not connected to the sender")
        return self._socket

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():  # a reader that dies must end the session, not hang it
            self.broken = Reconnect(f"socket task failed: {task.exception()!r}")
            self._inbox.put_nowait(self.broken)
            if self._news is not None:  # owned by the session: close() ends it with the others
                self._tasks.append(asyncio.ensure_future(self._news()))

    async def _end(self, why: BaseException) -> None:
        """``why`` ends this session: queued for the reader, and told to whoever waits elsewhere."""
        self.broken = why
        self._inbox.put_nowait(why)
        if self._news is not None:
            await self._news()

    async def _read(self, sock: DealerSocket) -> None:
        """Route what arrives: heartbeats and DIGEST replies here, the end of the session
        as an exception, the rest to the inbox."""
        inbox, welcomed = self._inbox, False
        while True:
            try:
                frames = await sock.recv()
            except LimitError as e:  # drained, nothing kept: reject it like any bad message
                inbox.put_nowait(e)
                continue
            now = self._last_seen = time.monotonic()
            kind = peek_type(frames)
            if kind is MessageType.HEARTBEAT:
                with contextlib.suppress(WeightSyncError):  # a bad one is skipped: the next says the same
                    beat = decode_message(frames)
                    self.sender_version = beat.version
                    said = Beat.from_body(beat.body)
                    flipped = said.flipped is not None and (self.flipped is None or said.flipped > self.flipped)
                    if flipped:
                        self.flipped = said.flipped
                    if (self.latest.beat(_newest(beat.version, said.latest), now, paced=not said.news) or flipped) and self._news is not None:
                        await self._news()
                continue
            if kind is MessageType.DIGEST:
                if self._answer(frames) and self._news is not None:
                    await self._news()
                continue
            self.data_at = now
            if not welcomed and kind in _EARLIER_CONNECTION:
                # Sent to this identity before the sender saw our HELLO (a previous
                # connection's patch still on its way): this session starts at WELCOME.
                log.info("receiver %s: dropped a %s sent before this session's WELCOME", self.identity, kind.name)
                continue
            if kind in _EARLIER_CONNECTION and self.latest.saw(peek_version(frames, self.latest.version)) and self._news is not None:
                # a version is announced by its first part's arrival, before the receiver (busy
                # committing, or staging the one before) reads it: ``reading(max_lag=)`` counts it
                await self._news()
            if kind is MessageType.WELCOME:
                with contextlib.suppress(WeightSyncError):  # the strategy reads it again, and refuses a bad one
                    self.together = Welcome.from_body(decode_message(frames).body).together
            welcomed = welcomed or kind is MessageType.WELCOME
            ends = Reconnect("the sender said goodbye") if kind is MessageType.BYE else None
            if kind is MessageType.ERROR:
                ends = _ending(frames)
            if ends is None:
                inbox.put_nowait(frames)
            else:
                await self._end(ends)

    async def _beat(self, sock: DealerSocket) -> None:
        received = sock.bytes_received()
        async for now, stalled in ticks(self.heartbeat_interval):  # a stalled loop is not a dead sender
            version, below = self._heartbeat()
            sock.try_send(encode_message(Message(MessageType.HEARTBEAT, version=version, body=below.to_body())))
            if (count := sock.bytes_received()) is not None and count != received:  # bytes arrived since the last tick
                if received is not None and count - received > DATA_BPS * self.heartbeat_interval:
                    self.data_at = now
                received, self._last_seen = count, max(self._last_seen, now - self.heartbeat_interval)
            if self._tick is not None:
                self._tick(now)
            silent = now - self._last_seen
            if silent > self.peer_timeout and not stalled:
                await self._end(Reconnect(f"no message from the sender for {silent:.1f}s"))

    def _answer(self, frames: Sequence[Buffer]) -> bool:
        """A DIGEST reply: resolves the ``ask`` waiting for its nonce; True if it named a
        newer latest version."""
        try:
            msg = decode_message(frames)
            answer = DigestReply.from_body(msg.body)
        except WeightSyncError as e:
            log.warning("receiver %s: dropping a bad DIGEST reply: %s", self.identity, e)
            return False
        query = self._queries.get(answer.nonce)
        if query is None:
            return False
        reply, asked_at = query
        if not reply.done():
            reply.set_result((msg.version, answer.digest))
        return self.latest.answered(_newest(msg.version, answer.latest), asked_at)


def _newest(a: int | None, b: int | None) -> int | None:
    return a if b is None else b if a is None else max(a, b)


def _ending(frames: Sequence[Buffer]) -> Reconnect | None:
    """The end of the session an ERROR means, if it means one: the upstream does not know
    this receiver (it restarted), or cannot serve it now (a relay asleep). Other errors, and
    an unreadable one, go to the receiver."""
    try:
        report = ErrorReport.from_body(decode_message(frames).body)
    except WeightSyncError:
        return None
    if report.code == UNKNOWN_PEER:
        return Reconnect("the sender does not know this receiver (restarted?)")
    if report.code == WIRE_CODES[StateError]:
        return Reconnect(f"the upstream cannot serve this receiver now: {report.message[:200]}")
    return None
