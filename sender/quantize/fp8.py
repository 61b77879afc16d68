"""Block fp8, the format of DeepSeek-V3 and Qwen3-FP8 checkpoints: each quantized weight
``X`` [N, K] (or an expert stack [E, N, K], blocks per expert) held as ``float8_e4m3fn``,
with a sibling fp32 ``X_scale_inv`` of one scale per block, [ceil(N/bn), ceil(K/bk)].

``quantize`` is bit-equal to vLLM's ``per_block_cast_to_fp8`` (``vllm/utils/deep_gemm.py``),
the quantizer a rollout would run on the same weights: the block amax taken in fp32 and
clamped at 1e-4, scale = amax / 448, q = (x * (1 / scale)) cast to fp8 (multiplied by the
reciprocal: dividing rounds differently on some elements), ragged edges padded with zeros.
Only when the sender's bytes are those a rollout would make itself do patches of fp8 bytes
keep it exactly on the reference.

Every function here is pure (no state, no locks): safe to call from any number of threads
at once, on CPU or CUDA tensors (the work stays on the input's device, a fixed handful of
kernels whatever the number of blocks).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from protocol.errors import ConfigError

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0, vLLM's get_fp8_min_max() off ROCm
AMAX_FLOOR = 1e-4  # an all-zero block still gets a finite, nonzero scale
SCALE_SUFFIX = "_scale_inv"

# What DeepSeek-V3 and Qwen3-FP8 checkpoints leave in bf16: only the linear layers are fp8.
# Patterns are regular expressions searched in the full name.
DEFAULT_SKIP: tuple[str, ...] = (
    r"embed",  # embed_tokens, word_embeddings: not linear layers
    r"(^|\.)lm_head\.",  # vLLM's ParallelLMHead, and every fp8 config's modules_to_not_convert
    r"norm",  # input_layernorm, post_attention_layernorm, q_norm, k_norm, kv_a_layernorm, model.norm
    r"(^|\.)gate\.weight$",  # MoE routers: mlp.gate (DeepSeek's GateLinear has no quant config)
    r"(^|\.)shared_expert_gate\.",  # Qwen's shared-expert gate, built with quant_config=None
    r"(^|\.)conv1d\.",  # Qwen3-Next and Mamba convolutions, built with quant_config=None
    r"bias$",  # biases, e_score_correction_bias
)
# Which names can hold a quantized weight at all: a linear layer's ``weight`` (``.weight``,
# vLLM's fused ``w13_weight``) and transformers' fused expert stacks [E, N, K].
DEFAULT_INCLUDE = r"weight$|(^|\.)experts\.(gate_up_proj|down_proj)$"
# A decoder layer's index in a name, as NeMo-RL finds it: ``layers.{i}.``, ``layer.{i}.``, ``h.{i}.``.
LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)\.")


@dataclass(frozen=True)
class BlockFp8:
    """How the rollout holds its weights in block fp8.

    - ``block``: (rows, cols) of a scale's block; checkpoints use (128, 128).
    - ``scale_format``: ``"fp32"`` scales as vLLM computes them, or ``"ue8m0"``, each scale
      rounded up to a power of two as vLLM does for DeepGEMM on Blackwell
      (``per_block_cast_to_fp8(..., use_ue8m0=True)``: ``2 ** ceil(log2(scale))``).
    - ``source``: ``"bf16"`` quantizes the trainer's weights cast to bf16 first (what a bf16
      checkpoint of them would quantize to); ``"master"`` quantizes them in the precision
      the trainer holds (fp32 master weights).
    - ``skip``: regular expressions (``re.search`` on the full name) of names left unquantized;
      the default is what DeepSeek-V3 and Qwen3-FP8 checkpoints leave in bf16.
    - ``include``: a regular expression a name must match to be quantized at all.
    - ``bf16_layers``: (first, last): the first ``first`` and last ``last`` decoder layers stay
      unquantized whole (NeMo-RL's ``num_first_layers_in_bf16`` / ``num_last_layers_in_bf16``).
    """

    block: tuple[int, int] = (128, 128)
    scale_format: Literal["fp32", "ue8m0"] = "fp32"
    source: Literal["bf16", "master"] = "bf16"
    skip: tuple[str, ...] = DEFAULT_SKIP
    include: str = DEFAULT_INCLUDE
    bf16_layers: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        block, layers = tuple(self.block), tuple(self.bf16_layers)
        if len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise ConfigError(f"BlockFp8.block must be two positive integers (rows, cols), got {self.block!r}")
        if len(layers) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers):
            raise ConfigError(f"BlockFp8.bf16_layers must be two integers >= 0 (first, last), got {self.bf16_layers!r}")
        if self.scale_format not in ("fp32", "ue8m0"):
            raise ConfigError(f"BlockFp8.scale_format must be 'fp32' or 'ue8m0', got {self.scale_format!r}")
        if self.source not in ("bf16", "master"):
            raise ConfigError(f"BlockFp8.source must be 'bf16' or 'master', got {self.source!r}")
        skip = (self.skip,) if isinstance(self.skip, str) else tuple(self.skip)
        for pattern in (*skip, self.include):
            try:
                re.compile(pattern)
            except (re.error, TypeError) as e:
                raise ConfigError(f"BlockFp8: {pattern!r} is not a regular expression: {e}") from None
        object.__setattr__(self, "block", block)  # a YAML list becomes the tuple the type says
        object.__setattr__(self, "bf16_layers", layers)
        object.__setattr__(self, "skip", skip)


def scale_name(name: str) -> str:
    """The name of ``name``'s scales: ``...weight`` -> ``...weight_scale_inv``."""
    return name + SCALE_SUFFIX


def layer_index(name: str) -> int | None:
    """The decoder layer ``name`` is in (``model.layers.3.mlp...`` -> 3), None outside one."""
    found = LAYER.search(name)
    return int(found.group(1)) if found else None


def quantized_names(names: Iterable[str], settings: BlockFp8 | None = None, *, num_layers: int | None = None) -> list[str]:
    """The names of ``names`` held in fp8, in their order: those matching ``include`` and no
    ``skip`` pattern, outside the ``bf16_layers``.

    The last layers are counted from ``num_layers`` (the model config's
    ``num_hidden_layers``, as NeMo-RL does); without it, from the highest layer index in
    ``names``, so pass it when ``names`` are not the whole model's.
    """
    settings = settings or BlockFp8()
    names = list(names)
    first, last = settings.bf16_layers
    if num_layers is None:
        num_layers = 1 + max((i for i in map(layer_index, names) if i is not None), default=-1)
    include = re.compile(settings.include)
    skip = [re.compile(p) for p in settings.skip]
    found = []
    for name in names:
        if not include.search(name) or any(p.search(name) for p in skip):
            continue
        index = layer_index(name)
        if index is not None and (index < first or index >= num_layers - last):
            continue
        found.append(name)
    return found


def quantize(weight: torch.Tensor, settings: BlockFp8 | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] or [E, N, K] as (``float8_e4m3fn`` of its shape, contiguous; fp32
    scales [ceil(N/bn), ceil(K/bk)], or [E, ...] for a stack), on ``weight``'s device.

    Bit-equal to vLLM's ``per_block_cast_to_fp8`` of the same input (of each expert for a
    stack), with the same block size and ``use_ue8m0``. Raises ``ConfigError`` for a tensor
    that is not 2-D or 3-D floating point.
    """
    settings = settings or BlockFp8()
    if weight.dim() not in (2, 3) or not weight.is_floating_point() or weight.element_size() == 1:
        raise ConfigError(
            f"block fp8 quantizes 2-D [N, K] or 3-D [E, N, K] bf16/fp16/fp32 weights, got {tuple(weight.shape)} {weight.dtype}"
        )
    x = weight.detach()
    if settings.source == "bf16":
        x = x.to(torch.bfloat16)
    bn, bk = settings.block
    n, k = x.shape[-2:]
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    if n % bn or k % bk:
        x = F.pad(x, (0, cols * bk - k, 0, rows * bn - n))  # zeros: they never raise a block's amax
    blocks = x.reshape(*x.shape[:-2], rows, bn, cols, bk)
    amax = blocks.abs().float().amax(dim=(-3, -1), keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax / FP8_MAX
    if settings.scale_format == "ue8m0":
        scale = torch.pow(2.0, torch.ceil(torch.log2(scale.abs())))
    q = (blocks * scale.reciprocal()).to(FP8)  # vLLM's ``1.0 / scale`` is this reciprocal times 1.0
    q = q.reshape(*x.shape[:-2], rows * bn, cols * bk)[..., :n, :k].contiguous()
    return q, scale.reshape(*x.shape[:-2], rows, cols)


def quantize_state(
    state: Mapping[str, torch.Tensor], settings: BlockFp8 | None = None, *, num_layers: int | None = None
) -> dict[str, torch.Tensor]:
    """``state`` as a block-fp8 checkpoint holds it: each of ``quantized_names`` as its fp8
    bytes followed by its ``_scale_inv`` sibling, every other tensor as given. Raises
    ``ConfigError`` when a sibling's name is already in ``state`` or a quantized name's
    tensor is not 2-D or 3-D (the message names it)."""
    settings = settings or BlockFp8()
    chosen = set(quantized_names(state, settings, num_layers=num_layers))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name not in chosen:
            out[name] = tensor
            continue
        if scale_name(name) in state:
            raise ConfigError(f"{name!r} is to be quantized but the state already holds {scale_name(name)!r}")
        try:
            out[name], out[scale_name(name)] = quantize(tensor, settings)
        except ConfigError as e:
            raise ConfigError(f"{name!r}: {e} (leave it unquantized with BlockFp8.skip)") from None
    return out
