"""What adapter-only LoRA sync moves per version and how long it holds a vLLM engine.

    python -m benchmarks.vllm_lora --json OUT.json [--steps 5] [--hidden 512 --layers 4 --rank 16]

The trainer of examples/vllm_lora.py (a Qwen2 of the given shape, frozen, with two
PEFT-layout adapters on every attention and MLP projection, AdamW on the adapters) syncs
both adapters each version to one offline ``vllm.LLM`` (CPU build, ``enable_lora``) through
the ``weightsync`` backend with ``init_info.lora``. Per version:

* ``adapter_wire_bytes``: what the Sender tracking the adapters sent (every frame);
* ``merged_wire_bytes``: what a second Sender, tracking the same model with adapter
  ``default`` merged into its base weights (W + B A alpha / r, the merged reload), sends as a
  weightsync patch of that version to a bf16 ``Receiver`` of its own (measured: a low-rank
  update changes nearly every element of a merged matrix, so its tensors travel dense);
  ``dense_bytes`` the whole bf16 checkpoint a dense reload sends;
* ``hold_s``: ``start_weight_update`` .. ``finish_weight_update`` through the ``LLM`` API,
  as a caller sees it (vLLM drops and weightsync re-registers the adapters inside
  ``finish``); ``commit_s`` / ``check_s``: the worker's commit, and its read-back within it;
* ``dense_reload_s``: vLLM's own checkpoint-format reload of the whole model in the same
  engine (``benchmarks/vllm_hold.py``'s ``dense_reload``: what the ``nccl`` / ``ipc``
  backends run between start and finish for merged weights; the transfer not included, so
  a floor of a merged reload's hold). It reloads the base checkpoint (the same bytes as a
  merged one), and the engine's tensors are put back after.

Medians over ``--steps`` versions on this machine.
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
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32.0)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    from benchmarks.vllm_hold import time_dense_reload
    from examples.vllm_lora import CONFIG, Trainer, engine_state, make_engine
    from examples.vllm_rollout import tiny_config
    from receiver import Receiver
    from sender import Sender

    config = tiny_config(True, args.layers, args.hidden, args.heads, args.kv_heads)
    trainer = Trainer(args.rank, args.alpha, args.lr, config=config)
    merged = Sender("tcp://127.0.0.1:0", CONFIG)
    trainer.run(merged.__aenter__())
    trainer.run(merged.start(trainer.merged_state(), version=0))
    rollout = Receiver({k: v.to(torch.bfloat16) for k, v in trainer.merged_state().items()}, merged.endpoint, CONFIG, identity="merged")
    trainer.run(rollout.__aenter__())
    trainer.run(rollout.start(timeout=120))
    workdir = tempfile.mkdtemp(prefix="weightsync-lora-bench-")
    trainer.base.config.save_pretrained(workdir)
    save_file(trainer.base_state, f"{workdir}/model.safetensors")
    llm = make_engine(workdir, 1, args.rank)
    started = time.perf_counter()
    llm.init_weight_transfer_engine({"init_info": {"endpoint": trainer.sender.endpoint, "config": CONFIG, "timeout": 120,
                                                   "lora": trainer.lora_spec()}})
    init_s = time.perf_counter() - started
    rows: list[dict[str, Any]] = []
    for _ in range(args.steps):
        step = trainer.step()
        stats = trainer.run(merged.sync(trainer.merged_state(), version=trainer.version))
        trainer.run(merged.flush())
        trainer.run(rollout.wait_for_version(trainer.version, timeout=60))
        started = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": trainer.version, "timeout": 60}})
        llm.finish_weight_update(str(trainer.version))
        hold = time.perf_counter() - started
        timing = llm.collective_rpc(engine_state)[0]["timing"]
        dense_reload = max(llm.collective_rpc(time_dense_reload, args=(f"{workdir}/model.safetensors",)))
        rows.append({
            "version": trainer.version, "adapter_wire_bytes": step["wire_bytes"], "adapter_changed_fraction": step["changed_fraction"],
            "merged_wire_bytes": int(stats.wire_bytes), "merged_changed_fraction": round(stats.changed_fraction, 4),
            "dense_bytes": trainer.merged_bytes()[1], "hold_s": round(hold, 4), "commit_s": round(timing.get("commit_s", 0.0), 4),
            "check_s": round(timing.get("check_s", 0.0), 4), "dense_reload_s": round(dense_reload, 4),
        })
        print(json.dumps(rows[-1]), flush=True)
    keys = [k for k in rows[0] if k != "version"]
    medians = {k: statistics.median(r[k] for r in rows) for k in keys}
    doc = {
        "benchmark": "vllm_lora", "command": "python -m benchmarks.vllm_lora " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "shape": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads, "rank": args.rank,
                  "adapters": 2, "adapter_bytes": trainer.adapter_bytes(), "merged_target_bytes": trainer.merged_bytes()[0]},
        "init_s": round(init_s, 3), "rows": rows, "medians": medians,
    }
    trainer.run(rollout.__aexit__(None, None, None))
    trainer.run(merged.__aexit__(None, None, None))
    trainer.close()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print(json.dumps({"medians": medians}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
