"""How far a patch's compare may run ahead of its encoder.

The compare is the faster stage: unbounded, it holds most of a version's raw changes
(positions and old and new values: 8 bytes a bf16 change) while the encoder threads
catch up, which is what the sender's memory grows by. ``Backlog`` counts the captured
bytes handed to the encoder and not yet coded (``Changes.pending_nbytes``: not the whole
copies the sender keeps from version to version anyway, which holding back would not save),
and the compare waits, before it goes on to the next tensor, until the bytes waiting ahead
of the one it just handed over fit the limit: the encoder is never left idle, and at most
the limit plus about two tensors' changes are held. With patch parts sent while the compare runs (``PatchBuilder.build``), the
wait does not hold back the first parts, only ``sync()``'s return.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any


class Backlog:
    """Captured bytes the encoder has yet to code, and a wait until few enough are.

    Thread-safe: the compare adds and waits on its thread, the encoder's futures release on
    theirs. What waits ahead of the last item is what was added before it, less what was
    released (with several encoder threads, the last item itself may be among it): whatever
    order they finish in, the bytes held stay within ``limit`` plus the last item's.
    ``limit`` 0: never wait."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._cond = threading.Condition()
        self._added = 0
        self._ahead = 0  # bytes added before the last item
        self._released = 0

    def add(self, nbytes: int, encoded: Future[Any]) -> Future[Any]:
        """Count ``nbytes`` until ``encoded`` is done, however it ends; ``encoded``."""
        with self._cond:
            self._ahead = self._added
            self._added += nbytes
        encoded.add_done_callback(lambda _: self._release(nbytes))
        return encoded

    @property
    def pending(self) -> int:
        """Bytes added and not yet encoded."""
        with self._cond:
            return self._added - self._released

    def wait(self) -> float:
        """Until no more than ``limit`` of the bytes added before the last item wait; the seconds waited."""
        with self._cond:
            if not self.limit or self._ahead - self._released <= self.limit:
                return 0.0
            started = time.perf_counter()
            self._cond.wait_for(lambda: self._ahead - self._released <= self.limit)
            return time.perf_counter() - started

    def _release(self, nbytes: int) -> None:
        with self._cond:
            self._released += nbytes
            self._cond.notify_all()
