"""The progress of a whole model arriving at a receiver: a bootstrap, a resync, a bucket version.

Counted by the connection's received bytes where the kernel says (TCP on Linux: one
bucket can be large, and its bytes are counted as they arrive), else message by message.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from protocol.progress import Progress
from protocol.state import StateLike, state_tensors
from protocol.wire.framing import MessageType

log = logging.getLogger(__name__)

WATCH_EVERY = 0.25  # seconds between reads of the connection's byte count
WHOLE_MODEL = (MessageType.BOOTSTRAP, MessageType.BUCKET)  # versions that carry the whole model: their progress is logged


def model_bytes(state: StateLike) -> int | None:
    """What a bootstrap of the whole model about weighs: its tensors at their dtypes, each
    storage once (None where the model is not plain tensors): the progress lines' total."""
    try:
        once = {t.data_ptr(): t.numel() * t.element_size() for t in state_tensors(state).values()}  # tied: once
        return sum(once.values())
    except Exception:
        return None


class Link(Protocol):
    """What is watched: a connection's received-byte count (``Session.bytes_received``)."""

    def bytes_received(self) -> int | None: ...


class Incoming:
    """A whole model arriving on ``link``: ``progress`` by the connection's received-byte count
    where it can be read, else message by message. ``close`` ends it (its owner must)."""

    def __init__(self, link: Link, progress: Progress) -> None:
        self.link, self.progress = link, progress
        self.watcher: asyncio.Task[None] | None = None

    def watch(self) -> None:
        """Count the connection's bytes from now on, where it can be read."""
        if self.watcher is None and self.link.bytes_received() is not None:
            self.watcher = asyncio.create_task(_watch_received(self.link, self.progress), name="weightsync-receiver-progress")

    def message(self, nbytes: int) -> None:
        """A message of the transfer has arrived (the first one of a resync starts the count
        of bytes: only once it is whole does its type say that a whole model comes)."""
        if self.watcher is not None:
            return  # counted as its bytes arrived
        self.progress.advance(nbytes)
        self.watch()

    async def close(self) -> None:
        """Stop the watcher and log the end. A watcher that failed meanwhile only cost the
        progress figures: its error is logged (WARNING), not raised into the transfer."""
        watcher, self.watcher = self.watcher, None
        try:
            if watcher is not None:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
                if not watcher.cancelled() and (error := watcher.exception()) is not None:
                    log.warning("%s: counting its progress failed: %r", self.progress.what, error, exc_info=error)
        finally:
            self.progress.finish()


async def _watch_received(link: Link, progress: Progress) -> None:
    """Advance ``progress`` by the bytes ``link`` receives (its kernel's count), until cancelled."""
    start = link.bytes_received()
    seen = 0
    while start is not None:
        await asyncio.sleep(WATCH_EVERY)
        now = link.bytes_received()
        if now is None:
            return
        progress.advance(max(0, now - start - seen))
        seen = max(seen, now - start)
