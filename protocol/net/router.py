"""The ROUTER socket that serves versions (the sender's, and a relay's): its options and how to send.

Sends never block: a peer whose queue is full gets ``False`` back (the caller keeps
the message and retries later), and a peer that is gone raises ``PeerGone``
(ROUTER_MANDATORY turns silent drops into errors).

With ``curve`` the socket is a CURVE server: traffic is encrypted and only receivers
whose public key is in the allowlist complete the handshake (``protocol/net/zap.py`` decides
and logs each refused key). Inbound messages are bounded by ``limits``: ZeroMQ drops a
connection that sends a frame over ``MAXMSGSIZE``, and ``recv`` discards (and logs) a
message over its frame count or byte total without keeping its parts.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from protocol.net import zap
from protocol.net.security import CurveServer
from protocol.wire.buffers import Buffer
from protocol.wire.limits import DEFAULT_LIMITS, LimitError, Limits, read_bounded

log = logging.getLogger(__name__)

SNDHWM = 1000  # frames queued per peer before sends report "full"; credits bound it first


class PeerGone(Exception):
    """The peer's connection is gone (EHOSTUNREACH)."""


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
        CURVE handshake refused because its key is not allowed."""
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting receiver takes over its identity
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 0)  # acks and heartbeats are tiny; never drop them
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_bytes)
        self.limits = limits
        self.oversized = 0  # messages discarded for exceeding a limit
        self._context, self._domain = context, None
        if curve is not None:
            self._domain = f"weightsync-{uuid.uuid4().hex}"
            zap.register(context, self._domain, curve.allowed, on_reject)  # before bind: no unchecked handshake
            sock.setsockopt(zmq.ZAP_DOMAIN, self._domain.encode())
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
        try:
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

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        """The next message within ``limits``: the peer's identity and its frames.
        Messages over a limit are drained part by part, logged and skipped."""
        while True:
            identity = bytes((await self.sock.recv(copy=False)).buffer)
            try:
                frames = await read_bounded(lambda: self.sock.recv(copy=False), self.limits)
            except LimitError as e:
                self.oversized += 1
                log.warning("discarded a message from %r: %s", identity, e)
                continue
            return identity, frames

    def try_send(self, identity: bytes, frames: Sequence[Buffer]) -> bool:
        """Queue a whole message for ``identity`` without blocking; False when its queue is full."""
        future: Any = self.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        if not future.done():  # cannot happen with NOBLOCK; keep the message either way
            return True
        error = future.exception()
        if error is None:
            return True
        if isinstance(error, zmq.Again):
            return False
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            raise PeerGone(identity.decode(errors="replace"))
        raise error

    async def aclose(self, timeout: float = 1.0) -> None:
        """Close, and return only once the endpoint is free to bind again: ZeroMQ releases
        it in the background, so a sender restarted at once could find it still taken."""
        if self.endpoint.startswith("inproc://"):  # no listener to wait for
            self.sock.close(linger=0)
            self._unregister()
            return
        monitor = self.sock.get_monitor_socket(zmq.EVENT_CLOSED)
        try:
            self.sock.unbind(self.endpoint)
            await asyncio.wait_for(monitor.recv_multipart(), timeout)
        except (zmq.ZMQError, TimeoutError):
            log.warning("endpoint %s may still be bound after close", self.endpoint)
        finally:
            self.sock.disable_monitor()
            monitor.close(linger=0)
            self.sock.close(linger=0)
            self._unregister()

