"""Tensor codecs: a tensor's changes (positions, values) to wire buffers and back, the
entropy coder, compressors, and the bucketing of whole tensors. No sockets and no event
loop (tests/test_layering.py keeps it so)."""

from protocol.codec import kernel_cache

kernel_cache.drop_stale()
