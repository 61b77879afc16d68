"""An impairing TCP proxy for the fault tests: sits between a sender and its receivers.

Every receiver's TCP connection to the proxy gets its own connection to the sender. The
sender-to-receiver direction is parsed as ZMTP 3 (64-byte greeting, then frames: a flags
byte -- 0x01 more, 0x02 long size, 0x04 command -- and a 1- or 8-byte size), so a
``Tamper`` sees whole weightsync messages (frame 0 the msgpack header, frames 1..n the
raw tensor buffers) and can corrupt bytes *inside the payload buffers*, duplicate,
replay, reorder or stall them. The receiver-to-sender direction passes through as bytes.
Both directions can be delayed (a latency line: every chunk leaves ``delay`` seconds
after it arrived, order kept), the sender-to-receiver one paced to ``rate`` bytes a
second (a slow link, without root: the proxy then reads from the sender only as fast as
it forwards, through a small receive buffer, so the sender's TCP sees the pace too), and
``sever()`` resets every connection at once. ``upstream_waits`` holds the receiver's
bytes while the sender's are still being forwarded: a shaped link whose deep queue holds
the acknowledgements the receiver's TCP waits for, so its heartbeats reach the sender
only after the message it is receiving.

Plaintext (NULL mechanism) only: a CURVE stream is opaque, which is the point of CURVE.

Also a CLI, to run inside a network namespace:
``python tests/proxy.py --listen HOST:PORT --upstream HOST:PORT [--delay SECONDS]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

GREETING = 64  # bytes of the ZMTP 3 greeting, each way
MORE, LONG, COMMAND = 0x01, 0x02, 0x04


# -- ZMTP framing -----------------------------------------------------------------------------
def encode_frame(body: bytes, more: bool, command: bool = False) -> bytes:
    flags = (MORE if more else 0) | (COMMAND if command else 0)
    if len(body) > 255:
        return bytes([flags | LONG]) + struct.pack(">Q", len(body)) + body
    return bytes([flags, len(body)]) + body


@dataclass
class Wire:
    """One weightsync message as it crossed the proxy: its frames and its decoded header."""

    frames: list[bytes]
    header: dict[str, Any] | None  # None when frame 0 is not a msgpack map (never from a real sender)
    index: int  # position among the messages of its connection
    connection: int

    @property
    def type(self) -> int | None:
        return None if self.header is None else self.header.get("type")

    @property
    def version(self) -> int | None:
        return None if self.header is None else self.header.get("version")

    @property
    def payload_bytes(self) -> int:
        return sum(len(f) for f in self.frames[1:])

    def encode(self) -> bytes:
        last = len(self.frames) - 1
        return b"".join(encode_frame(f, i < last) for i, f in enumerate(self.frames))


def parse_header(frame: bytes) -> dict[str, Any] | None:
    try:
        header = msgpack.unpackb(frame, raw=False)
    except Exception:
        return None
    return header if isinstance(header, dict) else None


class ZmtpParser:
    """Feeds on a byte stream; yields raw pass-through chunks (greeting, commands) and messages."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.greeting_left = GREETING
        self.frames: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes | list[bytes]]:
        """Whole units parsed so far: ``bytes`` to forward as they are, ``list`` = a message's frames."""
        out: list[bytes | list[bytes]] = []
        if self.greeting_left:  # forwarded at once: the peers exchange it piece by piece
            head, data = data[: self.greeting_left], data[self.greeting_left :]
            self.greeting_left -= len(head)
            out.append(bytes(head))
        self.buffer += data
        while len(self.buffer) >= 2:
            flags = self.buffer[0]
            head = 9 if flags & LONG else 2
            if len(self.buffer) < head:
                break
            size = struct.unpack(">Q", self.buffer[1:9])[0] if flags & LONG else self.buffer[1]
            if len(self.buffer) < head + size:
                break
            raw = bytes(self.buffer[: head + size])
            body = raw[head:]
            del self.buffer[: head + size]
            if flags & COMMAND:  # handshake READY, PING/PONG: never inside a message
                out.append(raw)
                continue
            self.frames.append(body)
            if not flags & MORE:
                out.append(self.frames)
                self.frames = []
        return out


# -- what happens to the sender's messages ----------------------------------------------------
Select = Callable[[Wire], bool]


def of_type(*types: int, payload: bool = False) -> Select:
    """Messages of these weightsync types (``MessageType`` values); ``payload``: with tensor frames."""
    return lambda w: w.type in types and (not payload or len(w.frames) > 1)


@dataclass
class Tamper:
    """Decides what the receiver gets for each of the sender's messages (default: it as is).

    ``select`` picks the messages to act on, at most ``limit`` of them (None: all).
    ``emit`` returns the messages to forward now, in order; ``hits`` counts the acts.
    """

    select: Select
    limit: int | None = 1
    hits: int = 0
    log: list[dict[str, Any]] = field(default_factory=list)

    def wants(self, w: Wire) -> bool:
        return (self.limit is None or self.hits < self.limit) and self.select(w)

    def emit(self, w: Wire) -> list[Wire]:
        if not self.wants(w):
            return [w]
        self.hits += 1
        self.log.append({"type": w.type, "version": w.version, "connection": w.connection, "index": w.index})
        return self.act(w)

    def act(self, w: Wire) -> list[Wire]:
        return [w]


@dataclass
class Corrupt(Tamper):
    """Flip bits inside the payload buffers (frames 1..n) at ``offsets``: fractions of the
    buffer's length (0.5: its middle) or, as ints, byte offsets; every payload frame is hit.
    The header, sizes and frame count stay valid, so only a payload checksum can catch it."""

    offsets: tuple[float | int, ...] = (0.5,)
    mask: int = 0x5A
    flipped: int = 0

    def act(self, w: Wire) -> list[Wire]:
        frames = [w.frames[0]]
        for frame in w.frames[1:]:
            data = bytearray(frame)
            for off in self.offsets:
                if not data:
                    continue
                i = min(len(data) - 1, int(off * len(data)) if isinstance(off, float) else off)
                data[i] ^= self.mask
                self.flipped += 1
            frames.append(bytes(data))
        return [Wire(frames, w.header, w.index, w.connection)]


@dataclass
class CorruptAndRecord(Corrupt):
    """``Corrupt``, remembering the type of every message it saw (what came after the one it
    corrupted: the sender's resync)."""

    seen: list[int | None] = field(default_factory=list)

    def emit(self, w: Wire) -> list[Wire]:
        self.seen.append(w.type)
        return super().emit(w)


@dataclass
class Duplicate(Tamper):
    """Deliver the message twice in a row."""

    def act(self, w: Wire) -> list[Wire]:
        return [w, w]


@dataclass
class Replay(Tamper):
    """Record the selected messages; re-deliver each one, ``after`` messages later, as it was."""

    after: int = 2
    _recorded: list[tuple[tuple[int, int], Wire]] = field(default_factory=list)

    def emit(self, w: Wire) -> list[Wire]:
        now = (w.connection, w.index)  # replayed on the connection it came through
        due = [old for at, old in self._recorded if at == now]
        self._recorded = [(at, old) for at, old in self._recorded if at != now]
        out = super().emit(w)
        return [*out, *due]

    def act(self, w: Wire) -> list[Wire]:
        self._recorded.append(((w.connection, w.index + self.after), w))
        return [w]


@dataclass
class Reorder(Tamper):
    """Hold a selected message back and deliver it right after the next selected one of
    the same connection."""

    _held: Wire | None = None

    def emit(self, w: Wire) -> list[Wire]:
        if self._held is not None and self._held.connection == w.connection and self.select(w):
            held, self._held = self._held, None
            return [w, held]
        return super().emit(w)

    def act(self, w: Wire) -> list[Wire]:
        self._held = w
        return []


@dataclass
class Stall(Tamper):
    """Deliver the first ``fraction`` of the message's bytes, then hold the connection
    (nothing more reaches the receiver) until ``release()``: a crash while this message
    is half on the wire. ``stalled`` is set once it happened. On release the rest is
    delivered (``finish``) or the connection is reset (the sender died mid-message)."""

    fraction: float = 0.5
    finish: bool = True
    stalled: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.released.set()


# -- the proxy --------------------------------------------------------------------------------
@dataclass
class ProxyStats:
    connections: int = 0
    messages: int = 0  # sender -> receiver messages forwarded
    bytes_down: int = 0
    largest: int = 0  # bytes of the largest message forwarded down
    bytes_up: int = 0
    severed: int = 0


class Proxy:
    """``listen`` -> ``upstream`` TCP proxy; ``endpoint`` is what receivers connect to."""

    def __init__(
        self, upstream: tuple[str, int], listen: tuple[str, int] = ("127.0.0.1", 0), *,
        delay: float = 0.0, tamper: Tamper | None = None, rate: float | None = None, upstream_waits: bool = False,
        raw: bool = False,
    ) -> None:
        """``raw``: forward the sender's bytes unparsed (no ``tamper``, no message counts),
        so any TCP stream passes, not only ZeroMQ's."""
        self.upstream, self.listen, self.delay, self.tamper, self.rate = upstream, listen, delay, tamper, rate
        self.upstream_waits, self.raw = upstream_waits, raw
        self.stats = ProxyStats()
        self._server: asyncio.base_events.Server | None = None
        self._links: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.listen[0]}:{self.port}"

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._accept, *self.listen)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.sever(count=False)
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def __aenter__(self) -> Proxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def open_connections(self) -> int:
        return len(self._links)

    def sever(self, count: bool = True) -> int:
        """Reset every open connection (RST both ways); receivers reconnect through the proxy."""
        n = 0
        for client, server in list(self._links):
            for w in (client, server):
                w.transport.abort()
            n += 1
        self._links.clear()
        if count:
            self.stats.severed += n
        return n

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await self._connect_upstream()
        except OSError:  # the sender is down: refuse like it would; ZeroMQ retries
            client_w.transport.abort()
            return
        self.stats.connections += 1
        conn = self.stats.connections
        link = (client_w, server_w)
        self._links.add(link)
        down_idle = asyncio.Event()  # nothing of the sender's is waiting to be forwarded
        down_idle.set()
        up = self._spawn(self._pipe(client_r, lambda q: self._drain(q, server_w, down_idle)))
        down = self._spawn(self._pipe(server_r, lambda q: self._drain_messages(q, client_w, conn, down_idle), down_idle))
        await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        for w in link:
            w.transport.abort()
        self._links.discard(link)

    async def _connect_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.rate is None:
            return await asyncio.open_connection(*self.upstream)
        sock = socket.socket(socket.AF_INET6 if ":" in self.upstream[0] else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 10)  # before connect: a small window, no autotuning
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.upstream)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=4 << 10)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _late(self, arrived: float) -> None:
        if self.delay > 0:
            await asyncio.sleep(max(0.0, arrived + self.delay - time.monotonic()))

    async def _pipe(
        self, reader: asyncio.StreamReader, drain: Callable[[asyncio.Queue[tuple[float, bytes]]], Awaitable[None]],
        busy: asyncio.Event | None = None,
    ) -> None:
        """Read one direction into a queue that ``drain`` forwards (with delay, faults);
        ``busy`` is cleared while there is something to forward. Paced, the sender's side
        reads no further ahead than a few chunks."""
        paced = busy is not None and self.rate is not None
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        pump = self._spawn(drain(queue))
        try:
            while data := await reader.read(4 << 10 if paced else 1 << 16):
                if busy is not None:
                    busy.clear()
                queue.put_nowait((time.monotonic(), data))
                while paced and not queue.empty() and not pump.done():
                    await asyncio.sleep(0.01)
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait((time.monotonic(), b""))
            with contextlib.suppress(Exception):
                await pump

    async def _drain(self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, down_idle: asyncio.Event) -> None:
        while True:
            arrived, data = await queue.get()
            if not data:
                return
            await self._late(arrived)
            if self.upstream_waits:
                await down_idle.wait()
            writer.write(data)
            self.stats.bytes_up += len(data)
            await writer.drain()

    async def _write(self, writer: asyncio.StreamWriter, raw: bytes) -> None:
        """Forward ``raw`` towards the receiver, at most ``rate`` bytes a second."""
        if self.rate is None:
            writer.write(raw)
            return
        chunk = max(1, int(self.rate / 20))  # 20 writes a second
        for start in range(0, len(raw), chunk):
            writer.write(raw[start : start + chunk])
            await writer.drain()
            await asyncio.sleep(chunk / self.rate)

    def _count(self, size: int) -> None:
        """One message of ``size`` bytes (ZMTP framing included) forwarded down."""
        self.stats.messages += 1
        self.stats.bytes_down += size
        self.stats.largest = max(self.stats.largest, size)

    async def _drain_messages(
        self, queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter, conn: int, idle: asyncio.Event,
    ) -> None:
        parser, index = ZmtpParser(), 0
        while True:
            if queue.empty():
                idle.set()
            arrived, data = await queue.get()
            if not data:
                return
            await self._late(arrived)
            if self.tamper is None:  # nothing to rewrite: the bytes go on as they come, the messages only counted
                for unit in () if self.raw else parser.feed(data):
                    if isinstance(unit, list):
                        self._count(sum(len(f) + (9 if len(f) > 255 else 2) for f in unit))
                await self._write(writer, data)
                continue
            for unit in parser.feed(data):
                if isinstance(unit, bytes):
                    await self._write(writer, unit)
                    continue
                w = Wire(unit, parse_header(unit[0]), index, conn)
                index += 1
                if isinstance(self.tamper, Stall) and self.tamper.wants(w):
                    self.tamper.hits += 1
                    raw = w.encode()
                    writer.write(raw[: int(len(raw) * self.tamper.fraction)])
                    await writer.drain()
                    self.tamper.stalled.set()
                    await self.tamper.released.wait()
                    if not self.tamper.finish:
                        writer.transport.abort()
                        return
                    writer.write(raw[int(len(raw) * self.tamper.fraction):])
                    continue
                for out in self.tamper.emit(w) if self.tamper is not None else [w]:
                    raw = out.encode()
                    self._count(len(raw))
                    await self._write(writer, raw)
            await writer.drain()


def _hostport(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


async def _main(args: argparse.Namespace) -> None:
    proxy = Proxy(_hostport(args.upstream), _hostport(args.listen), delay=args.delay)
    async with proxy:
        print(json.dumps({"event": "proxy", "endpoint": proxy.endpoint}), flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept receivers on (port 0: any)")
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the sender")
    parser.add_argument("--delay", type=float, default=0.0, help="one-way delay in seconds, each direction")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(parser.parse_args()))
    sys.exit(0)
