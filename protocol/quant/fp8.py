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
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from protocol.errors import ConfigError

from .settings import AMAX_FLOOR, FP8, FP8_MAX, BlockFp8, quantized_names, scale_name

__all__ = ["BlockFp8", "quantize", "quantize_many", "quantize_state", "quantized_names", "scale_name"]

# How many input bytes ``quantize_many`` stacks into one ``quantize``: large enough that a
# model's layers take a few launches a shape, small enough that the stack and the fp32
# temporaries quantize makes of it (about 10x the stack) stay a bounded transient.
STACK_BYTES = 64 << 20


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


def quantize_many(
    weights: list[torch.Tensor], settings: BlockFp8 | None = None, *, stack_bytes: int = STACK_BYTES
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``quantize`` of each of ``weights``, in order, bit-equal to it, in a few kernels per
    shape rather than per tensor: weights of one shape, dtype and device are copied into
    one stack (one ``_foreach_copy_``, the bf16 cast included) of at most ``stack_bytes``
    and quantized as one [E, N, K] expert stack, whose blocks are per expert. The results
    are views of the stack's outputs (each contiguous)."""
    settings = settings or BlockFp8()
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(weights)
    groups: dict[tuple[tuple[int, ...], torch.dtype, torch.device], list[int]] = {}
    for i, w in enumerate(weights):
        if w.dim() != 2:
            out[i] = quantize(w, settings)  # a stack already, or refused with quantize's message
            continue
        groups.setdefault((tuple(w.shape), w.dtype, w.device), []).append(i)
    for (shape, dtype, device), members in groups.items():
        stacked = torch.bfloat16 if settings.source == "bf16" else dtype
        each = max(1, stack_bytes // max(1, math.prod(shape) * stacked.itemsize))
        for start in range(0, len(members), each):
            chunk = members[start : start + each]
            if len(chunk) == 1:
                out[chunk[0]] = quantize(weights[chunk[0]], settings)
                continue
            stack = torch.empty((len(chunk), *shape), dtype=stacked, device=device)
            torch._foreach_copy_(list(stack.unbind(0)), [weights[i].detach() for i in chunk])
            q, scales = quantize(stack, settings)
            for j, i in enumerate(chunk):
                out[i] = (q[j], scales[j])
    return out  # type: ignore[return-value]
