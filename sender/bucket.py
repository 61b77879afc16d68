"""The bucket strategy, actor side: every tracked tensor, whole, in size-bounded buckets."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from protocol.errors import ConfigError, MetadataMismatchError
from protocol.framing import MessageType
from protocol.state import StateLike, resolve_state

from .base import SenderBase, Send
from .buckets import bucket_messages, plan_buckets
from .stats import SyncStats


class BucketSender(SenderBase):
    """Full copies of the tracked tensors, one version at a time.

    ``bucket_dtype`` converts floating tensors only (integer and bool buffers keep
    their dtype); ``bucket_device`` is where that cast happens before the host copy.
    """

    strategy = "bucket"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        bucket = self.config.bucket
        self.dtype = bucket.dtype
        self.device = None if bucket.bucket_device == "auto" else torch.device(bucket.bucket_device)
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bucket_device: cuda, but torch sees no CUDA device (use cpu or auto)")

    def wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    async def sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        """Send every tracked tensor as version ``version``, bucket by bucket."""
        self.require_init()
        self.next_version(version)
        tensors = resolve_state(model).tensors
        keys = self.tracked_keys()
        for key in keys:
            if key not in tensors:
                raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
        size = self.config.bucket.bucket_size
        # A version always has at least one message, even with nothing tracked.
        buckets = plan_buckets(keys, lambda k: tensors[k].numel() * self.wire_dtype(tensors[k]).itemsize, size) or [[]]
        messages = bucket_messages(
            MessageType.BUCKET, buckets, tensors, self.ordinal, lambda _, t: t.to(self.wire_dtype(t)), self.device, version=version
        )
        self.version = version
        stats = SyncStats(version, self.strategy)
        for key in keys:
            n = tensors[key].numel()
            stats.total_elements += n
            stats.changed_elements += n
            stats.dense_bytes += n * self.receiver_dtype(key).itemsize
        stats.tensors_changed = stats.tensors_dense = len(keys)
        while True:
            started = time.perf_counter()
            msg = await asyncio.to_thread(next, messages, None)
            if msg is None:
                break
            wire = self.stamp(msg)
            stats.build_seconds += time.perf_counter() - started
            stats.messages += 1
            stats.wire_bytes += sum(len(f) for f in wire)
            started = time.perf_counter()
            await send(wire)
            stats.send_seconds += time.perf_counter() - started
        return stats
