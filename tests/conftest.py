"""Shared test settings."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:
    from daemon_helpers import Processes

# The tests' models are tiny and two cores are shared by trainers, daemons and their
# decode threads: OpenMP workers only oversubscribe them. Subprocesses inherit this.
os.environ["OMP_NUM_THREADS"] = "1"


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile numba's kernels (or load them from its cache) once, before the first test.

    A fresh clone has no cache: without this the first tests that start processes (a
    trainer and three rollouts in ``test_async_rl.py``) each JIT the same kernels at once,
    ~50 s apiece on 2 cores, inside their set-up timeouts. Processes started later load
    what this wrote."""
    import receiver.apply.warmup
    import sender.diff.warmup

    started = time.perf_counter()
    sender.diff.warmup.compile_kernels()
    receiver.apply.warmup.compile_kernels()
    if (seconds := time.perf_counter() - started) > 5:
        print(f"\nnumba kernels compiled in {seconds:.0f} s (cached for later runs)")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- daemon processes -------------------------------------------------------------------------
@pytest.fixture
async def procs(tmp_path: Path) -> AsyncIterator[Processes]:
    """Daemon CLIs a test starts (``procs.spawn``), their logs in ``tmp_path``: whatever is
    still running at the end is SIGKILLed, always."""
    from daemon_helpers import Processes  # torch, the examples' model: only for the tests that start processes

    p = Processes(tmp_path)
    try:
        yield p
    finally:
        await p.cleanup()


# -- reliability figures ----------------------------------------------------------------------
# Fault tests record what they measured (versions published and applied, resyncs, integrity
# errors caught, reconnects, digests equal) through the ``reliability`` fixture. The figures
# are printed in the terminal summary and merged into tests/.reliability.json (gitignored),
# keyed by test id, which docs/reliability.md's table is made from.
RELIABILITY_FILE = Path(__file__).resolve().parent / ".reliability.json"
_FIGURES: dict[str, dict[str, Any]] = {}


class Reliability:
    """One test's figures: ``record(applied=..., resyncs=...)``, called any number of times."""

    def __init__(self, test_id: str) -> None:
        self.test_id = test_id

    def record(self, **figures: Any) -> None:
        _FIGURES.setdefault(self.test_id, {}).update(figures)


@pytest.fixture
def reliability(request: pytest.FixtureRequest) -> Reliability:
    return Reliability(request.node.nodeid.removeprefix("tests/"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand this worker's figures to the controller, which prints
    and merges them (``pytest_testnodedown``)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["reliability"] = json.dumps(_FIGURES)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the controller, as each worker ends
def pytest_testnodedown(node: Any, error: Any) -> None:
    _FIGURES.update(json.loads(getattr(node, "workeroutput", {}).get("reliability", "{}")))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FIGURES:
        return
    try:
        merged = json.loads(RELIABILITY_FILE.read_text())
    except (OSError, ValueError):
        merged = {}
    merged.update(_FIGURES)
    with contextlib.suppress(OSError):
        RELIABILITY_FILE.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    terminalreporter.section("reliability figures")
    for test_id, figures in _FIGURES.items():
        terminalreporter.write_line(f"{test_id}: {json.dumps(figures, sort_keys=True)}")
    terminalreporter.write_line(f"(merged into {RELIABILITY_FILE})")
