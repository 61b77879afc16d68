"""The patch strategy, actor side: send only what changed since the snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from protocol.codec.compress import Codec
from protocol.codec.parallel import map_ordered
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, assemble, pack_entry, raw_nbytes, sparse_buffers
from protocol.config import PatchConfig
from protocol.errors import MetadataMismatchError
from protocol.lazy import lazy_module
from protocol.state import ModelState, StateLike, is_dtensor, materialize, resolve_state
from protocol.wire.dtypes import bits_dtype
from protocol.wire.framing import Encoding, Message, MessageType, Role, ValueEncoding

from .base import Send, SenderBase
from .plan import SyncPlan
from .snapshot import Snapshot
from .stats import SyncStats

if TYPE_CHECKING:
    from protocol.codec import entropy

    from . import fastdiff
else:  # numba loads on first use (protocol/lazy.py)
    entropy, fastdiff = lazy_module("protocol.codec.entropy"), lazy_module("sender.fastdiff")


# States whose compare reads at most this run it on the event loop's thread (~3 ms of
# reading at 20 GB/s): below it a thread hand-off is a large share of the build.
INLINE_READ_BYTES = 64 << 20


@dataclass
class Changes:
    """One tensor's changes, captured: host copies (or copies under way) of the changed
    positions and their new and old values, so encoding can run after the trainer moved on.
    Where it surely goes whole (``PatchOptions.surely_dense``) only the whole new tensor is kept."""

    key: int
    shape: tuple[int, ...]
    nnz: int
    flat: torch.Tensor | None
    new: torch.Tensor | None
    old: torch.Tensor | None
    dense: torch.Tensor | None  # the whole new tensor, kept when a dense send may be cheaper
    events: list[torch.cuda.Event]

    def wait(self) -> None:
        for event in self.events:
            event.synchronize()

    def captured_nbytes(self) -> int:
        """What this capture holds: changed positions and values, or the whole tensor."""
        held = (self.flat, self.new, self.old) if self.flat is not None else (self.dense,)
        return sum(t.numel() * t.element_size() for t in held if t is not None)


@dataclass(frozen=True)
class _KeyInfo:
    """What the plan fixes about a tracked key, looked up once rather than per sync."""

    ordinal: int
    dtype: torch.dtype  # the receivers'
    itemsize: int
    candidate: float  # PatchOptions.dense_candidate: from this share a whole copy is kept
    surely: float  # PatchOptions.surely_dense: past this share it goes whole whatever the values

    @classmethod
    def of(cls, plan: SyncPlan, options: PatchOptions, key: str) -> _KeyInfo:
        dtype = plan.receiver_dtype(key)
        size = dtype.itemsize
        return cls(plan.ordinal(key), dtype, size, options.dense_candidate(size), options.surely_dense(size))


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
        self.part_bytes = config.part_bytes
        self.snapshot = Snapshot(config.snapshot_device)
        self.transport = torch.device(config.transport_device)
        self._keys = {key: _KeyInfo.of(plan, self.options, key) for key in plan.tracked}
        # what a compare reads: the state and the snapshot
        self._read_bytes = sum(plan.state.tensors[k].numel() * (plan.state.tensors[k].element_size() + i.itemsize) for k, i in self._keys.items())

    def capture(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the snapshot: what the receivers hold after the bootstrap."""
        for key in self.plan.tracked:
            self.snapshot.capture(key, materialize(tensors[key]).detach().to(self.plan.receiver_dtype(key)))
        # JIT now, during the handshake, rather than in the first sync.
        fastdiff.warm_up({(tensors[k].dtype, self.plan.receiver_dtype(k)) for k in self.plan.tracked})
        entropy.warm_up()

    async def hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start holding the version in ``tensors`` (the first receiver's dtypes are known)."""
        await asyncio.to_thread(self.capture, tensors)

    def held(self) -> dict[str, torch.Tensor]:
        """The tracked tensors of the current version at rest (after ``settled``)."""
        return self.snapshot.tensors

    async def settled(self) -> None:
        """Until ``held`` is the current version: the snapshot's write-back is done."""
        await self.snapshot.wait_writeback()

    async def build(self, tensors: dict[str, torch.Tensor], version: int, base: int | None) -> tuple[Message, SyncStats]:
        """The PATCH from ``base`` to ``version``; advances the snapshot to ``version``."""
        changes, stats = await self.collect(tensors, version)
        return await self.encode(changes, version, base, stats), stats

    async def collect(self, tensors: dict[str, torch.Tensor], version: int) -> tuple[list[Changes], SyncStats]:
        """Compare the model with the snapshot, collect the changes and advance the
        snapshot to ``version``: the only part that reads the model."""
        stats = SyncStats(version, "patch")
        started = time.perf_counter()
        await self.snapshot.wait_writeback()
        if self._inline(tensors):
            changes = self._collect(tensors, stats)
        else:
            changes = await asyncio.to_thread(self._collect, tensors, stats)
        stats.build_seconds = time.perf_counter() - started
        return changes, stats

    def _inline(self, tensors: dict[str, torch.Tensor]) -> bool:
        """Whether to compare on the caller's thread: a small state of plain CPU tensors,
        where the hand-off to a worker thread (~0.3 ms idle, a few ms on a busy host, the
        GIL changing hands at every kernel) costs more than blocking the loop that long.
        DTensors (whose gathers may need the loop) and CUDA tensors always go to a thread."""
        if self._read_bytes > INLINE_READ_BYTES or self.snapshot.device.type != "cpu" or self.transport.type != "cpu":
            return False
        return all((t := tensors.get(key)) is not None and t.device.type == "cpu" and not is_dtensor(t) for key in self.plan.tracked)

    async def encode(self, changes: list[Changes], version: int, base: int | None, stats: SyncStats) -> Message:
        """Entropy code and pack captured changes as one message (host CPU work, off the event loop)."""
        return await self._encode_part(changes, version, base, stats, 0, 1)

    async def encode_parts(self, changes: list[Changes], version: int, base: int | None, stats: SyncStats) -> AsyncIterator[Message]:
        """The same as parts of about ``part_bytes`` of changes each, yielded as each is
        encoded: a receiver decodes one part while the next is encoded (the daemon's way)."""
        groups = self.parts(changes)
        for i, group in enumerate(groups):
            yield await self._encode_part(group, version, base, stats, i, len(groups))

    def parts(self, changes: list[Changes]) -> list[list[Changes]]:
        """Consecutive groups of ``changes`` of at least ``part_bytes`` each (by the bytes
        captured: positions and values, or the whole tensor); one group for 0, or for
        fewer changes than that."""
        groups: list[list[Changes]] = [[]]
        size = 0
        for c in changes:
            if self.part_bytes and size >= self.part_bytes:
                groups.append([])
                size = 0
            groups[-1].append(c)
            size += c.captured_nbytes()
        return groups

    async def _encode_part(
        self, changes: list[Changes], version: int, base: int | None, stats: SyncStats, part: int, parts: int
    ) -> Message:
        started = time.perf_counter()
        encoded = await asyncio.to_thread(map_ordered, self._encode, changes)
        stats.tensors_dense += sum(e.encoding is Encoding.DENSE for e in encoded)
        specs, frames = assemble(encoded)
        stats.encode_seconds += time.perf_counter() - started
        return Message(MessageType.PATCH, version=version, base_version=base, tensors=specs, frames=frames, part=part, parts=parts)

    def _collect(self, tensors: dict[str, torch.Tensor], stats: SyncStats) -> list[Changes]:
        keys = self.plan.tracked
        captured: list[Changes] = []
        fetched = self._fetch(keys[0], tensors) if keys else None
        for i, key in enumerate(keys):
            assert fetched is not None
            working, event = fetched
            if i + 1 < len(keys):  # prefetch the next snapshot while this one is compared
                fetched = self._fetch(keys[i + 1], tensors)
            cur = materialize(tensors[key]).detach()
            snap = working if event is None else self.snapshot.stream(cur.device).use(working, event)
            item = self._diff(key, cur, snap, stats)
            # A sharded (FSDP2) weight was gathered whole: drop it before the next
            # gather, so no more than one full tensor is alive at a time.
            del cur, snap
            if item is not None:
                captured.append(item)
        return captured

    def _fetch(self, key: str, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if key not in tensors:
            raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
        return self.snapshot.fetch(key, tensors[key].device)

    def _diff(self, key: str, cur: torch.Tensor, snap: torch.Tensor, stats: SyncStats) -> Changes | None:
        info = self._keys[key]
        if cur.shape != snap.shape:
            raise MetadataMismatchError(f"key {key!r} changed shape from {list(snap.shape)} to {list(cur.shape)}")
        numel = cur.numel()
        stats.total_elements += numel
        stats.dense_bytes += numel * info.itemsize
        if snap is self.snapshot.tensors[key] and fastdiff.supported(cur, snap):
            nnz, flat, new, old = fastdiff.diff_and_update(cur, snap, self._dense_rule(info, cur, snap))
        else:
            nnz, flat, new, old = self._torch_diff(key, info.dtype, cur, snap)
        if nnz == 0:
            return None
        stats.changed_elements += nnz
        stats.tensors_changed += 1
        # The snapshot now holds exactly the new tensor: keep it when dense may win.
        dense = snap.clone() if nnz > info.candidate * numel else None
        if snap.device.type == "cpu" or self.transport.type == "cuda":  # nothing to stage
            return Changes(info.ordinal, tuple(cur.shape), nnz, flat, new, old, dense, [])
        return self._staged(info.ordinal, tuple(cur.shape), nnz, (flat, new, old, dense))

    def _dense_rule(self, info: _KeyInfo, cur: torch.Tensor, snap: torch.Tensor) -> Callable[[int], bool]:
        """Whether a tensor with ``total`` changes goes whole, for ``diff_and_update`` (the
        snapshot not yet moved). The sample is only taken where the counts leave it open."""
        numel, options = cur.numel(), self.options

        def goes_dense(total: int) -> bool:
            if total <= info.candidate * numel:
                return False
            if total > info.surely * numel:  # what options.goes_dense says whatever the sample
                return options.goes_dense(total, numel, info.itemsize, None)
            return options.goes_dense(total, numel, info.itemsize, sampled_differences(cur, snap))

        return goes_dense

    def _torch_diff(
        self, key: str, dtype: torch.dtype, cur: torch.Tensor, snap: torch.Tensor
    ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The diff in torch ops (CUDA, dtype pairs the fused kernels lack); commits the snapshot."""
        cast = cur.to(dtype).reshape(-1)
        snap_flat = snap.view(-1)
        bits = bits_dtype(dtype)
        flat = torch.nonzero(cast.view(bits) != snap_flat.view(bits)).squeeze(1)
        new, old = cast[flat], snap_flat[flat]
        nnz = flat.numel()
        if nnz:
            self.snapshot.commit(key, snap, flat, new)
        return nnz, flat, new, old

    def _staged(self, ordinal: int, shape: tuple[int, ...], nnz: int, held: tuple[torch.Tensor | None, ...]) -> Changes:
        """``Changes`` whose device tensors are copied to pinned host memory, behind events."""
        events: list[torch.cuda.Event] = []
        staged: list[torch.Tensor | None] = []
        for t in held:
            if t is None:
                staged.append(t)
                continue
            host, event = self.snapshot.stream(t.device).to_host(t)
            staged.append(host)
            if event is not None:
                events.append(event)
        flat_h, new_h, old_h, dense_h = staged
        return Changes(ordinal, shape, nnz, flat_h, new_h, old_h, dense_h, events)

    def _encode(self, changes: Changes) -> EncodedTensor:
        changes.wait()
        # Host buffers nvcomp_lz4 compresses (the entropy coder's side tables) go to the device
        # of the tensor's other buffers: made current in this codec thread while it is packed.
        held = changes.flat if changes.flat is not None else changes.dense
        device = None if held is None else held.device
        with torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext():
            return self._pack(changes)

    def _pack(self, changes: Changes) -> EncodedTensor:
        dense, nnz = changes.dense, changes.nnz
        if dense is not None and (changes.flat is None or self._goes_dense(changes, dense)):  # whole and fast
            return pack_entry(changes.key, Encoding.DENSE, ValueEncoding.RAW, dense.numel(), {Role.VALUES: dense.view(changes.shape)}, Codec.NONE)
        assert changes.flat is not None and changes.new is not None and changes.old is not None
        encoding, values, buffers = sparse_buffers(changes.flat, changes.new, changes.old, changes.shape, self.options)
        if dense is not None and raw_nbytes(buffers) >= dense.numel() * dense.element_size():
            encoding, values, buffers, nnz = Encoding.DENSE, ValueEncoding.RAW, {Role.VALUES: dense.view(changes.shape)}, dense.numel()
        return pack_entry(changes.key, encoding, values, nnz, buffers, self.options.codec)

    def _goes_dense(self, changes: Changes, dense: torch.Tensor) -> bool:
        diffs = None
        if changes.new is not None and changes.old is not None:  # a sample of how far the values moved
            step = max(1, changes.nnz // 2048)
            diffs = entropy.ulp_differences(changes.new[::step], changes.old[::step])
        return self.options.goes_dense(changes.nnz, dense.numel(), dense.element_size(), diffs)


def sampled_differences(cur: torch.Tensor, snap: torch.Tensor, sample: int = 2048) -> torch.Tensor:
    """The ulp differences of the changed elements among ~``sample`` evenly strided ones of
    ``cur`` (cast to the snapshot's dtype) against ``snap`` (not yet moved)."""
    step = max(1, cur.numel() // sample)
    if fastdiff.supported(cur, snap):  # the same, without a torch op per step (~25 -> ~6 us)
        return fastdiff.sampled_differences(cur, snap, step)
    new = cur.reshape(-1)[::step].to(snap.dtype)
    diffs = entropy.ulp_differences(new, snap.reshape(-1)[::step])
    return diffs[diffs != 0]


class PatchSender(SenderBase):
    """The patch strategy over injected ``send``/``recv``: one receiver, the PATCH parts of each version."""

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
        """Build the patch from the snapshot to ``model`` and send it, in parts of
        ``patch.part_bytes`` (each sent as soon as it is encoded).

        The snapshot and ``self.version`` advance once the changes are collected, before
        anything is sent: if ``send`` fails, the receiver misses ``version`` and rejects
        the next patch as stale, which asks for a resync rather than silently diverging.
        """
        self.require_plan(version)
        assert self.builder is not None
        changes, stats = await self.builder.collect(resolve_state(model).tensors, version)
        base, self.version = self.version, version
        async for msg in self.builder.encode_parts(changes, version, base, stats):
            started = time.perf_counter()
            wire = self.stamp(msg)
            stats.build_seconds += time.perf_counter() - started
            stats.messages += 1
            stats.wire_bytes += sum(len(f) for f in wire)
            started = time.perf_counter()
            await send(wire)
            stats.send_seconds += time.perf_counter() - started
        return stats
