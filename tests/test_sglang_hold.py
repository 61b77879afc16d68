"""``benchmarks/sglang_hold.py`` on a real SGLang engine (CPU), small model, two versions: every
path is measured, and the engine generates the same after weightsync's update as after SGLang's
own disk reload of that version.

Runs in SGLang's venv (``make sglang-env``), as ``tests/test_sglang_weightsync.py`` does; anywhere
else it skips.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from sglang_env import require_sglang

require_sglang(__file__)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(400)


def test_hold_benchmark_measures_every_path_and_matches_the_disk_reload(tmp_path: Path) -> None:
    out = tmp_path / "hold.json"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.sglang_hold", "--json", str(out), "--steps", "2", "--hidden", "128", "--layers", "1",
         "--vocab", "512", "--lr", "1e-4"],
        cwd=ROOT, capture_output=True, text=True, timeout=380,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["version"] for r in doc["rows"]] == [1, 2]
    assert doc["guard"]["equal"] and doc["guard"]["mismatched_versions"] == []
    assert [w["reloaded_layers"] for w in doc["init_workers"]] == [0]
    for row in doc["rows"]:
        assert row["guard_equal"] and row["flip_missing"] == []
        assert row["tokens_changed_from_previous"]  # the guard tells versions apart
        for key in ("weightsync_s", "weightsync_window_s", "weightsync_commit_s", "weightsync_status_s", "sglang_tensor_s",
                    "sglang_disk_s", "sglang_empty_window_s", "sglang_tiny_tensor_s", "full_copy_s", "save_s"):
            assert row[key] > 0, key
        assert row["weightsync_commit_s"] < row["weightsync_window_s"] <= row["weightsync_s"]
        assert row["weightsync_wire_bytes"] > 0  # lr 1e-4 changes most elements: not asked to be fewer than dense
    assert doc["medians"]["dense_bytes"] == doc["model"]["dense_bf16_bytes"]
