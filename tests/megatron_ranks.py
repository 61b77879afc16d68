"""A tiny Megatron model built through Megatron-Bridge in spawned gloo ranks (``make megatron-env``).

The model is a real megatron-core GPTModel (local layer spec, RMSNorm, fusions off) made by the
bridge from a tiny Hugging Face checkpoint saved to a temporary directory, with its weights loaded by
``load_hf_weights``. Workers here run in ranks spawned by tests.ranks.spawn_ranks; each imports
tests/megatron_env.py first. Everything a rank finds is returned through files in ``out_dir``
(``torch.save``), never by assertion in the parent's place: the parent checks them.

Also here: ``train_step`` (one microbatch, forward/backward by hand across pipeline stages, AdamW)
and ``hf_loss`` (Hugging Face's loss on the same tokens: the step's reference). The sync scenario
that runs in these ranks: ``tests/megatron_sync.py``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
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
    vocab_divisible_by: int = 0  # Megatron pads the vocabulary to a multiple of this times tp; 0: the bridge's choice
    sequence_parallel: bool = False  # Megatron refuses to train MoE at TP > 1 without it
    bf16: bool = False  # bf16 parameters (params_dtype and the bf16 flag)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Tiny:
    """A tiny checkpoint. Vocab 250 is no multiple of 128: the bridge's default does not pad it
    (it divides by the largest power of two <= 128 that divides the vocab, here 2); a layout with
    ``vocab_divisible_by=128`` pads it to 256, and the bridge 0.6.2 then exports 256 rows."""

    moe: bool = False
    tied: bool = False  # tie_word_embeddings: no lm_head in the checkpoint
    layers: int = 2
    vocab: int = 250
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128  # the dense MLP's (Qwen2 only)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def save_tiny_hf(directory: Path, tiny: Tiny, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save a random tiny Qwen2 (or Qwen3-MoE) checkpoint in fp32; returns the checkpoint's tensors
    as saved (transformers 5 keeps Qwen3-MoE experts fused in memory, ``experts.gate_up_proj``, but
    saves, and the bridge exports, one ``experts.{i}.{gate,up,down}_proj.weight`` per expert)."""
    import transformers
    from safetensors.torch import load_file

    torch.manual_seed(seed)
    common = dict(
        vocab_size=tiny.vocab, hidden_size=tiny.hidden, num_hidden_layers=tiny.layers,
        num_attention_heads=tiny.heads, num_key_value_heads=tiny.kv_heads, max_position_embeddings=128,
        tie_word_embeddings=tiny.tied, torch_dtype="float32", rms_norm_eps=1e-6,
    )
    config: Any
    if tiny.moe:
        config = transformers.Qwen3MoeConfig(
            **common, head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    else:
        config = transformers.Qwen2Config(**common, intermediate_size=tiny.intermediate)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: make every element distinct
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory, safe_serialization=True)
    return load_file(str(Path(directory) / "model.safetensors"))


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
    provider.sequence_parallel = layout.sequence_parallel
    if layout.vocab_divisible_by:
        provider.make_vocab_size_divisible_by = layout.vocab_divisible_by
        provider.should_pad_vocab = True  # the bridge leaves it off for HF checkpoints
    provider.params_dtype = torch.bfloat16 if layout.bf16 else torch.float32
    provider.bf16 = layout.bf16
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
    from tests.megatron_env import tensor_cuda_noop

    with tensor_cuda_noop():
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    bridge.load_hf_weights(model)
    return bridge, model


def export(bridge: Any, model: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """The bridge's own export on this rank (a collective: every rank calls it)."""
    return {name: t.detach().clone() for name, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}


# ---------------------------------------------------------------------------------------------
# One real optimizer step on CPU. Megatron's pipeline schedules allocate on device="cuda", so this
# is a hand-written one-microbatch forward/backward: gloo send/recv of the activations (forward) and
# of their gradients (backward) between stages, then torch AdamW on this rank's local parameters.


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's convention: True where attention is NOT allowed."""
    return torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)


def train_step(model: list[torch.nn.Module], tokens: torch.Tensor, hidden: int, lr: float = 1e-2) -> float | None:
    """One forward/backward over ``tokens`` [1, s+1] (predict token t+1 from tokens <= t) and one
    AdamW step; returns the mean loss on the last pipeline stage, None on the others."""
    from megatron.core import parallel_state as ps

    (chunk,) = model  # no virtual pipeline here
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    seq = inputs.shape[1]
    position_ids = torch.arange(seq).unsqueeze(0)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    group = ps.get_pipeline_model_parallel_group()
    prev_rank, next_rank = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    received: torch.Tensor | None = None
    if not first:  # activations are [s, b, h] between Megatron stages
        received = torch.empty(seq, 1, hidden, dtype=next(chunk.parameters()).dtype)  # bf16 parameters: bf16 activations
        torch.distributed.recv(received, src=prev_rank, group=group)
        received.requires_grad_(True)
    chunk.set_input_tensor(received)
    out = chunk(inputs, position_ids, causal_mask(seq), labels=labels if last else None)
    loss: float | None = None
    if last:
        mean = out.float().mean()  # out is the per-token loss [b, s]
        mean.backward()
        loss = float(mean.detach())
    else:
        torch.distributed.send(out.detach().contiguous(), dst=next_rank, group=group)
        grad = torch.empty_like(out)
        torch.distributed.recv(grad, src=next_rank, group=group)
        out.backward(grad)
    if received is not None:
        assert received.grad is not None
        torch.distributed.send(received.grad.contiguous(), dst=prev_rank, group=group)
    # Tied embeddings split across stages: the first stage's embedding and the last stage's output
    # layer are two copies of one weight; Megatron's finalize_model_grads all-reduces their grads
    # over the embedding group, and so does this step.
    embedding_group = ps.get_embedding_group(check_initialized=False)
    inner = getattr(chunk, "module", chunk)  # bf16: the GPTModel inside Megatron's Float16Module
    if (
        inner.share_embeddings_and_output_weights
        and embedding_group is not None
        and torch.distributed.get_world_size(embedding_group) > 1
        and torch.distributed.get_rank() in torch.distributed.get_process_group_ranks(embedding_group)
    ):
        shared = inner.shared_embedding_or_output_weight()
        assert shared.grad is not None
        torch.distributed.all_reduce(shared.grad, group=embedding_group)
    params = [p for p in chunk.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def hf_loss(hf_dir: str, tokens: torch.Tensor) -> float:
    """Hugging Face's mean next-token loss on ``tokens`` (the reference for train_step's)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits[0], tokens[0, 1:]))
