"""LoRA adapters kept in step with a trainer, in a vLLM engine's adapter slots.

The trainer is a tiny Hugging Face ``Qwen2ForCausalLM`` (frozen, bf16 weights saved for
vLLM to load) with two LoRA adapters in PEFT's layout, built by hand
(``base_model.model.<module>.lora_A.<adapter>.weight``: ``default`` and ``second``), and
real AdamW steps on them. A weightsync ``Sender`` tracks the adapters alone
(``sender.adapter_state``); the engine (``enable_lora=True``) runs the ``weightsync`` backend
with ``init_info.lora`` naming each adapter's id and name. Each version is committed into
the receiver's buffers; at ``finish_weight_update``, where vLLM drops every adapter, the
backend registers each one again from them and reads back what serves (the registered copy
and every layer's slot); requests name the adapter by ``LoRARequest(name, id, path)``
(``path`` is never read).

At every version the same engine also loads each adapter from disk, saved in PEFT's
format at that version, under a fresh id: greedy tokens and top-k logprobs of the patched
slot must equal the disk-loaded adapter's (within ``TP_LOGPROB_TOLERANCE`` at TP>1), and the
engine without an adapter must keep its first outputs (the base weights are untouched).
Before the real init (TP=1), an adapter declared at another rank is refused
(``AdapterMismatchError``) and leaves nothing registered. Prints one JSON line per version and a summary.

    python examples/vllm_lora.py --steps 3
    VLLM_CPU_OMP_THREADS_BIND="0|1" python examples/vllm_lora.py --tp 2 --steps 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: a tiny model needs little
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # engine_state runs in the workers as a function

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.vllm_rollout import CONFIG, PROMPTS, TP_LOGPROB_TOLERANCE, compare, tiny_config
from sender import Sender, adapter_state

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = {"default": (1, "policy"), "second": (2, "critic")}  # PEFT adapter name -> (vLLM id, lora_name)


class LoraLinear(nn.Module):
    """PEFT's LoRA layer, by hand: ``base_layer`` frozen, ``lora_A`` / ``lora_B`` per
    adapter, the active adapter's ``B(A(x)) * alpha / r`` added."""

    def __init__(self, base: nn.Linear, adapters: list[str], r: int, alpha: float) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({a: nn.Linear(base.in_features, r, bias=False) for a in adapters})
        self.lora_B = nn.ModuleDict({a: nn.Linear(r, base.out_features, bias=False) for a in adapters})
        for a in adapters:  # PEFT's init: A random, B zero (the adapter starts as a no-op)
            nn.init.kaiming_uniform_(self.lora_A[a].weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[a].weight)
        self.scaling = alpha / r
        self.active = adapters[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B[self.active](self.lora_A[self.active](x)) * self.scaling


class PeftLike(nn.Module):
    """A model wrapped as PEFT names it: ``base_model.model.<the HF model's names>``."""

    def __init__(self, model: nn.Module, adapters: list[str], r: int, alpha: float) -> None:
        super().__init__()
        for p in model.parameters():
            p.requires_grad_(False)
        self.layers: list[LoraLinear] = []
        for name, module in list(model.named_modules()):
            if name.rpartition(".")[2] in TARGETS and isinstance(module, nn.Linear):
                parent = model.get_submodule(name.rpartition(".")[0])
                lora = LoraLinear(module, adapters, r, alpha)
                setattr(parent, name.rpartition(".")[2], lora)
                self.layers.append(lora)
        self.base_model = nn.Module()
        self.base_model.model = model

    def activate(self, adapter: str) -> None:
        for layer in self.layers:
            layer.active = adapter

    def forward(self, **kwargs: Any) -> Any:
        return self.base_model.model(**kwargs)


def save_adapter(state: dict[str, torch.Tensor], adapter: str, spec: dict[str, Any], directory: str) -> None:
    """One adapter in PEFT's saved format (adapter name dropped from the names, bf16)."""
    from safetensors.torch import save_file

    tensors = {k.replace(f".{adapter}.weight", ".weight"): v.detach().to(torch.bfloat16).contiguous()
               for k, v in state.items() if k.endswith(f".{adapter}.weight")}
    Path(directory).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(directory) / "adapter_model.safetensors"))
    config = {k: spec[k] for k in ("r", "lora_alpha", "target_modules")}
    (Path(directory) / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "LORA", "bias": "none"}))


class Trainer:
    """The LoRA model, AdamW on its adapters, and the Sender, on an event loop of its own."""

    def __init__(self, r: int, alpha: float, lr: float, seed: int = 0, config: Any = None) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.config = tiny_config(True) if config is None else config
        self.base = AutoModelForCausalLM.from_config(self.config).float()  # fp32 master weights (the config says bf16)
        self.base_state = {k: v.to(torch.bfloat16).clone() for k, v in self.base.state_dict().items()}  # what vLLM loads
        self.model = PeftLike(self.base, list(ADAPTERS), r, alpha)
        self.spec = {"r": r, "lora_alpha": alpha, "target_modules": list(TARGETS)}
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        self.batch = torch.randint(3, self.config.vocab_size, (4, 24), generator=torch.Generator().manual_seed(seed))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.sender = Sender("tcp://127.0.0.1:0", CONFIG)
        self.version = 0
        self.stats: list[Any] = []
        self.run(self._start())

    def run(self, coro: Any, timeout: float = 120.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        await self.sender.__aenter__()
        await self.sender.start(adapter_state(self.model), version=self.version)

    def step(self) -> dict[str, Any]:
        """One AdamW step on each adapter, then one version of both."""
        losses = []
        for adapter in ADAPTERS:
            self.model.activate(adapter)
            loss = self.model(input_ids=self.batch, labels=self.batch).loss
            loss.backward()
            losses.append(round(float(loss.detach()), 4))
        self.opt.step()
        self.opt.zero_grad()
        self.version += 1
        stats = self.run(self.sender.sync(adapter_state(self.model), version=self.version))
        self.run(self.sender.flush())
        self.stats.append(stats)
        return {"version": self.version, "losses": losses, "changed_fraction": round(stats.changed_fraction, 4),
                "wire_bytes": int(stats.wire_bytes)}

    def lora_spec(self, **override: Any) -> dict[str, dict[str, Any]]:
        return {a: {"id": i, "name": n, **self.spec, **override} for a, (i, n) in ADAPTERS.items()}

    def adapter_bytes(self) -> int:
        return sum(t.numel() * 2 for t in adapter_state(self.model).values())  # bf16, as the engine holds them

    def merged_bytes(self) -> tuple[int, int]:
        """bf16 bytes of the base matrices a merged adapter rewrites, and of the whole model."""
        targets = sum(v.numel() * 2 for k, v in self.base_state.items() if k.rpartition(".")[0].rpartition(".")[2] in TARGETS)
        return targets, sum(v.numel() * 2 for v in self.base_state.values())

    def merged_state(self, adapter: str = "default") -> dict[str, torch.Tensor]:
        """The checkpoint a merged reload would send: each target weight plus B @ A * alpha / r."""
        merged = {id(m.base_layer.weight): m.base_layer.weight + (m.lora_B[adapter].weight @ m.lora_A[adapter].weight) * m.scaling
                  for m in self.model.layers}
        return {k.replace(".base_layer", ""): merged.get(id(p), p).detach() for k, p in self.base.named_parameters() if ".lora_" not in k}

    def close(self) -> None:
        self.run(self.sender.__aexit__(None, None, None))
        self.loop.call_soon_threadsafe(self.loop.stop)


def engine_state(worker: Any) -> dict[str, Any]:
    """Run in each worker: the adapters vLLM holds, and the last update's timing."""
    engine = worker.weight_transfer_engine
    manager = worker.model_runner.lora_manager._adapter_manager
    return {"registered": sorted(manager.list_adapters()), "slots": list(manager.lora_index_to_id),
            "timing": dict(getattr(engine, "last_timing", {}) or {})}


def make_engine(model_dir: str, tp: int, r: int) -> Any:
    from vllm import LLM
    from vllm.config import WeightTransferConfig

    return LLM(
        model_dir, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128, max_num_seqs=4,
        tensor_parallel_size=tp, seed=0, enable_lora=True, max_lora_rank=r, max_loras=len(ADAPTERS) + 1,
        max_cpu_loras=len(ADAPTERS) + 2, weight_transfer_config=WeightTransferConfig(backend="weightsync"),
    )


def lora_outputs(llm: Any, request: Any) -> list[dict[str, Any]]:
    """``generate`` (greedy, top-3 logprobs) under one adapter (None: the base model)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
    out = []
    for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False, lora_request=request):
        completion = r.outputs[0]
        logprobs = [{str(t): lp.logprob for t, lp in sorted(step.items())} for step in completion.logprobs or []]
        out.append({"tokens": list(completion.token_ids), "logprobs": logprobs})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--alpha", type=float, default=16.0)
    parser.add_argument("--lr", type=float, default=2e-2, help="AdamW on the adapters (high: the tiny adapters must move outputs)")
    args = parser.parse_args(argv)
    from vllm.lora.request import LoRARequest

    trainer = Trainer(args.rank, args.alpha, args.lr)
    workdir = tempfile.mkdtemp(prefix="weightsync-lora-")
    trainer.base.config.save_pretrained(f"{workdir}/base")
    from safetensors.torch import save_file

    save_file(trainer.base_state, f"{workdir}/base/model.safetensors")  # the frozen base, tied head saved once
    started = time.perf_counter()
    llm = make_engine(f"{workdir}/base", args.tp, args.rank)
    up = time.perf_counter() - started
    base_before = lora_outputs(llm, None)
    summary: dict[str, Any] = {"tp": args.tp, "engine_up_s": round(up, 2)}

    # refused before anything is written: a rank other than the trainer's. TP=1 only: when a
    # collective RPC fails on every rank, vLLM 0.32.0's multiproc executor raises at rank 0's
    # reply and leaves the other ranks' queued, so every later RPC reads a stale reply.
    init = {"endpoint": trainer.sender.endpoint, "config": CONFIG, "timeout": 120}
    summary["refused"] = summary["registered_after_refusal"] = None
    if args.tp == 1:
        try:
            llm.init_weight_transfer_engine({"init_info": {**init, "lora": trainer.lora_spec(r=args.rank // 2)}})
        except Exception as e:  # AdapterMismatchError in the worker, its message re-raised by vLLM's RPC
            summary["refused"] = f"{type(e).__name__}: {e}"[:400]
        summary["registered_after_refusal"] = [s["registered"] for s in llm.collective_rpc(engine_state)]

    started = time.perf_counter()
    llm.init_weight_transfer_engine({"init_info": {**init, "lora": trainer.lora_spec()}})
    summary["init_s"] = round(time.perf_counter() - started, 3)
    versions = []
    disk_id = 100
    for _ in range(args.steps):
        step = trainer.step()
        started = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights({"update_info": {"version": trainer.version, "timeout": 60}})
        llm.finish_weight_update(str(trainer.version))
        step["update_s"] = round(time.perf_counter() - started, 4)
        state = llm.collective_rpc(engine_state)
        step["commit_s"] = [round(s["timing"].get("commit_s", 0.0), 4) for s in state]
        step["check_s"] = [round(s["timing"].get("check_s", 0.0), 4) for s in state]
        step["adapters"] = {}
        snapshot = {k: v.detach().clone() for k, v in adapter_state(trainer.model).items()}
        for adapter, (ident, name) in ADAPTERS.items():
            disk_id += 1
            directory = f"{workdir}/adapters/{adapter}-v{trainer.version}"
            save_adapter(snapshot, adapter, trainer.spec, directory)
            patched = lora_outputs(llm, LoRARequest(name, ident, f"weightsync://{name}"))
            loaded = lora_outputs(llm, LoRARequest(f"{name}-disk-v{trainer.version}", disk_id, directory))
            step["adapters"][adapter] = {**compare(patched, loaded, args.tp), "differs_from_base": patched != base_before,
                                         "tokens": [p["tokens"] for p in patched]}
        step["registered"] = [s["registered"] for s in llm.collective_rpc(engine_state)]
        print(json.dumps(step), flush=True)
        versions.append(step)
    base_after = lora_outputs(llm, None)
    targets, whole = trainer.merged_bytes()
    summary.update({
        "versions": versions, "weight_version": llm.get_weight_version(), "base_unchanged": base_after == base_before,
        "adapter_bytes": trainer.adapter_bytes(), "merged_target_bytes": targets, "model_bytes": whole,
        "logprob_tolerance": 0.0 if args.tp == 1 else TP_LOGPROB_TOLERANCE,
    })
    trainer.close()
    print(json.dumps({"summary": summary}), flush=True)
    ok = summary["base_unchanged"] and (args.tp > 1 or bool(summary["refused"])) and all(
        a["tokens_equal"] and a["logprobs_ok"] for v in versions for a in v["adapters"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
