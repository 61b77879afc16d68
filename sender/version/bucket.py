"""The bucket strategy, actor side: every tracked tensor, whole, in size-bounded buckets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import torch

from protocol.codec.buckets import bucket_messages, plan_buckets
from protocol.codec.tohost import to_host
from protocol.config import BucketConfig
from protocol.errors import ConfigError
from protocol.state import StateLike, state_tensors
from protocol.wire.framing import Message, MessageType

from ..base import Send, SenderBase
from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import Mark
from .builder import Build, VersionBuilder


class BucketBuilder(VersionBuilder):
    """Builds the BUCKET messages of a version.

    ``bucket_dtype`` converts floating tensors only (integer and bool buffers keep
    their dtype); ``bucket_device`` is where that cast happens before the host copy.
    """

    streams = False

    def __init__(self, plan: SyncPlan, config: BucketConfig) -> None:
        self.plan = plan
        self.bucket_size = config.bucket_size
        self.dtype = config.dtype
        self.device = None if config.bucket_device == "auto" else torch.device(config.bucket_device)
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("bucket_device: cuda, but torch sees no CUDA device (use cpu or auto)")
        self.retained: dict[str, torch.Tensor] = {}  # the current version (``hold``)
        self.held_d2h_seconds = 0.0  # the device time of ``hold``'s copies to the host (CUDA events)

    async def hold(self, tensors: dict[str, torch.Tensor], after: Mark | None = None) -> None:
        """Keep ``tensors``' version (``retain``): resyncs are built from it. Read after
        ``after`` (default: the caller's current streams now), on a thread of its own."""
        after = Mark.now(tensors.values()) if after is None else after
        self.retained, self.held_d2h_seconds = await asyncio.to_thread(self._timed_retain, tensors, after)

    def _timed_retain(self, tensors: dict[str, torch.Tensor], after: Mark) -> tuple[dict[str, torch.Tensor], float]:
        after.wait()
        spent = [0.0]
        return self.retain(tensors, spent), spent[0]

    def held(self) -> dict[str, torch.Tensor]:
        """The tracked tensors of the current version, as retained."""
        return self.retained

    async def settled(self) -> None:
        """The retained copy is always whole."""

    def wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype

    def build(
        self, tensors: dict[str, torch.Tensor], version: int, base: int | None, stats: SyncStats, after: Mark | None = None
    ) -> Build:
        """``version`` whole: ``read`` keeps its copy (``hold``, after ``after``), whose
        buckets ``parts`` then yields, built off the event loop and sharing memory with that copy."""
        after = Mark.now(tensors.values()) if after is None else after

        async def read() -> None:
            await self.hold(tensors, after)
            stats.d2h_seconds = self.held_d2h_seconds

        async def parts() -> AsyncGenerator[Message, None]:
            for msg in await asyncio.to_thread(list, self.messages(self.held(), version, stats, copy=False)):
                yield msg

        return Build(read, parts())

    def messages(self, tensors: dict[str, torch.Tensor], version: int, stats: SyncStats, *, copy: bool = True) -> Iterator[Message]:
        """The version's buckets, built lazily one at a time; ``stats`` gets its figures.

        ``copy`` False lets frames share memory with ``tensors`` (see ``bucket_messages``).
        """
        self.plan.check_tensors(tensors)
        keys = self.plan.tracked
        # A version always has at least one message, even with nothing tracked.
        buckets = plan_buckets(keys, lambda k: tensors[k].numel() * self.wire_dtype(tensors[k]).itemsize, self.bucket_size)
        spent: list[float] = []  # device seconds of each bucket's copy to the host, as built
        messages = bucket_messages(
            MessageType.BUCKET, buckets or [[]], tensors.__getitem__, self.plan.ordinal,
            lambda _, t: self.wire_dtype(t), self.device, version=version, copy=copy, copied=spent.append,
        )
        for key in keys:
            n = tensors[key].numel()
            stats.total_elements += n
            stats.dense_bytes += n * self.plan.receiver_dtype(key).itemsize
        stats.changed_elements = stats.total_elements
        stats.tensors_changed = stats.tensors_dense = len(keys)
        return _timed(messages, stats, spent)

    def retain(self, tensors: dict[str, torch.Tensor], spent: list[float] | None = None) -> dict[str, torch.Tensor]:
        """Host copies of the tracked tensors at their wire dtypes: a consistent version
        that frames can share and resyncs can be built from after the model moves on.
        Bucket by bucket: a bucket's CUDA tensors in one copy to pinned memory (``tohost``;
        a gathered FSDP2 weight is dropped before the next is gathered); ``spent[0]`` adds
        up their device seconds."""
        self.plan.check_tensors(tensors)
        out: dict[str, torch.Tensor] = {}

        def add(seconds: float) -> None:
            if spent is not None:
                spent[0] += seconds

        keys = self.plan.tracked
        for bucket in plan_buckets(keys, lambda k: tensors[k].numel() * self.wire_dtype(tensors[k]).itemsize, self.bucket_size):
            hosts = to_host([tensors[k] for k in bucket], [self.wire_dtype(tensors[k]) for k in bucket], self.device, copied=add)
            out.update(zip(bucket, hosts))
        return out


def _timed(messages: Iterator[Message], stats: SyncStats, spent: list[float]) -> Iterator[Message]:
    """``messages``, each bucket's copy time (``spent``, filled as it is built) added to ``stats.d2h_seconds``."""
    for msg in messages:
        stats.d2h_seconds += sum(spent)
        spent.clear()
        yield msg


class BucketSender(SenderBase):
    """The bucket strategy over injected ``send``/``recv``: full copies, bucket by bucket."""

    strategy = "bucket"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.config.bucket.dtype  # noqa: B018 - fail fast on a bad bucket_dtype

    async def _sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        """Send every tracked tensor as version ``version``."""
        plan = self.require_plan(version)
        stats = SyncStats(version, self.strategy)
        started = time.perf_counter()
        tensors, _ = await plan.rolled(state_tensors(model))  # buckets read on the caller's thread, after
        stats.quantize_seconds = time.perf_counter() - started if plan.view is not None else 0.0
        messages = BucketBuilder(plan, self.config.bucket).messages(tensors, version, stats)
        self.version = version
        started = time.perf_counter()
        while (msg := await asyncio.to_thread(next, messages, None)) is not None:
            wire = self.stamp(msg)
            stats.messages += 1
            stats.wire_bytes += sum(len(f) for f in wire)
            sent = time.perf_counter()
            await send(wire)
            stats.send_seconds += time.perf_counter() - sent
        stats.build_seconds = time.perf_counter() - started - stats.send_seconds
        return stats
