"""Spawning real torch.distributed ranks for a test: one process each, bounded in time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple[Any, ...], deadline: float, why: str = "a collective mismatch hangs") -> None:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes and wait for all of them; a run
    past ``deadline`` seconds fails the test (``why`` says what a hang would mean) and every
    process still alive is killed. A rank that raises fails the test with its traceback."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    ends = time.monotonic() + deadline
    try:
        while not context.join(timeout=1):
            if time.monotonic() > ends:
                pytest.fail(f"the {world}-rank run did not finish in {deadline:.0f}s ({why})")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
