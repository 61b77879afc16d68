"""A patch's parts encoded into PATCH messages, and the encoder threads that do it.

Threads encode what a compare on a worker thread collects, each tensor as it comes, while
the compare goes on (docs/performance.md, *Encoding beside the compare*); the kernels
release the GIL, so several code tensors side by side. Each tensor's future keeps its
place: a part waits for its own tensors, in order, however they finish. An encoder that
codes a part at once (the device encoder) codes it here, when the part is made.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor

from protocol.codec.tensorcodec import EncodedTensor, assemble
from protocol.errors import WeightSyncError
from protocol.wire.framing import Encoding, Message, MessageType

from ..diff.changes import Changes
from ..stats import SyncStats
from .captured import Captured
from .encode import Encoder

ENCODE_THREADS_MAX = 4  # patch.encode_threads by default: half the cores, at most this many


def encode_threads(configured: int | None) -> int:
    """``patch.encode_threads``, or by default half this host's cores (the compare and the
    receivers' side of the host keep the rest), 1 to ``ENCODE_THREADS_MAX``."""
    if configured is not None:
        return configured
    return max(1, min(ENCODE_THREADS_MAX, (os.cpu_count() or 1) // 2))


class PartEncoder:
    """``encoder``'s parts of a patch, with ``threads`` encoder threads of its own (started
    as first needed, stopped by ``close``)."""

    def __init__(self, encoder: Encoder, threads: int) -> None:
        self.encoder = encoder
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="weightsync-encode")
        self._closed = False

    def submit(self, changes: Changes) -> Future[EncodedTensor]:
        """``changes`` encoded on an encoder thread, from now (a streaming encoder's)."""
        if self._closed:
            raise WeightSyncError("the patch builder is closed")
        return self._pool.submit(self._encode, changes)

    def _encode(self, changes: Changes) -> EncodedTensor:
        """One tensor's entry, on an encoder thread."""
        return self.encoder.encode_one(changes)

    async def part(
        self, captured: list[Captured], version: int, base: int | None, stats: SyncStats, part: int, last: bool
    ) -> Message:
        """The PATCH message of ``captured``, once each of its tensors is encoded (those
        collected without an encoding are encoded now, together)."""
        started = time.perf_counter()  # encoding the collect did not hide: waits for the encoder, and framing
        later = [c.changes for c in captured if c.changes is not None]
        coded = iter(await asyncio.to_thread(self.encoder.encode, later, stats) if later else [])
        encoded = [await asyncio.wrap_future(c.encoded) if c.encoded is not None else next(coded) for c in captured]
        stats.tensors_dense += sum(len(e.group) or 1 for e in encoded if e.encoding is Encoding.DENSE)
        specs, frames = assemble(encoded)
        stats.encode_seconds += time.perf_counter() - started
        return Message(MessageType.PATCH, version=version, base_version=base, tensors=specs, frames=frames, part=part, last=last)

    async def close(self) -> None:
        """Stop the encoder threads: encodings not started are cancelled, those running end
        first (waited for off the event loop). Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self._pool.shutdown, True)
