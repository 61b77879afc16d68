"""One rank's side of the sharded build: what ``ShardedSync`` does at each version when
every rank compares its own shards (``shards.ShardCompare``) and only the encoded changes move
to the leader (``shard_parts.PartMover``).

* ``ReceiverPlan``: what every rank must know of the receivers to build its part the way the
  leader's Sender would (each tracked key's ordinal and dtype, the ``patch`` settings). The
  first receiver fixes it on the leader; ``share_plan`` broadcasts it to the other ranks at
  the next version (a pickled object over the parts' gloo group: the ranks trust each other).
* ``ShardBuild``: a rank's compare and its part of each version: ``capture``/``recapture``
  the snapshot of its shards, ``part`` the version's changes as PATCH messages of about
  ``part_bytes`` each, packed into one buffer (``shard_parts.pack_part``; empty: no changes).
* ``leader_messages``: on the leader, every rank's messages in rank order, its own before the
  others have finished comparing, theirs as their parts arrive: what ``Sender.publish`` serves.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from protocol.codec.tensorcodec import EncodedTensor, assemble
from protocol.config import PatchConfig
from protocol.wire.framing import Message, MessageType

from ..plan import SyncPlan
from ..stats import SyncStats
from .shard_parts import Part, PartMover, PartStats, layout_digest, pack_part, unpack_part
from .shards import ShardCompare, ShardKey, shard_keys


@dataclass(frozen=True)
class ReceiverPlan:
    """The receivers' side of a sharded build, as every rank needs it."""

    ordinals: dict[str, int]
    dtypes: dict[str, torch.dtype]
    patch: PatchConfig

    @classmethod
    def of(cls, plan: SyncPlan, patch: PatchConfig) -> ReceiverPlan:
        return cls({k: plan.ordinal(k) for k in plan.tracked}, {k: plan.receiver_dtype(k) for k in plan.tracked}, patch)


def share_plan(plan: ReceiverPlan | None, mover: PartMover) -> ReceiverPlan:
    """The leader's ``plan`` on every rank (one broadcast over the parts' group; ``plan`` is
    only read on the leader)."""
    box: list[ReceiverPlan | None] = [plan if mover.is_leader else None]
    dist.broadcast_object_list(box, src=mover.global_rank(mover.leader), group=mover.group)
    shared = box[0]
    assert isinstance(shared, ReceiverPlan)
    return shared


def cut(entries: Sequence[EncodedTensor], part_bytes: int) -> list[list[EncodedTensor]]:
    """Consecutive groups of ``entries`` of at least ``part_bytes`` encoded bytes each (the last
    may be smaller); one group for ``part_bytes`` 0, none for no entries."""
    groups: list[list[EncodedTensor]] = []
    size = 0
    for e in entries:
        if not groups or (part_bytes and size >= part_bytes):
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.wire_nbytes
    return groups


class ShardBuild:
    """A rank's compare of its shards (``keys``, from its layout) and its part of each version.
    ``tensors``: the rank's tensors as its compare reads them (``ShardKey.source``);
    ``digest``: what every rank's part is built from, the same on every rank of one model
    (``shard_parts.layout_digest``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], keys: Sequence[ShardKey], plan: ReceiverPlan, digest: int) -> None:
        self.plan = plan
        self.keys = list(keys)
        self.compare = ShardCompare.from_config(tensors, self.keys, plan.patch)
        self.digest = digest
        self.last: SyncStats | None = None

    @classmethod
    def of_order(cls, tensors: Mapping[str, torch.Tensor], order: Sequence[str], plan: ReceiverPlan) -> ShardBuild:
        """The build of an FSDP2-style model: the ``order`` keys' shards (``shards.shard_keys``)."""
        keys = shard_keys(tensors, order, plan.ordinals, plan.dtypes)
        return cls(tensors, keys, plan, layout_digest((k, tuple(tensors[k].shape)) for k in order))

    @property
    def diverged(self) -> bool:
        return self.compare.diverged

    def capture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.compare.capture(tensors)

    def recapture(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.compare.recapture(tensors)

    def part(self, tensors: Mapping[str, torch.Tensor], version: int) -> Part:
        """This rank's changes since the snapshot, encoded and packed (b"": none); the snapshot
        moves on. ``last`` gets this rank's stats."""
        stats = SyncStats(version, "patch")
        started = time.perf_counter()
        entries = self.compare.collect(tensors, stats)
        messages = []
        for group in cut(entries, self.plan.patch.part_bytes):
            specs, frames = assemble(group)
            messages.append(Message(MessageType.PATCH, version=version, tensors=specs, frames=frames, last=False))
        part: Part = pack_part(messages) if messages else b""
        stats.build_seconds = time.perf_counter() - started
        self.last = stats
        return part


async def leader_messages(
    mover: PartMover, own: Part, agree: Callable[[], Awaitable[PartStats]]
) -> AsyncGenerator[Message, None]:
    """Every rank's messages of a version in rank order, for ``Sender.publish`` (which numbers
    them and marks the last): the leader's ``own`` part at once, so it travels while the other
    ranks still compare, then ``agree`` (the size agreement: every rank's compare is done) and
    each other rank's as soon as its part has arrived."""
    for msg in unpack_part(own) if own else []:
        yield msg
    agreed = await agree()
    async for rank, view in mover.aparts(agreed, own):
        if rank != mover.rank:
            for msg in unpack_part(view):
                yield msg
