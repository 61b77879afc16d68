"""The patch strategy, actor side: send only what changed since the snapshot."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch

from protocol.config import PatchConfig
from protocol.dtypes import bits_dtype
from protocol.errors import MetadataMismatchError
from protocol.framing import Encoding, Message, MessageType, Role, ValueEncoding
from protocol.state import ModelState, StateLike, materialize, resolve_state
from protocol.tensorcodec import EncodedTensor, assemble, pack_entry, raw_nbytes, sparse_buffers

from . import fastdiff
from .base import Send, SenderBase
from .plan import Source, SyncPlan
from .snapshot import Snapshot
from .stats import SyncStats


@dataclass
class _Staged:
    """One changed tensor's buffers on their way to the transport device."""

    key: int
    encoding: Encoding
    values: ValueEncoding
    nnz: int
    buffers: dict[Role, torch.Tensor]
    events: list[torch.cuda.Event]


class PatchBuilder:
    """Builds PATCH messages: the bitwise difference between the model (cast to the
    receivers' dtypes) and the snapshot of what the receivers hold.

    Comparison is on integer views, so NaNs and signed zeros behave, and only changes
    visible at the receiver's dtype travel (an fp32 master that moves less than a bf16
    ulp sends nothing). Frozen parameters are not tracked: they travel in bootstraps.
    """

    def __init__(self, plan: SyncPlan, config: PatchConfig) -> None:
        self.plan = plan
        self.options = config.options()
        self.snapshot = Snapshot(config.snapshot_device)
        self.transport = torch.device(config.transport_device)

    def capture(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the snapshot: what the receivers hold after the bootstrap."""
        for key in self.plan.tracked:
            self.snapshot.capture(key, materialize(tensors[key]).detach().to(self.plan.receiver_dtype(key)))

    async def source(self, tensors: dict[str, torch.Tensor]) -> Source:
        """Tensors for a bootstrap at the snapshot's version: tracked keys from the
        snapshot, frozen ones from the model."""
        await self.snapshot.wait_writeback()
        snap = self.snapshot.tensors
        return lambda key: snap[key] if key in snap else tensors[key]

    async def build(self, tensors: dict[str, torch.Tensor], version: int, base: int | None) -> tuple[Message, SyncStats]:
        """The PATCH from ``base`` to ``version``; advances the snapshot to ``version``."""
        stats = SyncStats(version, "patch")
        started = time.perf_counter()
        await self.snapshot.wait_writeback()
        entries = await asyncio.to_thread(self._build, tensors, stats)
        specs, frames = assemble(entries)
        stats.build_seconds = time.perf_counter() - started
        return Message(MessageType.PATCH, version=version, base_version=base, tensors=specs, frames=frames), stats

    def _build(self, tensors: dict[str, torch.Tensor], stats: SyncStats) -> list[EncodedTensor]:
        """Compare, gather and encode on each tensor's device; then pack on the host."""
        keys = self.plan.tracked
        staged: list[_Staged] = []
        fetched = self._fetch(keys[0], tensors) if keys else None
        for i, key in enumerate(keys):
            assert fetched is not None
            working, event = fetched
            if i + 1 < len(keys):  # prefetch the next snapshot while this one is compared
                fetched = self._fetch(keys[i + 1], tensors)
            cur = materialize(tensors[key]).detach()
            snap = self.snapshot.stream(cur.device).use(working, event)
            item = self._diff(key, cur, snap, stats)
            if item is not None:
                staged.append(item)
        return [self._pack(item) for item in staged]

    def _fetch(self, key: str, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if key not in tensors:
            raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
        return self.snapshot.fetch(key, tensors[key].device)

    def _diff(self, key: str, cur: torch.Tensor, snap: torch.Tensor, stats: SyncStats) -> _Staged | None:
        dtype = self.plan.receiver_dtype(key)
        if tuple(cur.shape) != tuple(snap.shape):
            raise MetadataMismatchError(f"key {key!r} changed shape from {list(snap.shape)} to {list(cur.shape)}")
        numel = cur.numel()
        dense_nbytes = numel * dtype.itemsize
        stats.total_elements += numel
        stats.dense_bytes += dense_nbytes
        if snap is self.snapshot.tensors[key] and fastdiff.supported(cur, snap):
            flat, new, old = fastdiff.diff_and_update(cur, snap)  # the snapshot is already moved
        else:
            cast = cur.to(dtype).reshape(-1)
            snap_flat = snap.view(-1)
            bits = bits_dtype(dtype)
            flat = torch.nonzero(cast.view(bits) != snap_flat.view(bits)).squeeze(1)
            new, old = cast[flat], snap_flat[flat]
            if flat.numel():
                self.snapshot.commit(key, snap, flat, new)
        nnz = flat.numel()
        if nnz == 0:
            return None
        encoding, values, buffers = sparse_buffers(flat, new, old, tuple(cur.shape), self.options)
        if raw_nbytes(buffers) >= dense_nbytes:  # the snapshot now holds exactly the new tensor
            encoding, values, buffers = Encoding.DENSE, ValueEncoding.RAW, {Role.VALUES: snap.clone()}
            stats.tensors_dense += 1
        stats.changed_elements += nnz
        stats.tensors_changed += 1
        events = []
        if self.transport.type == "cpu":
            for role, t in buffers.items():
                buffers[role], event = self.snapshot.stream(t.device).to_host(t)
                if event is not None:
                    events.append(event)
        ordinal = self.plan.ordinal(key)
        return _Staged(ordinal, encoding, values, numel if encoding is Encoding.DENSE else nnz, buffers, events)

    def _pack(self, item: _Staged) -> EncodedTensor:
        for event in item.events:
            event.synchronize()
        return pack_entry(item.key, item.encoding, item.values, item.nnz, item.buffers, self.options.codec)


class PatchSender(SenderBase):
    """The patch strategy over injected ``send``/``recv``: one receiver, one PATCH per version."""

    strategy = "patch"

    def __init__(self, config: Any = None) -> None:
        super().__init__(config)
        self.config.patch.options()  # fail fast on a bad encoding or compressor
        self.builder: PatchBuilder | None = None

    async def on_init(self, state: ModelState) -> None:
        assert self.plan is not None
        self.builder = PatchBuilder(self.plan, self.config.patch)
        await asyncio.to_thread(self.builder.capture, state.tensors)

    async def sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        """Build the patch from the snapshot to ``model`` and send it as one PATCH message.

        The snapshot and ``self.version`` advance once the patch is built, before it is
        sent: if ``send`` fails, the receiver misses ``version`` and rejects the next
        patch as stale, which asks for a resync rather than silently diverging.
        """
        self.require_plan(version)
        assert self.builder is not None
        msg, stats = await self.builder.build(resolve_state(model).tensors, version, self.version)
        self.version = version
        started = time.perf_counter()
        wire = self.stamp(msg)
        stats.build_seconds += time.perf_counter() - started
        stats.messages, stats.wire_bytes = 1, sum(len(f) for f in wire)
        started = time.perf_counter()
        await send(wire)
        stats.send_seconds = time.perf_counter() - started
        return stats
