"""A sharded trainer's encoded parts, moved from every rank to the leader:
each rank of a process group holds its part of a version (bytes, possibly empty); the leader
rank takes them all, rank by rank, as they arrive (``ShardedSync``'s sharded build).

* **Sizes first** (``PartMover.agree``, every rank): one all-gather (``all_gather_single``) of
  eight int64 a rank, ``[version, nbytes, digest]`` and the rank's counts (``FIGURES``) (``layout_digest``: the keys and shapes the
  parts were built from). Every rank then knows every part's size and checks the rows alike, so every rank
  raises the same ``GatherOrderError`` when they differ (another version, another layout, a
  rank that had no part: ``nbytes`` -1), as ``ShardedSync``'s own agreement does. No rank is
  left waiting: all of them made the one collective.
* **Then the bytes** (point to point): ``PartMover.send`` on a non-leader ``isend``s its part,
  ``PartMover.parts`` on the leader posts an ``irecv`` into a uint8 tensor of the agreed size
  for every other non-empty part at once and yields ``(rank, memoryview)`` in rank order: its
  own part first (a view of it, no copy), then each rank's as soon as it has arrived (a view
  of the tensor it was received into). Empty parts are not sent. ``aparts``: the same for an
  event loop, each wait on a worker thread.
* **Bounded**: every wait is ``Work.wait(timeout)``; one that runs out raises
  ``WeightSyncTimeout`` (a ``WeightSyncError`` and a ``TimeoutError``): the agreement within
  ``timeout`` of its call, a part within ``timeout`` of the leader asking for it, a send within
  ``timeout`` of its call. Any other failure of the group (a peer gone) is a ``WeightSyncError``.
* **Accounting** (``PartStats``, ``PartMover.stats``): the bytes the group carried for the
  version, ``moved_bytes`` (the non-leader parts, counted as they arrive or are sent) plus
  ``control_bytes`` (what the agreement delivers: 24 bytes of each rank to each other rank).

What a failure leaves behind (gloo, torch 2.13): a point-to-point wait that times out makes
gloo close *every* connection of that process (its context "signals" the timeout to all its
pairs), so the group is dead on that rank: its next operation fails at once, and its peers'
next one fails too (a lost connection, or the bounded wait of this module running out: the
tests see the other ranks' next agreement end in ``WeightSyncTimeout``). A timed-out all-gather leaves the collective running in gloo's worker
(it completes or fails by the group's own timeout, the one given to ``init_process_group``),
so the ranks are no longer in step. Either way the group cannot carry another version: after
a ``WeightSyncTimeout`` (or any ``WeightSyncError`` but the agreement's ``GatherOrderError``,
which leaves the group in step) the trainer rebuilds it (``destroy_process_group``, init
again), and the sender resyncs its receivers by bootstrap. Each version's parts travel under
their own tag, so a late part of an abandoned version is never taken for the next one's.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash

from protocol.errors import ConfigError, GatherOrderError, ProtocolError, WeightSyncError, WeightSyncTimeout
from protocol.wire.framing import Message, decode_message, encode_message
from protocol.wire.limits import DEFAULT_LIMITS, Limits

log = logging.getLogger(__name__)

Part = bytes | bytearray | memoryview
FIGURES = ("total_elements", "changed_elements", "dense_bytes", "tensors_changed", "tensors_dense")  # a rank's counts (SyncStats')
FIELDS = 3 + len(FIGURES)  # int64 a rank in the agreement: version, nbytes, digest, then the figures
CONTROL_ROW_BYTES = FIELDS * 8
NO_PART = -1  # the nbytes of a rank that has no part for the version (its build failed)
DIGEST_MASK = 2**63 - 1


def layout_digest(layout: Iterable[tuple[str, Sequence[int]] | str]) -> int:
    """A digest (a non-negative int64) of the keys (and shapes) a rank's part was built from,
    in order: ranks whose parts belong to one version agree on it."""
    digest = xxhash.xxh3_64()
    for item in layout:
        key, shape = (item, ()) if isinstance(item, str) else item
        digest.update(f"{key}{tuple(shape)};".encode())
    return digest.intdigest() & DIGEST_MASK


def control_bytes(world: int) -> int:
    """The bytes one agreement delivers over a group of ``world`` ranks: each rank's row to
    each other rank (an ``all_gather``; O(ranks) a rank)."""
    return world * (world - 1) * CONTROL_ROW_BYTES


@dataclass
class PartStats:
    """One version's parts, as this rank saw them. ``sizes``: every rank's agreed part size;
    ``moved_bytes``: the part bytes that crossed the group so far (on the leader those it has
    received, on another rank the part it sent); ``control_bytes``: the agreement's."""

    version: int
    sizes: list[int]
    leader: int
    control_bytes: int
    moved_bytes: int = 0
    arrived: list[int] = field(default_factory=list)  # ranks whose parts the leader took, in order
    figures: list[list[int]] = field(default_factory=list)  # each rank's ``FIGURES``, as agreed

    def total(self, figure: str) -> int:
        """One of ``FIGURES`` summed over the ranks: the version's, as an unsharded build counts it."""
        at = FIGURES.index(figure)
        return sum(row[at] for row in self.figures)

    @property
    def group_bytes(self) -> int:
        """What the process group carried for this version: the parts plus the control."""
        return self.moved_bytes + self.control_bytes

    @property
    def remote_bytes(self) -> int:
        """The parts that must cross the group (every rank's but the leader's)."""
        return sum(n for r, n in enumerate(self.sizes) if r != self.leader)


def _tag(version: int) -> int:
    return version & 0x7FFFFFFF


class PartMover:
    """Moves each rank's encoded part of a version to ``leader`` (a rank of ``group``; default:
    the world) over a CPU-capable process group (gloo). Every rank calls ``agree`` for a version,
    then the leader iterates ``parts`` (or ``aparts``) while every other rank calls ``send``.
    ``timeout``: seconds any one wait may take (see the module's docstring)."""

    def __init__(self, group: dist.ProcessGroup | None = None, *, leader: int = 0, timeout: float = 60.0) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        backend = str(dist.get_backend(group))
        if "gloo" not in backend and "mpi" not in backend:
            raise ConfigError(f"the parts are host bytes: pass a gloo process group (this one is {backend!r}), e.g. dist.new_group(backend='gloo')")
        self.group, self.leader, self.timeout = group, leader, timeout
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if not 0 <= leader < self.world:
            raise ConfigError(f"leader {leader} outside a group of {self.world}")
        self.is_leader = self.rank == leader
        self.stats: PartStats | None = None

    # -- every rank -----------------------------------------------------------------------
    def agree(self, version: int, digest: int, part: Part | None, figures: Sequence[int] = ()) -> PartStats:
        """The one collective of a version: every rank's part size, checked to belong to the
        same ``version`` and ``digest`` on every rank (else a ``GatherOrderError`` on all of
        them). ``part`` None: this rank has no part (its build failed); every rank raises.
        ``figures``: this rank's counts (``FIGURES``, zeros where not given), shared too."""
        if not 0 <= version <= DIGEST_MASK or not 0 <= digest <= DIGEST_MASK:
            raise ConfigError(f"version and digest are non-negative int64s, got {version}, {digest}")
        if len(figures) > len(FIGURES):
            raise ConfigError(f"at most {len(FIGURES)} figures ({', '.join(FIGURES)}), got {len(figures)}")
        nbytes = NO_PART if part is None else memoryview(part).nbytes
        counts = [*figures, *[0] * (len(FIGURES) - len(figures))]
        mine = torch.tensor([version, nbytes, digest, *counts], dtype=torch.int64)
        rows = torch.empty(self.world * FIELDS, dtype=torch.int64)
        work = dist.all_gather_single(rows, mine, group=self.group, async_op=True)
        self.wait(work, "the size agreement")
        table = rows.view(self.world, FIELDS).tolist()
        versions = sorted({row[0] for row in table})
        if len(versions) > 1:
            raise GatherOrderError(f"the ranks move parts of different versions ({versions}): call them in lockstep")
        if len({row[2] for row in table}) > 1:
            odd = [r for r, row in enumerate(table) if row[2] != table[self.leader][2]]
            raise GatherOrderError(f"ranks {odd} built their parts of version {version} from other keys or shapes than the leader's")
        missing = [r for r, row in enumerate(table) if row[1] == NO_PART]
        if missing:
            raise GatherOrderError(f"ranks {missing} have no part of version {version}: the version is not published")
        self.stats = PartStats(version, [row[1] for row in table], self.leader, control_bytes(self.world),
                               figures=[row[3:] for row in table])
        return self.stats

    # -- a non-leader -----------------------------------------------------------------------
    def send(self, agreed: PartStats, part: Part) -> None:
        """Send this rank's part (as agreed) to the leader; returns once the leader has it
        (gloo sends when the receive is posted), or raises ``WeightSyncTimeout`` after ``timeout``."""
        if self.is_leader:
            raise ConfigError("the leader does not send its part: iterate parts()")
        view = memoryview(part).cast("B")
        if view.nbytes != agreed.sizes[self.rank]:
            raise ConfigError(f"rank {self.rank}: a part of {view.nbytes} bytes where {agreed.sizes[self.rank]} were agreed")
        if not view.nbytes:
            return
        with warnings.catch_warnings():  # a read-only buffer: sending only reads it
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8)
        work = dist.isend(tensor, self.global_rank(self.leader), group=self.group, tag=_tag(agreed.version))
        self.wait(work, f"rank {self.rank}'s part of version {agreed.version}")
        agreed.moved_bytes += view.nbytes

    # -- the leader -------------------------------------------------------------------------
    def parts(self, agreed: PartStats, part: Part) -> Iterator[tuple[int, memoryview]]:
        """Every non-empty part of the version, ``(rank, bytes)`` in rank order: the leader's
        own first (``part``, not copied), then each other rank's once it has arrived, each
        waited for at most ``timeout`` from when it is asked for. Closed early, the generator
        still takes the parts already posted (bounded), so the ranks' sends complete."""
        pending, own = self._start(agreed, part)
        try:
            if own is not None:
                yield own
            while pending:
                yield self._take(agreed, pending)
        finally:
            self._drain(agreed, pending)

    async def aparts(self, agreed: PartStats, part: Part) -> AsyncIterator[tuple[int, memoryview]]:
        """``parts`` for an event loop: each wait on a worker thread."""
        pending, own = self._start(agreed, part)
        try:
            if own is not None:
                yield own
            while pending:
                yield await asyncio.to_thread(self._take, agreed, pending)
        finally:
            if pending:
                await asyncio.to_thread(self._drain, agreed, pending)

    # -- internals ----------------------------------------------------------------------------
    def _start(self, agreed: PartStats, part: Part) -> tuple[list[tuple[int, torch.Tensor, dist.Work]], tuple[int, memoryview] | None]:
        """The other ranks' receives posted, and the leader's own part (None when empty)."""
        pending = self._post(agreed, part)
        own = memoryview(part).cast("B")
        if not own.nbytes:
            return pending, None
        agreed.arrived.append(self.rank)
        return pending, (self.rank, own)

    def _post(self, agreed: PartStats, part: Part) -> list[tuple[int, torch.Tensor, dist.Work]]:
        if not self.is_leader:
            raise ConfigError(f"only rank {self.leader} takes the parts; rank {self.rank} sends its own")
        if memoryview(part).nbytes != agreed.sizes[self.rank]:
            raise ConfigError(f"the leader's part has {memoryview(part).nbytes} bytes where {agreed.sizes[self.rank]} were agreed")
        pending = []
        for rank, nbytes in enumerate(agreed.sizes):
            if rank == self.rank or not nbytes:
                continue
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            work = dist.irecv(buffer, self.global_rank(rank), group=self.group, tag=_tag(agreed.version))
            if work is None:  # not in this group: cannot happen for a rank of it
                raise WeightSyncError(f"rank {rank} is not in the process group")
            pending.append((rank, buffer, work))
        return pending

    def _take(self, agreed: PartStats, pending: list[tuple[int, torch.Tensor, dist.Work]]) -> tuple[int, memoryview]:
        rank, buffer, work = pending.pop(0)
        try:
            self.wait(work, f"rank {rank}'s part of version {agreed.version}")
        except WeightSyncError:
            pending.clear()  # the group is gone (see the module's docstring): nothing more will arrive
            raise
        agreed.moved_bytes += buffer.numel()
        agreed.arrived.append(rank)
        return rank, memoryview(buffer.numpy()).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers

    def _drain(self, agreed: PartStats, pending: list[tuple[int, torch.Tensor, dist.Work]]) -> None:
        while pending:
            try:
                self._take(agreed, pending)
            except WeightSyncError as e:  # the group is gone: nothing more will arrive
                log.warning("shard parts: the rest of version %d's parts not taken: %s", agreed.version, e)
                return

    def global_rank(self, rank: int) -> int:
        """The global rank of ``rank`` of the group."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def wait(self, work: dist.Work | None, what: str) -> None:
        """Wait for ``work`` (an async collective or point-to-point) at most ``timeout``:
        ``WeightSyncTimeout`` past it, ``WeightSyncError`` if it fails (a rank gone)."""
        if work is None:
            raise WeightSyncError(f"{what}: this rank is not in the process group")
        started = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as e:  # gloo's timeouts and lost peers (DistBackendError is one too)
            waited = time.monotonic() - started
            if "timed out" in str(e).lower() or waited >= self.timeout:
                raise WeightSyncTimeout(f"{what} did not complete within {self.timeout:g}s: the process group must be rebuilt") from e
            raise WeightSyncError(f"{what} failed after {waited:.1f}s (a rank gone?): {e}") from e


# -- a rank's part: its messages' frames end to end -----------------------------------------
# int64 header: [messages, frames of each message..., length of each frame...], then the frames.


def pack_part(messages: Sequence[Message]) -> bytearray:
    """A rank's encoded messages of a version as one part (``unpack_part`` reverses it): the
    leader re-frames each message (``decode_message`` checks its checksums) and stamps it.
    Each frame is copied once, into the buffer returned (not copied again into ``bytes``)."""
    framed = [encode_message(m) for m in messages]
    lengths = [len(f) for frames in framed for f in frames]
    header = torch.tensor([len(framed), *(len(f) for f in framed), *lengths], dtype=torch.int64)
    out = bytearray(header.numel() * 8 + sum(lengths))
    out[: header.numel() * 8] = header.numpy().tobytes()
    at = header.numel() * 8
    for frames in framed:
        for f in frames:
            n = len(f)
            out[at : at + n] = f
            at += n
    return out


def unpack_part(part: Part, limits: Limits = DEFAULT_LIMITS) -> list[Message]:
    """The messages of a part made by ``pack_part`` (their frames views of ``part``, no copy);
    a part that is not one is a ``ProtocolError``, a message that does not decode one too."""
    view = memoryview(part).cast("B")
    if view.nbytes < 8:
        raise ProtocolError(f"a shard part of {view.nbytes} bytes has no header")
    count = int.from_bytes(view[:8], "little", signed=True)
    if not 0 < count <= limits.tensors:
        raise ProtocolError(f"a shard part says it holds {count} messages")
    if view.nbytes < 8 * (1 + count):
        raise ProtocolError("a shard part's header is cut short")
    counts = [int.from_bytes(view[8 * (1 + i) : 8 * (2 + i)], "little", signed=True) for i in range(count)]
    if any(not 0 < c <= limits.frames for c in counts):
        raise ProtocolError(f"a shard part's messages say they have {counts} frames")
    at = 8 * (1 + count)
    total = sum(counts)
    if view.nbytes < at + 8 * total:
        raise ProtocolError("a shard part's header is cut short")
    lengths = [int.from_bytes(view[at + 8 * i : at + 8 * (i + 1)], "little", signed=True) for i in range(total)]
    at += 8 * total
    if any(n < 0 for n in lengths) or at + sum(lengths) != view.nbytes:
        raise ProtocolError(f"a shard part of {view.nbytes} bytes whose frames add up to {at + sum(lengths)}")
    messages, i = [], 0
    for c in counts:
        frames = []
        for n in lengths[i : i + c]:
            frames.append(view[at : at + n])
            at += n
        i += c
        messages.append(decode_message(frames, limits))
    return messages
