"""A Megatron trainer at TP=2 followed by a real vLLM engine (run by tests/test_megatron_vllm.py,
in the Megatron venv).

Two gloo ranks (spawned here) train a tiny untied Qwen2 built through Megatron-Bridge and sync
it through ``ShardedSync(MegatronLayout)``: rank 0 holds the Sender. This process holds the
engine (``examples/vllm_rollout.py``'s ``engine``: bf16, TP=1, from dummy weights, the
weightsync backend), bootstrapped from the Sender at v1. They step in lockstep through files
(``tests.megatron_sync.Lockstep``): after each version rank 0 saves the bridge's own
``export_hf_weights`` of that step, cast to bf16, as a checkpoint; the engine updates to the
version and reads every element it holds against it. At the end the engine's greedy tokens,
logprobs and vLLM checksums are compared with the same engine reloaded in place by vLLM from the last checkpoint.
Every wait is bounded; a hang is an error that says where. Prints one JSON line.

    .venv-megatron/bin/python tests/megatron_vllm.py
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # weights_differing runs in the workers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

LRS = (1e-5, 1e-2, 1e-5)  # v1 bootstraps the engine; 1e-2 changes most elements: those tensors travel dense
TIMEOUT = 180.0  # seconds, each wait of either side


def engine_keys(worker: Any) -> list[str]:
    """Run in each worker: the checkpoint names the engine's runtime map holds."""
    return sorted(worker.weight_transfer_engine.layout.tensors)


def held_version(worker: Any) -> int | None:
    """Run in each worker: the version its weights hold (weightsync's; vLLM's label is
    ``finish_weight_update``'s, which a bootstrap does not call)."""
    return worker.weight_transfer_engine.held.version  # type: ignore[no-any-return]


def main() -> dict[str, Any]:
    """The run, in a temporary directory removed after it."""
    work = Path(tempfile.mkdtemp(prefix="weightsync-megatron-vllm-"))
    try:
        return run(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from examples.vllm_rollout import CONFIG, checksums, compare, engine, generate, reloaded, weights_differing
    from tests.megatron_ranks import Layout, Tiny, free_port, save_tiny_hf
    from tests.megatron_sync import Lockstep, engine_worker
    from tests.ranks import running_ranks, wait_file, wait_ranks

    started = time.perf_counter()
    t0 = time.time()
    tiny = Tiny(hidden=128)  # 4 heads: head_dim 32, the least vLLM's CPU attention takes
    layout = Layout(tp=2)
    hf_dir = work / "hf"
    save_tiny_hf(hf_dir, tiny)
    tokens = torch.randint(0, tiny.vocab, (1, 17), generator=torch.Generator().manual_seed(1))
    lockstep = Lockstep(str(work), TIMEOUT)
    args = (layout.world, free_port(), str(hf_dir), layout, tokens, tiny.hidden, LRS, CONFIG, lockstep)
    out: dict[str, Any] = {"versions": [], "at_s": {}}  # at_s: seconds from the start to each phase's end

    def mark(phase: str) -> None:
        out["at_s"][phase] = round(time.perf_counter() - started, 1)

    with running_ranks(engine_worker, layout.world, args) as ranks:
        llm = engine(str(hf_dir), weightsync=True, tp=1, dummy=True, in_process=True)  # dummy weights: the files are not read
        mark("engine_up")
        endpoint = wait_file(ranks, lockstep.path("endpoint"), TIMEOUT, "the Sender's endpoint")
        mark("endpoint")
        out["at_s"]["endpoint_written"] = round(lockstep.path("endpoint").stat().st_mtime - t0, 1)
        llm.init_weight_transfer_engine({"init_info": {"endpoint": endpoint, "config": CONFIG, "timeout": TIMEOUT}})
        mark("init")
        out["keys"] = llm.collective_rpc(engine_keys)
        for version in range(1, len(LRS) + 1):
            figures = json.loads(wait_file(ranks, lockstep.path(f"v{version}.json"), TIMEOUT, f"v{version}"))
            if version > 1:  # v1: the bootstrap, held once init returned
                llm.start_weight_update()
                llm.update_weights({"update_info": {"version": version, "timeout": 60}})
                llm.finish_weight_update(str(version))
            checkpoint = str(lockstep.path(f"v{version}"))
            figures.update(held=llm.collective_rpc(held_version), differing=llm.collective_rpc(weights_differing, args=(checkpoint,)),
                           outputs=generate(llm))
            out["versions"].append(figures)
            mark(f"v{version}")
            lockstep.path(f"v{version}.ack").write_text("")
        final = out["versions"][-1]["outputs"]
        ours = checksums(llm)
        # vLLM's own load path of the last export, in place (its loader and post-load processing;
        # a second engine start would cost this test about 25 s more: tests/test_vllm.py starts fresh ones)
        expected, theirs = reloaded(llm, checkpoint)
        mark("reloaded")
        del llm
        gc.collect()
        wait_ranks(ranks, TIMEOUT, "the ranks' last version and close")
    out.update(compare(final, expected, tp=1))
    out["checksums_equal"] = ours == theirs
    out["checksums_differing"] = [sorted(k for k in a if a[k] != b.get(k)) for a, b in zip(ours, theirs)]
    out["saved_keys"] = sorted(load_file(str(Path(checkpoint) / "model.safetensors")))
    return out


if __name__ == "__main__":
    print(json.dumps({"summary": main()}), flush=True)
