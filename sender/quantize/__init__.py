"""The rollout's weight format made from the trainer's weights: block fp8 (``fp8.py``:
``BlockFp8`` settings, ``quantize`` bit-equal to vLLM's ``per_block_cast_to_fp8``, which
names are quantized and their ``_scale_inv`` siblings).

The lowest room of the sender: the snapshot (``sender.diff``) and the version builders
(``sender.version``) quantize through it. May import the sender's floor and ``protocol``;
nothing of the other rooms.
"""

from .fp8 import BlockFp8, quantize, quantize_state, quantized_names, scale_name

__all__ = ["BlockFp8", "quantize", "quantize_state", "quantized_names", "scale_name"]
