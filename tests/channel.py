"""An in-memory duplex channel for the transport-free strategies: real frames, no sockets.

Frames are copied into ``bytes`` on send, as a socket would, so a receiver never sees
later writes to a sender's tensors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence


class Pipe:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.sent: list[list[bytes]] = []

    async def send(self, frames: Sequence[object]) -> None:
        copied = [bytes(f) for f in frames]  # type: ignore[call-overload]
        self.sent.append(copied)
        await self.queue.put(copied)

    async def recv(self) -> list[bytes]:
        return await asyncio.wait_for(self.queue.get(), timeout=30)


class Channel:
    """``to_receiver`` carries sender -> receiver, ``to_sender`` the other way."""

    def __init__(self) -> None:
        self.to_receiver = Pipe()
        self.to_sender = Pipe()
