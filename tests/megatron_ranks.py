"""A tiny Megatron model built through Megatron-Bridge in spawned gloo ranks (``make megatron-env``).

The model is a real megatron-core GPTModel (local layer spec, RMSNorm, fusions off) made by the
bridge from a tiny Hugging Face checkpoint saved to a temporary directory, with its weights loaded by
``load_hf_weights``. Workers here run in ranks spawned by tests.ranks.spawn_ranks; each imports
tests/megatron_env.py first. Everything a rank finds is returned through files in ``out_dir``
(``torch.save``), never by assertion in the parent's place: the parent checks them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """One parallel layout: world = tp * pp * dp, and ep divides dp (EP is carved out of DP)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Tiny:
    """A tiny checkpoint: vocab 250 is padded by Megatron (to 256 at TP=2), so padding is exercised."""

    moe: bool = False
    layers: int = 2
    vocab: int = 250
    hidden: int = 64
    extra: dict[str, Any] = field(default_factory=dict)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_tiny_hf(directory: Path, tiny: Tiny, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a random tiny Qwen2 (or Qwen3-MoE) checkpoint in fp32; returns its state dict."""
    import transformers

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tiny.vocab, hidden_size=tiny.hidden, num_hidden_layers=tiny.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, torch_dtype="float32", rms_norm_eps=1e-6,
    )
    config: Any
    if tiny.moe:
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
            **tiny.extra,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, intermediate_size=128, **tiny.extra)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make every element distinct
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def init_rank(rank: int, world: int, port: int) -> None:
    """Shims, then a gloo process group for this spawned rank."""
    from tests import megatron_env

    megatron_env.install()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)


def build(hf_dir: str, layout: Layout, moe: bool) -> tuple[Any, list[torch.nn.Module]]:
    """The bridge and this rank's model chunks, weights loaded from ``hf_dir``."""
    from megatron.bridge import AutoBridge
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.tensor_model_parallel_size = layout.tp
    provider.pipeline_model_parallel_size = layout.pp
    provider.expert_model_parallel_size = layout.ep
    provider.sequence_parallel = False
    provider.params_dtype = torch.float32
    provider.bf16 = False
    provider.fp16 = False
    provider.gradient_accumulation_fusion = False
    provider.bias_activation_fusion = False
    provider.bias_dropout_fusion = False
    provider.masked_softmax_fusion = False
    provider.persist_layer_norm = False
    provider.apply_rope_fusion = False
    provider.cross_entropy_loss_fusion = False
    provider.attention_dropout = 0.0
    provider.hidden_dropout = 0.0
    if moe:
        provider.moe_token_dispatcher_type = "allgather"  # alltoall builds a torch.cuda.Stream
        provider.moe_grouped_gemm = False
        provider.moe_router_fusion = False
        provider.moe_permute_fusion = False
    provider.transformer_layer_spec = get_gpt_layer_local_spec(
        num_experts=getattr(provider, "num_moe_experts", None), moe_grouped_gemm=False,
        qk_layernorm=bool(getattr(provider, "qk_layernorm", False)), normalization="RMSNorm",
    )
    provider.finalize()
    provider.initialize_model_parallel(seed=0, seed_kwargs={"inference_rng_tracker": True})
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.load_hf_weights(model)
    return bridge, model


def export(bridge: Any, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The bridge's own export on this rank (a collective: every rank calls it)."""
    return {name: t.detach().clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}


def export_worker(rank: int, world: int, port: int, hf_dir: str, layout: Layout, moe: bool, out_dir: str) -> None:
    """Build, load, export; save this rank's export and its local parameter names/shapes."""
    init_rank(rank, world, port)
    bridge, model = build(hf_dir, layout, moe)
    exported = export(bridge, model)
    local = {n: tuple(p.shape) for chunk in model for n, p in chunk.named_parameters()}
    torch.save({"export": exported, "local": local}, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()
