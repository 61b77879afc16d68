"""The sender's ROUTER socket: the only code that knows its options and how to send.

Sends never block: a peer whose queue is full gets ``False`` back (the caller keeps
the message and retries later), and a peer that is gone raises ``PeerGone``
(ROUTER_MANDATORY turns silent drops into errors).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from protocol.buffers import Buffer

log = logging.getLogger(__name__)

SNDHWM = 1000  # frames queued per peer before sends report "full"; credits bound it first


class PeerGone(Exception):
    """The peer's connection is gone (EHOSTUNREACH)."""


def bindable(endpoint: str) -> str:
    """``tcp://host:0`` means any free port, which ZeroMQ spells ``tcp://host:*``."""
    return endpoint[:-2] + ":*" if endpoint.startswith("tcp://") and endpoint.endswith(":0") else endpoint


class RouterSocket:
    def __init__(self, context: zmq.asyncio.Context, endpoint: str) -> None:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a reconnecting receiver takes over its identity
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.RCVHWM, 0)  # acks and heartbeats are tiny; never drop them
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(bindable(endpoint))
        self.sock = sock
        self.endpoint = bytes(sock.getsockopt(zmq.LAST_ENDPOINT)).decode()

    async def recv(self) -> tuple[bytes, list[memoryview]]:
        """The next message: the peer's identity and its frames."""
        frames = await self.sock.recv_multipart(copy=False)
        return bytes(frames[0].buffer), [f.buffer for f in frames[1:]]

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
