"""The receiver's DEALER socket: the only code that knows its options.

With ``curve`` the socket is a CURVE client: it completes a handshake only with the
sender whose public key it was given, and only if the sender admits its own key;
otherwise it keeps retrying and never connects. Inbound messages are bounded by
``limits`` (``MAXMSGSIZE`` per frame in ZeroMQ, frame count and total in ``recv``).

``recv`` awaits a message's first part only: ZeroMQ delivers a multipart message
atomically (all of its parts are queued here before the first can be read), so the
rest is read at once without waiting, one part at a time through a blocking shadow of
the same socket, and counted as it is read (``MessageCounter``): past a limit each part
is dropped as soon as it is read, so what is kept stays bounded as before. One await a
message instead of one a frame (a patch of 300 tensors has ~2,000 frames: at ~10 us an
await, ~20 ms a version; ``python -m benchmarks.micro --only recv``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.net.security import CurveClient
from protocol.wire.buffers import Buffer
from protocol.wire.limits import DEFAULT_LIMITS, Limits, MessageCounter

log = logging.getLogger(__name__)

HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH

class DealerSocket:
    """Connects to the sender's ROUTER under a stable identity, so the sender knows a
    reconnecting receiver (ROUTER_HANDOVER hands it the new connection)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        identity: bytes,
        *,
        curve: CurveClient | None = None,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 0)  # the sender's credits bound what can be queued here
        sock.setsockopt(zmq.MAXMSGSIZE, limits.frame_bytes)
        if curve is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.keys.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, curve.keys.secret)
        self._monitor = sock.get_monitor_socket(HANDSHAKE_FAILED)
        sock.connect(endpoint)
        self.sock = sock
        self._blocking: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # the same socket, without the event loop: NOBLOCK reads
        self.limits = limits
        self.curve = curve
        self.endpoint = endpoint
        self.handshake_failures = 0

    async def watch_handshakes(self, name: str) -> None:
        """Log why handshakes with the sender fail (a wrong key otherwise looks like a
        sender that never answers). Runs until cancelled; the first failure of each kind
        is a warning, repeats (ZeroMQ retries) are debug."""
        seen: set[int] = set()
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            self.handshake_failures += 1
            kind = int(event["event"])
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

    async def send(self, frames: Sequence[Buffer]) -> None:
        await self.sock.send_multipart(list(frames), copy=False)

    def try_send(self, frames: Sequence[Buffer]) -> bool:
        """Queue a message without waiting; False when it cannot be queued now (no
        connection, or a full queue). Acks and heartbeats repeat, so dropping one is safe."""
        future: Any = self.sock.send_multipart(list(frames), flags=zmq.NOBLOCK, copy=False)
        return not future.done() or future.exception() is None

    async def recv(self) -> list[memoryview]:
        """The next message; ``LimitError`` (after draining it) when it exceeds ``limits``.
        The header's size is checked before anything reads it (the first part counted)."""
        counter = MessageCounter(self.limits)
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
        if counter.error is not None:
            raise counter.error
        return kept

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
