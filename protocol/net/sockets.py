"""Every ZeroMQ socket weightsync opens, with its options, and how each sends: the one
place that knows them.

``RouterSocket`` serves versions (the sender's, and a relay's). Sends never block: a peer
whose queue is full gets ``False`` back (the caller keeps the message and retries
later), and a peer that is gone raises ``PeerGone`` (ROUTER_MANDATORY turns silent drops
into errors). With ``curve`` it is a CURVE server: traffic is encrypted and only
receivers whose public key is in the allowlist complete the handshake
(``protocol/net/zap.py`` decides and logs each refused key). ``recv`` also says which
connection a message came on, so the server can read how much of what it sent the
receiver's kernel acknowledged (``TcpLink``): on a slow link a receiver's heartbeats can
wait behind the version it is taking in.

``DealerSocket`` is a receiver's connection to it, under a stable identity. With
``curve`` it is a CURVE client: it completes a handshake only with the sender whose
public key it was given, and only if the sender admits its own key; otherwise it keeps
retrying and never connects. ``bytes_received`` reads the kernel's count (``TcpLink``)
of bytes that arrived on its TCP connection, which moves while a message is crossing: ZeroMQ
hands a message over only once all of it is in, so on a slow link a large one looks like
silence without it. ``recv`` awaits a message's first part only: ZeroMQ delivers a
multipart message atomically, so the rest is read at once without waiting, counted as it
is read (``MessageCounter``), and dropped part by part past a limit. One await a message
instead of one a frame (``python -m benchmarks.micro --only recv``).

``handoff_socket``: the local hand-off between a trainer and its sender sidecar.

ZeroMQ's errors stop here: what a socket fails to do (bind, connect, send, receive) is a
``TransportError`` naming the operation and the address (``transport_errors``), ZeroMQ's
error its ``__cause__``; a send to a receiver that is gone, ``PeerGone`` (one).

Inbound messages are bounded by ``limits`` on both: ZeroMQ drops a connection that
sends a frame over ``MAXMSGSIZE``, and ``recv`` refuses a message over its frame count or
byte total without keeping its parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.errors import LimitError, PeerGone, TransportError
from protocol.net import zap
from protocol.net.security import CurveClient, CurveServer
from protocol.wire.buffers import Buffer
from protocol.wire.limits import DEFAULT_LIMITS, Limits, MessageCounter, read_bounded

log = logging.getLogger(__name__)

SNDHWM = 1000  # frames queued per peer before sends report "full"; credits bound it first


def transport_error(what: str, error: zmq.ZMQError) -> TransportError:
    """ZeroMQ's ``error`` as a ``TransportError`` saying ``what`` failed (the operation and
    its address); raise it ``from error``."""
    return TransportError(f"{what}: {error}", errno=error.errno)


@contextlib.contextmanager
def transport_errors(what: str) -> Iterator[None]:
    """Raise ZeroMQ's errors inside as ``transport_error(what, ...)``. Catch ``zmq.Again``
    inside it where it is expected. (The per-message paths use a plain ``try``: free.)"""
    try:
        yield
    except zmq.ZMQError as e:
        raise transport_error(what, e) from e


def bindable(endpoint: str) -> str:
    """``tcp://host:0`` means any free port, which ZeroMQ spells ``tcp://host:*``."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class RouterSocket:
    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        *,
        curve: CurveServer | None = None,
        limits: Limits = DEFAULT_LIMITS,
        on_reject: Callable[[str, str], None] | None = None,
    ) -> None:
        """``on_reject(address, public_key)`` is called (from the ZAP thread) for each
        CURVE handshake refused because its key is not allowed. ``TransportError`` if
        ``endpoint`` cannot be bound (in use, malformed)."""
        with transport_errors(f"cannot open a ROUTER socket for {endpoint}"):
            sock = context.socket(zmq.ROUTER)
        self.limits = limits
        self.oversized = 0  # messages discarded for exceeding a limit
        self._context, self._domain = context, None
        try:
            with transport_errors(f"cannot bind {endpoint}"):
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting receiver takes over its identity
                sock.setsockopt(zmq.SNDHWM, SNDHWM)
                sock.setsockopt(zmq.RCVHWM, 0)  # acks and heartbeats are tiny; never drop them
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_bytes)
                if curve is not None:
                    domain = f"weightsync-{uuid.uuid4().hex}"
                    zap.register(context, domain, curve.allowed, on_reject)  # before bind: no unchecked handshake
                    self._domain = domain
                    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
                    sock.setsockopt(zmq.CURVE_SERVER, 1)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
                sock.bind(bindable(endpoint))
        except BaseException:
            sock.close(linger=0)
            self._unregister()
            raise
        self.sock = sock
        self.endpoint = bytes(sock.getsockopt(zmq.LAST_ENDPOINT)).decode()

    def _unregister(self) -> None:
        if self._domain is not None:
            zap.unregister(self._context, self._domain)
            self._domain = None

    async def recv(self) -> tuple[bytes, list[memoryview], int]:
        """The next message within ``limits``: the peer's identity, its frames, and the fd
        of the connection it came on (``source_fd``; ``TcpLink.of`` reads it). Messages
        over a limit are drained part by part, logged and skipped."""
        while True:
            try:
                first = await self.sock.recv(copy=False)
                identity, fd = bytes(first.buffer), source_fd(first)
                del first
                frames = await read_bounded(lambda: self.sock.recv(copy=False), self.limits)
            except LimitError as e:
                self.oversized += 1
                log.warning("discarded a message from %r: %s", identity, e)
                continue
            except zmq.ZMQError as e:
                raise transport_error(f"receiving on {self.endpoint}", e) from e
            return identity, frames, fd

    def try_send(self, identity: bytes, frames: Sequence[Buffer]) -> bool:
        """Queue a whole message for ``identity`` without blocking; False when its queue is
        full, ``PeerGone`` when its connection is gone."""
        try:
            future: Any = self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # a closed socket
            raise transport_error(f"sending on {self.endpoint}", e) from e
        if not future.done():  # cannot happen with NOBLOCK; keep the message either way
            return True
        error = future.exception()
        if error is None:
            return True
        if isinstance(error, zmq.Again):
            return False
        name = identity.decode(errors="replace")
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            raise PeerGone(f"receiver {name} is gone", errno=error.errno) from error
        if isinstance(error, zmq.ZMQError):
            raise transport_error(f"sending to receiver {name} on {self.endpoint}", error) from error
        raise error  # not ZeroMQ's (a frame that is no buffer): the caller's bug, as it was

    async def aclose(self, timeout: float = 1.0) -> None:
        """Close, and return only once the endpoint is free to bind again: ZeroMQ releases
        it in the background, so a sender restarted at once could find it still taken."""
        if self.endpoint.startswith("inproc://"):  # no listener to wait for
            self.sock.close(linger=0)
            self._unregister()
            return
        monitor: zmq.asyncio.Socket | None = None
        try:
            monitor = self.sock.get_monitor_socket(zmq.EVENT_CLOSED)
            self.sock.unbind(self.endpoint)
            await asyncio.wait_for(monitor.recv_multipart(), timeout)
        except (zmq.ZMQError, TimeoutError):
            log.warning("endpoint %s may still be bound after close", self.endpoint)
        finally:
            if monitor is not None:
                self.sock.disable_monitor()
                monitor.close(linger=0)
            self.sock.close(linger=0)
            self._unregister()


HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
CONNECTION = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED  # each event's value is the TCP socket's fd
_TCPI_BYTES_ACKED = 120  # offsets of struct tcp_info's tcpi_bytes_acked and tcpi_bytes_received (u64s; Linux 4.1 and later)
_TCPI_BYTES_RECEIVED = 128


def _tcp_info(fd: int) -> tuple[tuple[object, object], int, int] | None:
    """``fd``'s TCP connection as ((local address, peer address), bytes of ours the peer
    acknowledged, bytes received), or None if ``fd`` is not an open TCP socket. The fd
    belongs to ZeroMQ's I/O thread: it is borrowed (``detach``), never closed here."""
    if sys.platform != "linux" or fd < 0:
        return None
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        if len(info) < _TCPI_BYTES_RECEIVED + 8:
            return None
        acked, received = struct.unpack_from("<QQ", info, _TCPI_BYTES_ACKED)
        return (sock.getsockname(), sock.getpeername()), acked, received
    except OSError:
        return None
    finally:
        sock.detach()


@dataclass(frozen=True)
class TcpLink:
    """One of ZeroMQ's TCP connections, read through the kernel's counters (Linux). The
    addresses tell the connection apart from a later one that reuses its fd number."""

    fd: int
    addresses: tuple[object, object]

    @classmethod
    def of(cls, fd: int) -> TcpLink | None:
        """``fd``'s connection, or None where it cannot be read (not TCP, not Linux, closed)."""
        found = _tcp_info(fd)
        return None if found is None else cls(fd, found[0])

    def counts(self) -> tuple[int, int] | None:
        """(bytes of ours the peer's kernel acknowledged, bytes received) so far, ZeroMQ's
        framing and heartbeats included; None once this connection is closed."""
        found = _tcp_info(self.fd)
        return None if found is None or found[0] != self.addresses else found[1:]


def source_fd(frame: zmq.Frame) -> int:
    """The fd of the connection ``frame`` arrived on (ZMQ_SRCFD: deprecated in libzmq, kept
    since 4.1), or -1 where it has none (inproc) or cannot be told."""
    try:
        return int(frame.get(zmq.SRCFD))
    except (zmq.ZMQError, AttributeError, ValueError):
        return -1


class DealerSocket:
    """Connects to the sender's ROUTER under a stable identity, so the sender knows a
    reconnecting receiver (ROUTER_HANDOVER hands it the new connection). ``TransportError``
    if ``endpoint`` cannot be connected to (malformed, an unknown transport)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        identity: bytes,
        *,
        curve: CurveClient | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        with transport_errors(f"cannot open a DEALER socket for {endpoint}"):
            sock = context.socket(zmq.DEALER)
        monitor: zmq.asyncio.Socket | None = None
        try:
            with transport_errors(f"cannot connect to {endpoint}"):
                sock.setsockopt(zmq.IDENTITY, identity)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 0)  # the sender's credits bound what can be queued here
                sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_bytes)
                if curve is not None:
                    sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
                    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
                    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
                monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | CONNECTION)
                sock.connect(endpoint)
        except BaseException:
            if monitor is not None:
                monitor.close(linger=0)
            sock.close(linger=0)
            raise
        self._monitor = monitor
        self.sock = sock
        self._blocking: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # the same socket, without the event loop: NOBLOCK reads
        self.limits = limits
        self.curve = curve
        self.endpoint = endpoint
        self.handshake_failures = 0
        self._connections: dict[int, TcpLink] = {}  # fd -> each TCP connection

    def bytes_received(self) -> int | None:
        """Bytes the kernel has received on this socket's TCP connection, ZeroMQ's framing
        and heartbeats included, or None where that cannot be read (not TCP, not Linux, not
        connected yet). A reconnect starts the count over: compare values, not totals."""
        total = None
        for fd, link in list(self._connections.items()):
            counts = link.counts()
            if counts is None:  # closed, or the fd number reused for another socket
                del self._connections[fd]
                continue
            total = (total or 0) + counts[1]
        return total

    async def watch(self, name: str) -> None:
        """Follow the TCP connections (for ``bytes_received``) and log why handshakes with
        the sender fail (a wrong key otherwise looks like a sender that never answers).
        Runs until cancelled; the first failure of each kind is a warning, repeats
        (ZeroMQ retries) are debug."""
        seen: set[int] = set()
        while True:
            with transport_errors(f"watching the connection to {self.endpoint}"):
                event = parse_monitor_message(await self._monitor.recv_multipart())
            kind = int(event["event"])
            if kind & CONNECTION:
                self._follow_connection(kind, int(event["value"]))
                continue
            self.handshake_failures += 1
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                why = (f"the sender refused this receiver's key (ZAP status {event['value']}): "
                       f"add {self.curve.keys.public.decode() if self.curve else 'its public key'} to the sender's allowlist")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                why = "the sender and this receiver disagree on security (CURVE on one side, plaintext on the other)"
            elif self.curve is not None:
                why = "CURVE handshake failed: the sender's key is not the --curve-server-key given here"
            else:
                why = "handshake failed"
            (log.debug if kind in seen else log.warning)("receiver %s, sender %s: %s", name, self.endpoint, why)
            seen.add(kind)

    def _follow_connection(self, kind: int, fd: int) -> None:
        self._connections.pop(fd, None)
        if kind == zmq.EVENT_CONNECTED and (link := TcpLink.of(fd)) is not None:
            self._connections[fd] = link

    async def send(self, frames: Sequence[Buffer]) -> None:
        try:
            await self.sock.send_multipart(list(frames), copy=False)
        except zmq.ZMQError as e:
            raise transport_error(f"sending to {self.endpoint}", e) from e

    def try_send(self, frames: Sequence[Buffer]) -> bool:
        """Queue a message without waiting; False when it cannot be queued now (no
        connection, or a full queue). Acks and heartbeats repeat, so dropping one is safe."""
        try:
            future: Any = self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # a closed socket
            raise transport_error(f"sending to {self.endpoint}", e) from e
        return not future.done() or future.exception() is None

    async def recv(self) -> list[memoryview]:
        """The next message; ``LimitError`` (after draining it) when it exceeds ``limits``.
        The header's size is checked before anything reads it (the first part counted)."""
        counter = MessageCounter(self.limits)
        try:
            frame = await self.sock.recv(copy=False)
            kept = [frame.buffer] if counter.add(len(frame)) else []
            more = frame.more
            del frame
            while more:
                try:
                    frame = self._blocking.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:  # not expected (delivery is atomic), but never spin or block here
                    frame = await self.sock.recv(copy=False)
                if counter.add(len(frame)):
                    kept.append(frame.buffer)
                elif kept:
                    kept.clear()
                more = frame.more
                del frame
        except zmq.ZMQError as e:
            raise transport_error(f"receiving from {self.endpoint}", e) from e
        if counter.error is not None:
            raise counter.error
        return kept

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)


@overload
def handoff_socket(context: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket: ...
@overload
def handoff_socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]: ...
def handoff_socket(context: zmq.Context[Any], kind: int) -> zmq.Socket[Any]:
    """A socket of the trainer / sender-sidecar hand-off (local, tiny messages): closes
    without lingering, so a stopped peer never holds its process open. Its binds, connects,
    sends and receives go through ``transport_errors``."""
    with transport_errors("cannot open a hand-off socket"):
        sock = context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
    return sock
