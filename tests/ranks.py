"""Spawning real torch.distributed ranks for a test: one process each, bounded in time."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp


@contextlib.contextmanager
def running_ranks(worker: Callable[..., None], world: int, args: tuple[Any, ...]) -> Iterator[mp.ProcessContext]:
    """``worker(rank, *args)`` started on ``world`` spawned processes, not waited for: the
    caller waits (``wait_ranks``, ``wait_file``); every process still alive on exit is killed."""
    context = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    try:
        yield context
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()


def wait_ranks(context: mp.ProcessContext, seconds: float, why: str) -> None:
    """Until every rank has ended: a rank that raised raises here with its traceback
    (``ProcessRaisedException``), a run past ``seconds`` is a ``TimeoutError`` saying ``why``."""
    ends = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > ends:
            raise TimeoutError(f"the {len(context.processes)}-rank run did not finish in {seconds:.0f}s ({why})")


def wait_file(context: mp.ProcessContext, path: Path, seconds: float, what: str) -> str:
    """The text of ``path`` once a rank has written it (written whole: to a temporary name, then
    renamed), watching the ranks meanwhile: one that raised raises here, all gone without it or
    ``seconds`` past is an error naming ``what``."""
    ends = time.monotonic() + seconds
    while not path.exists():
        if context.join(timeout=0.05):
            raise RuntimeError(f"the ranks ended without writing {what} ({path})")
        if time.monotonic() > ends:
            raise TimeoutError(f"the ranks did not write {what} in {seconds:.0f}s ({path})")
    return path.read_text()


def write_file(path: Path, text: str) -> None:
    """``path`` written whole: to a temporary name, then renamed (what ``wait_file`` reads)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.rename(path)


def spawn_ranks(worker: Callable[..., None], world: int, args: tuple[Any, ...], deadline: float, why: str = "a collective mismatch hangs") -> None:
    """Run ``worker(rank, *args)`` on ``world`` spawned processes and wait for all of them; a run
    past ``deadline`` seconds fails the test (``why`` says what a hang would mean) and every
    process still alive is killed. A rank that raises fails the test with its traceback."""
    import pytest

    with running_ranks(worker, world, args) as context:
        try:
            wait_ranks(context, deadline, why)
        except TimeoutError as e:
            pytest.fail(str(e))
