"""A readers-writer lock for the model: rollouts read it, the receiver writes new versions.

Usable from asyncio tasks (``async with lock.reading()``) and from plain threads
(``with lock.reading_sync()``), since inference often runs in a thread. Writers are
preferred: once a version is waiting to be committed, new readers wait for it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager


class ReadWriteLock:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    # -- blocking primitives (any thread) ----------------------------------------------
    def acquire_read(self, blocking: bool = True) -> bool:
        with self._cond:
            if not blocking and (self._writer or self._writers_waiting):
                return False
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
            return True

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    def acquire_write(self, blocking: bool = True) -> bool:
        with self._cond:
            if not blocking and (self._writer or self._readers):
                return False
            self._writers_waiting += 1
            try:
                self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            finally:
                self._writers_waiting -= 1
            self._writer = True
            return True

    def release_write(self) -> None:
        with self._cond:
            self._writer = False
            self._cond.notify_all()

    # -- context managers -----------------------------------------------------------------
    @contextmanager
    def reading_sync(self) -> Iterator[None]:
        self.acquire_read()
        try:
            yield
        finally:
            self.release_read()

    @asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        await _acquire(self.acquire_read, self.release_read)
        try:
            yield
        finally:
            self.release_read()

    @asynccontextmanager
    async def writing(self) -> AsyncIterator[None]:
        await _acquire(self.acquire_write, self.release_write)
        try:
            yield
        finally:
            self.release_write()


async def _acquire(acquire: Callable[[bool], bool], release: Callable[[], None]) -> None:
    """Take the lock without blocking the event loop; a cancelled wait never leaks it."""
    if acquire(False):
        return
    waiter = asyncio.ensure_future(asyncio.to_thread(acquire, True))
    try:
        await asyncio.shield(waiter)
    except asyncio.CancelledError:
        waiter.add_done_callback(lambda f: None if f.cancelled() or f.exception() else release())
        raise
