"""The receiver's DEALER socket: the only code that knows its options."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from protocol.buffers import Buffer


class DealerSocket:
    """Connects to the sender's ROUTER under a stable identity, so the sender knows a
    reconnecting receiver (ROUTER_HANDOVER hands it the new connection)."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, identity: bytes) -> None:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # the sender's credits bound what can be queued here
        sock.connect(endpoint)
        self.sock = sock

    async def send(self, frames: Sequence[Buffer]) -> None:
        await self.sock.send_multipart(list(frames), copy=False)

    def try_send(self, frames: Sequence[Buffer]) -> bool:
        """Queue a message without waiting; False when it cannot be queued now (no
        connection, or a full queue). Acks and heartbeats repeat, so dropping one is safe."""
        future: Any = self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
        return not future.done() or future.exception() is None

    async def recv(self) -> list[memoryview]:
        frames = await self.sock.recv_multipart(copy=False)
        return [f.buffer for f in frames]

    def close(self) -> None:
        self.sock.close(linger=0)
