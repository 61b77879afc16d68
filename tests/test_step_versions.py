"""The vLLM backend's record of which weight version each engine step ran with
(receiver/held/steps.py) and the worker extension that returns it, on a real torch module
(the engines themselves: tests/test_vllm.py's AsyncLLM and ``vllm serve`` tests)."""

from __future__ import annotations

import itertools
import threading

import torch

from receiver.held.steps import StepVersions
from receiver.vllm.extension import WeightsyncWorker


class Held:
    version: int | None = None


def test_each_forward_is_a_step_at_the_version_held_then() -> None:
    held = Held()
    steps = StepVersions(lambda: held.version)
    model = torch.nn.Linear(4, 4)
    handle = model.register_forward_pre_hook(steps.forward)
    x = torch.ones(1, 4)
    model(x)  # before any version (a warm-up)
    for version, count in ((0, 3), (1, 1), (3, 2)):
        held.version = version
        for _ in range(count):
            model(x)
    handle.remove()
    model(x)  # unhooked: not counted
    snap = steps.snapshot()
    assert snap["version"] == 3 and snap["steps"] == 7
    assert snap["runs"] == [
        {"version": None, "first_step": 1, "last_step": 1},
        {"version": 0, "first_step": 2, "last_step": 4},
        {"version": 1, "first_step": 5, "last_step": 5},
        {"version": 3, "first_step": 6, "last_step": 7},
    ]


def test_only_the_last_runs_are_kept() -> None:
    held = Held()
    steps = StepVersions(lambda: held.version, limit=3)
    for version in range(10):
        held.version = version
        steps.forward()
        steps.forward()
    runs = steps.snapshot()["runs"]
    assert [r["version"] for r in runs] == [7, 8, 9]
    assert runs[-1] == {"version": 9, "first_step": 19, "last_step": 20}


def test_a_snapshot_taken_while_steps_run_is_whole() -> None:
    """Steps on one thread, versions changing, snapshots on another: every snapshot's runs
    tile the steps it reports, with no gap or overlap."""
    held = Held()
    held.version = 0
    steps = StepVersions(lambda: held.version)
    done = threading.Event()

    def run() -> None:
        for i in range(20000):
            if i % 97 == 0:
                held.version = (held.version or 0) + 1
            steps.forward()
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    checked = 0
    while not done.is_set() or checked == 0:
        snap = steps.snapshot()
        runs = snap["runs"]
        if runs:
            assert runs[0]["first_step"] == 1 and runs[-1]["last_step"] == snap["steps"]
            assert all(a["last_step"] + 1 == b["first_step"] for a, b in itertools.pairwise(runs))
            checked += 1
    worker.join()
    assert steps.snapshot()["steps"] == 20000


def test_the_worker_extension_answers_before_init_and_after() -> None:
    class Worker(WeightsyncWorker):
        weight_transfer_engine = None

    worker = Worker()
    assert worker.weightsync_versions() == {"version": None, "steps": 0, "runs": []}

    class Engine:
        step_versions = StepVersions(lambda: 5)

    worker.weight_transfer_engine = Engine()
    Engine.step_versions.forward()
    assert worker.weightsync_versions() == {"version": 5, "steps": 1, "runs": [{"version": 5, "first_step": 1, "last_step": 1}]}
