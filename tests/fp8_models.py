"""Real trainers and plain-torch fp8 rollouts for the fp8 tests (issue 58).

The trainer is a Hugging Face model (Qwen2, dense, or Qwen3-MoE, whose experts are fused
[E, N, K] stacks in transformers 5) in fp32, trained by AdamW. A rollout holds the same
names in block fp8: each quantized weight as ``float8_e4m3fn`` beside its fp32
``_scale_inv``, everything else in bf16, and tied names tied where both are held alike.
What it must hold after each version is ``rollout_state`` of the trainer's weights then,
made with the reference quantizer (``protocol.quant.quantize``, bit-equal to vLLM's
``per_block_cast_to_fp8``), never with the sender's batched path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from protocol.quant import FP8, SCALE_SUFFIX, BlockFp8, quantize_state, scale_name
from protocol.state import find_aliases

BLOCK = (32, 48)  # small blocks: many per tensor, ragged edges on most of them (96 / 32, 200 / 48, ...)


def tiny_config(family: str = "qwen2", tie: bool = True, layers: int = 3) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=300, hidden_size=96, num_hidden_layers=layers, num_attention_heads=3, num_key_value_heads=1,
        max_position_embeddings=128, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if family == "qwen2":
        return transformers.Qwen2Config(intermediate_size=200, **common)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            intermediate_size=192, moe_intermediate_size=80, num_experts=4, num_experts_per_tok=2, head_dim=32, **common,
        )
    raise ValueError(family)


class Trainer:
    """An fp32 HF model and its AdamW, stepping on a fixed random batch."""

    def __init__(self, family: str = "qwen2", tie: bool = True, seed: int = 0, layers: int = 3) -> None:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_config(tiny_config(family, tie, layers))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6, weight_decay=0.0)
        self.batch = torch.randint(3, 300, (2, 16), generator=torch.Generator().manual_seed(seed))

    def step(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def rollout_state(state: Mapping[str, torch.Tensor], settings: BlockFp8, num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """What a block-fp8 rollout of ``settings`` holds for the trainer's ``state``: the
    reference quantizer's bytes and scales, every other float in bf16, ties kept where
    both names are quantized or neither is (as the sender keeps them)."""
    state = {k: v.detach() for k, v in state.items()}
    quantized = quantize_state(state, settings, num_layers=num_layers)
    out = {k: (v.to(torch.bfloat16) if v.is_floating_point() and v.dtype != FP8 and not k.endswith(SCALE_SUFFIX) else v).clone()
           for k, v in quantized.items()}
    for alias, canonical in find_aliases(state).items():
        if (out[alias].dtype == FP8) == (out[canonical].dtype == FP8):
            out[alias] = out[canonical]
            if out[alias].dtype == FP8:
                out[scale_name(alias)] = out[scale_name(canonical)]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


def differences(expected: Mapping[str, torch.Tensor], held: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys where ``held`` is not bit for bit ``expected`` (or missing, or of another dtype)."""
    assert set(expected) == set(held), set(expected) ^ set(held)
    return [k for k in expected if expected[k].dtype != held[k].dtype or not torch.equal(bits(expected[k]), bits(held[k]))]
