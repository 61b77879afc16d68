"""One small thread pool for per-tensor codec work.

The codec's kernels (numba, torch) release the GIL, so the tensors of one message
encode or decode in parallel on a multi-core host. Results keep the input order and
the first exception propagates, as with a plain loop."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

WORKERS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def map_ordered(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, spread over the pool when there is more than one item."""
    if len(items) < 2 or WORKERS == 1:
        return [fn(x) for x in items]
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="weightsync-codec")
    return list(_pool.map(fn, items))
