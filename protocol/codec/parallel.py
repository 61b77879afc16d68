"""One small thread pool for per-tensor codec work: the receiver's decode, and the sender's
encode of a small state compared on the event loop's thread (a larger one is encoded by one
thread beside its compare: ``PatchBuilder.collect``).

The codec's kernels (numba, torch) release the GIL, so the tensors of one message can
encode or decode in parallel threads; between the kernels each tensor runs Python
(buffer packing, checks, small numpy calls) that holds it. Which wins depends on the
tensors and the host, so the default was chosen by measurement on the 2-core
development machine (while other work ran on it):

* end to end (``python -m benchmarks --suite quick --only real-bf16-lr1e-6
  real-bf16-lr1e-5 --no-memory``, 3 runs each way, alternated, median of 9 steps): at
  lr 1e-5 two threads took 134 ms against 231 ms for one (the receivers' decode 47
  against 97 ms); at lr 1e-6 73 against 76 ms: even;
* one process alone (``python -m benchmarks.micro --only pool``), two threads lose to
  GIL contention: 24 tensors of 65k elements encode 1.1-2x and decode 1.3-2.2x slower,
  8 of 1M elements 1.1x slower.

So the default stays one thread per core up to 4 (``DEFAULT_WORKERS``). ``WORKERS`` is
the knob: set it, or ``WEIGHTSYNC_CODEC_THREADS`` in the environment before the first
import (1 = a plain loop). Results keep the input order and the first exception
propagates, as with a plain loop.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from protocol.errors import ConfigError

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_WORKERS = max(1, min(4, os.cpu_count() or 1))
ENV = "WEIGHTSYNC_CODEC_THREADS"


def _from_env() -> int:
    value = os.environ.get(ENV, "").strip()
    if not value:
        return DEFAULT_WORKERS
    try:
        workers = int(value)
    except ValueError:
        raise ConfigError(f"{ENV}={value!r}: expected a whole number of threads (1 or more)") from None
    if workers < 1:
        raise ConfigError(f"{ENV}={value!r}: expected a whole number of threads (1 or more)")
    return workers


WORKERS = _from_env()
_pool: ThreadPoolExecutor | None = None
_pool_workers = 0
_lock = threading.Lock()


def map_ordered(fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """``[fn(x) for x in items]``, spread over ``WORKERS`` threads when there is more than one item."""
    workers = WORKERS
    if len(items) < 2 or workers <= 1:
        return [fn(x) for x in items]
    global _pool, _pool_workers
    with _lock:
        if _pool is None or _pool_workers != workers:  # WORKERS changed since the pool started
            if _pool is not None:
                _pool.shutdown(wait=False)  # maps already running on it finish
            _pool, _pool_workers = ThreadPoolExecutor(workers, thread_name_prefix="weightsync-codec"), workers
        pool = _pool
    return list(pool.map(fn, items))
