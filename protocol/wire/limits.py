"""Bounds on every inbound message, checked before anything is allocated for it.

A peer (buggy, or hostile behind a stolen key) decides how many frames and how many
bytes it sends. ZeroMQ enforces ``frame_bytes`` itself (``MAXMSGSIZE``: a larger frame
drops the connection before it is buffered); the sockets count frames and bytes as
parts arrive and discard the rest of a message past ``frames`` or ``message_bytes``;
``decode_message`` checks ``header_bytes`` before msgpack parses the header and
``tensors`` before any entry is built. Exceeding one is a ``LimitError``
(``protocol.errors``); a bound that is not a positive int, a ``ConfigError``.

``Limits.for_model`` derives bounds from the model a daemon serves: nothing legitimate
comes near them, and nothing much larger gets through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import ConfigError, LimitError

MiB = 1 << 20
MAX_BUFFERS_PER_TENSOR = 9  # one per Role (protocol/wire/framing.py)
WIDEST_ITEMSIZE = 8  # a frame may carry a tensor at a wider dtype than the receiver's (bucket_dtype)
TABLE_MARGIN = 64 << 10  # per tensor: entropy-coder tables and compressor overhead


@dataclass(frozen=True)
class Limits:
    """Per-message bounds. Defaults fit any model up to ~1M tensors of 8G elements;
    daemons use ``for_model`` to tighten them to their own model."""

    header_bytes: int = 256 * MiB
    frames: int = 1 << 22
    frame_bytes: int = 1 << 36
    message_bytes: int = 1 << 40
    tensors: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("header_bytes", "frames", "frame_bytes", "message_bytes", "tensors"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ConfigError(f"Limits.{name} must be a positive int, got {getattr(self, name)!r}")

    @classmethod
    def for_model(cls, tensors: Mapping[str, torch.Tensor], *, min_frame_bytes: int = 0) -> Limits:
        """Bounds for messages about ``tensors``: a frame holds at most one whole tensor at
        8 bytes an element (plus compressor overhead), a message at most every tensor,
        a header at most one manifest entry per buffer of every tensor and its metadata.
        ``min_frame_bytes``: e.g. the bucket size, when a transport packs more per frame."""
        n = max(1, len(tensors))
        numels = [t.numel() for t in tensors.values()] or [0]
        names = sum(len(k.encode()) for k in tensors)
        frame = WIDEST_ITEMSIZE * max(numels) + TABLE_MARGIN + MiB
        return cls(
            header_bytes=MiB + 2 * names + 1024 * n,
            frames=1 + MAX_BUFFERS_PER_TENSOR * n,
            frame_bytes=max(frame, min_frame_bytes),
            message_bytes=WIDEST_ITEMSIZE * sum(numels) + TABLE_MARGIN * n + MiB,
            tensors=n,
        )

    @classmethod
    def for_control(cls, tensors: Mapping[str, torch.Tensor]) -> Limits:
        """Bounds for what a sender receives: HELLO, acks, heartbeats. No payload frames;
        the largest header is a HELLO listing every key's name, shape and dtype."""
        n = max(1, len(tensors))
        names = sum(len(k.encode()) for k in tensors)
        header = MiB + 2 * names + 256 * n
        return cls(header_bytes=header, frames=1, frame_bytes=header, message_bytes=header, tensors=1)


DEFAULT_LIMITS = Limits()


class MessageCounter:
    """Counts one message's parts as they arrive: the socket keeps (or discards) each part
    by what this says, so an oversized message never accumulates in memory."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.frames = 0
        self.nbytes = 0
        self.error: LimitError | None = None

    def add(self, nbytes: int) -> bool:
        """Count a part; False once the message is over a limit (keep draining, keep nothing)."""
        self.frames += 1
        self.nbytes += nbytes
        if self.error is None:
            lim = self.limits
            if self.frames == 1 and nbytes > lim.header_bytes:
                self.error = LimitError("header bytes", nbytes, lim.header_bytes)
            elif nbytes > lim.frame_bytes:
                self.error = LimitError("frame bytes", nbytes, lim.frame_bytes)
            elif self.frames > lim.frames:
                self.error = LimitError("frame count", self.frames, lim.frames)
            elif self.nbytes > lim.message_bytes:
                self.error = LimitError("message bytes", self.nbytes, lim.message_bytes)
        return self.error is None


async def read_bounded(recv_part: Callable[[], Awaitable[Any]], limits: Limits) -> list[memoryview]:
    """The parts of one message from ``recv_part`` (a ZeroMQ ``recv(copy=False)``: frames
    with ``.buffer`` and ``.more``), counted as they arrive. Past a limit the rest is read
    and dropped (a message arrives whole, so this never waits) and ``LimitError`` raised."""
    counter = MessageCounter(limits)
    kept: list[memoryview] = []
    while True:
        frame = await recv_part()
        if counter.add(len(frame)):
            kept.append(frame.buffer)
        elif kept:
            kept.clear()
        if not frame.more:
            break
    if counter.error is not None:
        raise counter.error
    return kept
