"""An SGLang engine following a trainer through weightsync, checked against a fresh engine.

    .venv-sglang/bin/python examples/sglang_rollout.py [--steps 4] [--tp 2] [--family llama] [--tie]

The trainer is a Hugging Face model (fp32, real AdamW steps) behind a ``Sender``
(``examples/vllm_rollout.py``'s ``Trainer``). The engine is an ``sglang.Engine`` started from
dummy weights with weightsync's loader (``custom_weight_loader=[receiver.sglang.LOADER]``);
``SGLangWeights`` bootstraps it to the trainer's version and, after every step, commits the
staged patch inside one SGLang weight-update window and labels the engine with the version
its workers hold. At the end the engine's greedy tokens and top-k logprobs must equal those of
a fresh engine loaded from the trainer's weights saved at that version. Prints one JSON line.

SGLang runs in its own environment (``make sglang-env``; docs/engines-sglang.md). TP=2 on a
CPU needs ``SGLANG_CPU_OMP_THREADS_BIND`` (one core set per rank), set here when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 3], [200, 7, 7, 7, 41, 8]]
TOP_K = 5


def start_engine(model_dir: str, *, tp: int = 1, weightsync: bool = True, **extra: Any) -> Any:
    """An SGLang engine on this CPU (the torch-native attention path); with ``weightsync``,
    from dummy weights and with weightsync's loader registered."""
    import sglang

    from receiver.sglang import LOADER

    if tp > 1:  # SGLang's CPU path binds each rank's threads to cores: one core set per rank
        cores = os.cpu_count() or tp
        per = max(1, cores // tp)
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(f"{r * per}-{r * per + per - 1}" for r in range(tp)))
    args: dict[str, Any] = dict(
        model_path=model_dir, device="cpu", attention_backend="torch_native", skip_tokenizer_init=True,
        mem_fraction_static=0.05, max_total_tokens=512, log_level="error", tp_size=tp,
    )
    if weightsync:
        args.update(custom_weight_loader=[LOADER], load_format="dummy")
    return sglang.Engine(**{**args, **extra})


def generate(engine: Any, new_tokens: int = 8) -> dict[str, Any]:
    """Each prompt's greedy tokens, and each new token's top-k (logprob, token) pairs."""
    outs = engine.generate(
        input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens},
        return_logprob=True, top_logprobs_num=TOP_K,
    )
    return {
        "tokens": [o["output_ids"] for o in outs],
        "top": [[[(lp, tok) for lp, tok, _ in step] for step in o["meta_info"]["output_top_logprobs"]] for o in outs],
    }


def label(engine: Any) -> str:
    return str(engine.get_model_info()["weight_version"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--family", default="qwen2", choices=("qwen2", "llama", "qwen3_moe"))
    parser.add_argument("--tie", action="store_true")
    parser.add_argument("--lr", type=float, default=2e-6)
    args = parser.parse_args(argv)

    from examples.vllm_rollout import CONFIG, Trainer, tiny_config
    from receiver.sglang.client import SGLangWeights

    config = llama_config(args.tie) if args.family == "llama" else tiny_config(args.tie, family=args.family)
    moe = args.family == "qwen3_moe"
    # transformers keeps a MoE's experts fused in memory (experts.gate_up_proj); checkpoints and
    # SGLang's loader name them expert by expert, so the trainer sends those names (views, no copies)
    trainer = Trainer(tie=args.tie, lr=args.lr, config=config, per_expert=moe)
    workdir = tempfile.mkdtemp(prefix="weightsync-sglang-")
    trainer.config.save_pretrained(workdir)
    extra = {"mem_fraction_static": 0.1} if moe else {}  # the experts' weights leave 0.05 too little KV cache
    engine = start_engine(workdir, tp=args.tp, **extra)
    out: dict[str, Any] = {"tp": args.tp, "family": args.family, "tie": args.tie, "steps": []}
    try:
        weights = SGLangWeights(engine)
        out["bootstrapped_to"] = weights.init(trainer.sender.endpoint, config=CONFIG, timeout=120)
        for _ in range(args.steps):
            step = trainer.step()
            started = time.perf_counter()
            step["held"] = weights.update(trainer.version)
            step["update_s"] = round(time.perf_counter() - started, 4)
            step["label"] = label(engine)
            out["steps"].append(step)
        final = generate(engine)
        weights.shutdown()
    finally:
        engine.shutdown()
    saved = tempfile.mkdtemp(prefix="weightsync-sglang-ref-")
    trainer.save(saved)
    trainer.close()
    fresh = start_engine(saved, tp=args.tp, weightsync=False, **extra)
    try:
        expected = generate(fresh)
    finally:
        fresh.shutdown()
    out["tokens_equal"] = final["tokens"] == expected["tokens"]
    out["logprobs_equal"] = final["top"] == expected["top"]
    print(json.dumps(out))
    return 0 if out["tokens_equal"] and out["logprobs_equal"] else 1


def llama_config(tie: bool) -> Any:
    """A second dense family: Llama (no qkv bias, rope, GQA), the vocabulary SGLang pads."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"],
    )


if __name__ == "__main__":
    sys.exit(main())
