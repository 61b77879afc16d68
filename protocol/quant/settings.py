"""Block fp8, the weight format of DeepSeek-V3 and Qwen3-FP8 checkpoints, as both sides
name it: each quantized weight ``X`` [N, K] (or an expert stack [E, N, K], blocks per
expert) held as ``float8_e4m3fn`` beside a float32 ``X_scale_inv`` of one scale per
block, [ceil(N/bn), ceil(K/bk)].

A rollout declares the format at the handshake: its metadata holds each such ``X`` as
``float8_e4m3fn`` with its ``_scale_inv`` sibling (the trainer holds only ``X``), and its
HELLO says the block and scale format (``Fp8Format``, from ``SyncConfig.fp8`` or the
engine's quantization config). The sender quantizes into it (``fp8.py`` beside this, through ``sender/fp8_view.py``). Here
are the settings, the names and the checks of what a HELLO declares: pure, no state.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch

from protocol.errors import ConfigError, MetadataMismatchError, ProtocolError

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

    @property
    def format(self) -> Fp8Format:
        """What a HELLO says of these settings."""
        return Fp8Format(self.block, self.scale_format)

    def with_format(self, fmt: Fp8Format) -> BlockFp8:
        """These settings with ``fmt``'s block and scale format (a rollout's, from its HELLO)."""
        return replace(self, block=fmt.block, scale_format=fmt.scale_format)

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


@dataclass(frozen=True)
class Fp8Format:
    """What a rollout's HELLO says of its fp8 weights: the scale block (rows, cols) and
    whether scales are plain fp32 or powers of two (``ue8m0``). What the metadata cannot
    show (two block sizes can give the same scale shapes; ue8m0 scales are fp32 too)."""

    block: tuple[int, int] = (128, 128)
    scale_format: Literal["fp32", "ue8m0"] = "fp32"

    def to_body(self) -> dict[str, Any]:
        return {"method": "block_fp8", "block": list(self.block), "scale_format": self.scale_format}

    @classmethod
    def from_body(cls, body: Any) -> Fp8Format:
        """From an untrusted HELLO: ``ProtocolError`` unless it is exactly this shape."""
        if not isinstance(body, Mapping) or set(body) != {"method", "block", "scale_format"}:
            raise ProtocolError(f"HELLO quant must be a map of method, block and scale_format, got {body!r:.120}")
        block, scale_format = body["block"], body["scale_format"]
        if body["method"] != "block_fp8":
            raise ProtocolError(f"HELLO quant method {body['method']!r:.40} is not served (only 'block_fp8')")
        if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and 0 < b <= 1 << 16 for b in block)):
            raise ProtocolError(f"HELLO quant block must be two positive ints, got {block!r:.60}")
        if scale_format not in ("fp32", "ue8m0"):
            raise ProtocolError(f"HELLO quant scale_format must be 'fp32' or 'ue8m0', got {scale_format!r:.40}")
        return cls((block[0], block[1]), scale_format)

    def describe(self) -> str:
        return f"block fp8 {self.block[0]}x{self.block[1]}, {self.scale_format} scales"


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scales' shape of a weight of ``shape`` ([N, K] or [E, N, K]) in blocks of ``block``."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def holds_fp8(dtypes: Iterable[torch.dtype]) -> bool:
    """Whether a model of these dtypes holds any weight in a float8 format: its HELLO says
    the format (``Hello.quant``)."""
    return any(d.is_floating_point and d.itemsize == 1 for d in dtypes)


def declared_fp8(keys: Iterable[str], dtypes: Iterable[torch.dtype]) -> dict[str, str]:
    """The weights a rollout declares in block fp8, each with its scales' key, from its
    metadata's keys and dtypes. ``MetadataMismatchError`` names a key held in a float8
    format that cannot be served: ``float8_e5m2``, or without a float32 ``_scale_inv``
    sibling (per-tensor or per-channel scales)."""
    held = dict(zip(keys, dtypes))
    found: dict[str, str] = {}
    for key, dtype in held.items():
        if dtype not in (FP8, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
            continue
        if dtype != FP8:
            raise MetadataMismatchError(f"key {key!r}: the receiver holds it as {dtype}; only float8_e4m3fn block fp8 is served")
        scales = scale_name(key)
        if held.get(scales) != torch.float32:
            got = "no such key" if scales not in held else f"it is {held[scales]}"
            raise MetadataMismatchError(
                f"key {key!r}: the receiver holds it as float8_e4m3fn but {scales!r} is not beside it as float32 ({got}): "
                "only block fp8 (one float32 scale per block, in <weight>_scale_inv) is served"
            )
        found[key] = scales
    return found
