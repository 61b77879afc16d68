"""Weight formats a rollout holds that differ from the trainer's: block fp8 (DeepSeek-V3 and
Qwen3-FP8 checkpoints). ``settings``: the settings, names and the checks of what a HELLO
declares; ``fp8``: the quantizer, bit-equal to vLLM's ``per_block_cast_to_fp8``. Pure
functions over tensors, like the codecs: the sender quantizes its trainer's weights into a
rollout's format with them, and a receiver can make its first fp8 weights from a bf16
checkpoint the same way.
"""

from .fp8 import quantize, quantize_many, quantize_state
from .settings import (
    AMAX_FLOOR,
    DEFAULT_INCLUDE,
    DEFAULT_SKIP,
    FP8,
    FP8_MAX,
    SCALE_SUFFIX,
    BlockFp8,
    Fp8Format,
    declared_fp8,
    holds_fp8,
    layer_index,
    quantized_names,
    scale_name,
    scale_shape,
)

__all__ = [
    "AMAX_FLOOR", "DEFAULT_INCLUDE", "DEFAULT_SKIP", "FP8", "FP8_MAX", "SCALE_SUFFIX", "BlockFp8", "Fp8Format", "declared_fp8",
    "holds_fp8", "layer_index", "quantize", "quantize_many", "quantize_state", "quantized_names", "scale_name", "scale_shape",
]
