"""What a patch's compare hands on: each tensor's ``Captured`` changes, and the stream
that carries them, in order, from the compare's thread to the task that cuts and encodes
them into parts while the compare goes on."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from protocol.codec.tensorcodec import EncodedTensor

from ..diff.changes import Changes
from .builder import BuildFailed


@dataclass(frozen=True)
class Captured:
    """One tensor's (or group's) collected changes: the bytes the capture held (what parts
    are cut by), and either its encoding, under way since it was collected, or the changes
    themselves, to encode with their part."""

    nbytes: int
    encoded: Future[EncodedTensor] | None
    changes: Changes | None = None


class CapturedStream:
    """A version's ``Captured`` in order, handed from the compare (on its thread, or the
    loop's) to the task that encodes and publishes it as parts while the compare goes on.
    Iterating ends once the compare is done, or raises ``BuildFailed`` if it was not."""

    _END = object()

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Captured) -> Captured:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        return item

    def close(self, failed: BaseException | None = None) -> None:
        """The compare is over (``failed``: it raised); safe from any thread, and after the loop closed."""
        end = self._END if failed is None else BuildFailed(repr(failed))
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is left reading
            self._loop.call_soon_threadsafe(self._queue.put_nowait, end)

    def __aiter__(self) -> CapturedStream:
        return self

    async def __anext__(self) -> Captured:
        item = await self._queue.get()
        if item is self._END:
            raise StopAsyncIteration
        if isinstance(item, BuildFailed):
            raise item
        return item
