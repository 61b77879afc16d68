"""A sharded trainer's weights synced through one ``Sender``, every rank in lockstep
(``ShardedSync``), whatever shards the model: its ``ShardLayout`` says (FSDP2's DTensors,
``fsdp.py``; Megatron-core's parallel layouts through its bridge, ``megatron.py``).

Two builds, one lockstep (``start`` and ``sync`` on every rank, checked by one small
all-reduce a version that also carries the leader's flags: ``_agree``):

**Sharded** (the default for the patch strategy): every rank compares its own
shards with its own snapshot of them (``shard_build.ShardBuild``) and only the encoded
changes move to the leader (``shard_parts.PartMover``), which publishes them as the parts of
one version (``Sender.publish``) as they arrive. No rank gathers a tracked tensor for a
patch. A bootstrap needs the whole model: when receivers wait for one (the leader's
``ShardedSource`` says so), every rank takes part in the layout's bootstrap after its part
(FSDP2: the gathers; Megatron: the bridge's export), and the leader serves that version's
bootstrap. A version that fails on any rank (a disagreement, a rank's compare, a rank gone)
is published by none and raises on every rank; the next one recaptures every rank's snapshot
and resyncs the receivers.

**Gathering** (``gather=True``, and the bucket strategy; FSDP2 only, ``fsdp.py``): every
version the leader's Sender reads the DTensors, gathered one at a time in one order on every
rank (``gathers.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from protocol.errors import ConfigError, GatherOrderError, WeightSyncError
from protocol.wire.framing import Message

from ..base import check_next_version
from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import Mark
from .fsdp import FsdpLayout
from .gathers import GatherStats, gather_order
from .shard_build import ReceiverPlan, ShardBuild, leader_messages, share_plan
from .shard_parts import FIGURES, Part, PartMover, PartStats

if TYPE_CHECKING:
    from ..serve.service import Sender

__all__ = ["GatherStats", "ShardLayout", "ShardedSync", "gather_order"]

T = TypeVar("T")
log = logging.getLogger(__name__)
# The leader's flags for a sharded version, in ``_agree``: what every rank does.
SHARDED = 1  # the sharded build (the leader's Sender is a patch one, and not gather=True)
PLAN = 2  # the receivers' plan is new: broadcast it, every rank captures its shards' snapshot
BOOT = 4  # receivers wait for a bootstrap: every rank takes part in the layout's (gathers, an export) after its part
REFUSED = 8  # the leader's Sender refuses the version (stale, not running): every rank raises


class ShardLayout(Protocol):
    """What ``ShardedSync`` needs of a sharded model, whatever shards it: its layout.
    ``fsdp.FsdpLayout`` (FSDP2's DTensors, the trainer's own names) and
    ``megatron.MegatronLayout`` (Megatron-core's parallel layouts, checkpoint names through its
    bridge). Every method that says "collective" is called on every rank in the same order."""

    trainable_keys: list[str]  # what the leader's Sender tracks (its ``trainable_keys``)
    stats: GatherStats  # what this rank gathered
    gathers: bool  # whether it has a gathering build (``lead``/``follow`` every version)

    def agreement(self) -> Iterable[str]:
        """What every rank must have alike (the ranks' agreement digests it)."""
        ...

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, as its compare reads them (``ShardKey.source``)."""
        ...

    def view(self) -> dict[str, torch.Tensor]:
        """The model the leader's Sender is started with and reads: the receivers' names."""
        ...

    def start(self, keep: bool) -> None:
        """Collective, once: what ``view`` needs (the leader ``keep``s it)."""
        ...

    def build(self, plan: ReceiverPlan) -> ShardBuild:
        """This rank's compare of its shards for the receivers' ``plan``."""
        ...

    async def lead(self, call: Callable[[dict[str, torch.Tensor]], Awaitable[T]]) -> T:
        """Collective, the leader's side (the gathering build): a Sender ``call`` of a ``view``."""
        ...

    def follow(self) -> None:
        """Collective, the other ranks' side of ``lead`` and of ``bootstrap``."""
        ...

    async def bootstrap(self, plan: SyncPlan, version: int, keys: Sequence[str]) -> list[Message]:
        """Collective, the leader's side: the bootstrap of ``keys`` at ``version`` for ``plan``."""
        ...


class ShardedSync:
    """One sharded model's weights, synced through one ``Sender`` (see the module docstring).

    ``model``: an FSDP2 module (its ``FsdpLayout`` is made here, ``trainable_keys`` selecting
    the tracked keys), or a ``ShardLayout`` (``megatron.MegatronLayout``). Every rank builds
    one from its sharded model and calls ``start`` once and ``sync`` at
    every version, in lockstep; the ``leader`` rank (a global rank) passes its Sender,
    the others ``None``. Construct the Sender with ``trainable_keys=sharded.trainable_keys``
    (they are also what ``trainable_keys`` here selects). ``group`` is the process group
    of the mesh (default: the world).

    ``gather``: the gathering build instead of the sharded one. Under the sharded build,
    ``parts_group`` is the gloo group the parts travel over (default: ``group`` if it is
    gloo, else a new gloo group of its ranks, made here: a collective of the world), and
    ``timeout`` bounds each wait of a version (the agreement, each part), in seconds.
    Not reentrant: one ``start``/``sync`` at a time on a rank (they are collectives).
    """

    def __init__(
        self,
        model: nn.Module | ShardLayout,
        *,
        trainable_keys: Iterable[str] | None = None,
        group: dist.ProcessGroup | None = None,
        leader: int = 0,
        gather: bool = False,
        parts_group: dist.ProcessGroup | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.group, self.leader = group, leader
        self.is_leader = dist.get_rank() == leader
        self.gather = gather
        if isinstance(model, nn.Module):
            self.layout: ShardLayout = FsdpLayout(model, trainable_keys, sharded=not gather)
        elif trainable_keys is not None:
            raise ConfigError("trainable_keys is for an FSDP2 module; a layout says its own")
        else:
            self.layout = model
        if gather and not self.layout.gathers:
            raise ConfigError(f"{type(self.layout).__name__} has no gathering build: use the sharded one (gather=False, the patch strategy)")
        self.trainable_keys = self.layout.trainable_keys
        self.stats = self.layout.stats  # what this rank gathered
        self.version: int | None = None
        self._started = False
        # the sharded build (the default): each rank's compare, and its parts' way to the leader
        self.sharded = False  # this start/sync's build (the leader's Sender says: a patch, and not ``gather``)
        self.mover: PartMover | None = None
        self._build: ShardBuild | None = None
        self._failed = False  # the last sharded version failed on some rank: the next one resyncs
        self.part_stats: PartStats | None = None  # the last sharded version's parts
        if not gather:
            self.mover = PartMover(_parts_group(group, parts_group), leader=_group_rank(group, leader), timeout=timeout)

    # -- every rank ---------------------------------------------------------------------
    async def start(self, sender: Sender | None, *, version: int | None = None) -> None:
        """Check the ranks agree, gather the untracked weights once, and start ``sender``."""
        if not self.is_leader:
            self._expect_sender(sender)
            await asyncio.to_thread(self.follow_start, version)
            return
        sender = self._expect_sender(sender)
        flags = SHARDED if not self.gather and sender.strategy == "patch" else 0
        self.sharded = bool((await asyncio.to_thread(self._agree, version, flags))[0] & SHARDED)
        if not self.sharded and not self.layout.gathers:
            raise ConfigError(f"{type(self.layout).__name__} syncs through the sharded build only: a patch Sender (not bucket)")
        await asyncio.to_thread(self.layout.start, True)
        self._started = True
        if self.sharded:  # nothing gathered: no rank holds the model whole
            self.stats.last = []
            await sender.start(self.layout.view(), version=version, sharded=True)
        else:
            await self.layout.lead(lambda view: sender.start(view, version=version))
        self.version = version

    async def sync(self, sender: Sender | None, version: int) -> SyncStats | None:
        """``sender.sync`` on the leader (its stats), the matching gathers elsewhere (None).
        Whatever reads the model on a worker thread first waits for the work queued on the
        caller's current streams (a trainer stepping on a side stream: ``streams.Mark``)."""
        mark = Mark.now(self.layout.tensors().values())
        if not self.is_leader:
            self._expect_sender(sender)
            await asyncio.to_thread(_after, mark, self.follow, version)
            return None
        sender = self._expect_sender(sender)
        if not self._started:
            raise WeightSyncError("ShardedSync.start() must come first")
        if self.sharded:
            stats = await self._sharded(sender, version, mark)
            self.version = version
            return stats
        await asyncio.to_thread(self._agree, version)
        stats = await self.layout.lead(lambda view: sender.sync(view, version))
        self.version = version
        return stats

    # -- the other ranks, without an event loop -------------------------------------------
    def follow_start(self, version: int | None = None) -> None:
        """A non-leader rank's ``start``: the same checks and gathers, nothing kept."""
        self.sharded = bool(self._agree(version)[0] & SHARDED)
        if not self.sharded and not self.layout.gathers:
            raise ConfigError(f"{type(self.layout).__name__} syncs through the sharded build only: a patch Sender (not bucket)")
        self.layout.start(False)
        if self.sharded:
            self.stats.last = []
        else:
            self.layout.follow()
        self._started = True
        self.version = version

    def follow(self, version: int) -> None:
        """A non-leader rank's ``sync``: its part of the version (the sharded build), or the
        leader's gathers in order, each tensor dropped at once."""
        if not self._started:
            raise WeightSyncError("ShardedSync.follow_start() must come first")
        if self.sharded:
            self._follow_sharded(version)
        else:
            self._agree(version)
            self.layout.follow()
        self.version = version

    # -- the sharded build -------------------------------------------------------------------
    async def _sharded(self, sender: Sender, version: int, mark: Mark) -> SyncStats:
        """The leader's sharded version: the flags every rank follows, its own part, the
        others' as they arrive, into ``sender.publish`` (with a bootstrap gathered when
        receivers wait for one)."""
        self.stats.last = []
        flags = SHARDED
        if sender.plan is not None and self._build is None:
            flags |= PLAN
        if sender.bootstrap_wanted:
            flags |= BOOT
        refused: WeightSyncError | None = None  # what the Sender would refuse: every rank raises, none waits
        try:
            sender.server.check_running()
            check_next_version(sender.version, version)
        except WeightSyncError as e:
            refused, flags = e, flags | REFUSED
        assert self.mover is not None
        mover = self.mover
        parts: AsyncGenerator[Message, None] | None = None
        # Where the other ranks are if this rank fails: "agree" (they raise with it), "parts"
        # (they wait in the part agreement: say this rank has none), "verdict" (they wait for
        # the leader's verdict), "done" (the part agreement raised on every rank).
        phase = "agree"
        try:
            flags, failed = await asyncio.to_thread(self._agree, version, flags, self._failed)
            if refused is not None:
                raise refused
            phase = "verdict"
            stats = SyncStats(version, "patch")
            boot = bool(flags & BOOT)
            if flags & PLAN:
                assert sender.plan is not None
                await asyncio.to_thread(_after, mark, self._share_plan, ReceiverPlan.of(sender.plan, sender.config.patch))
                boot = True
            elif self._build is not None and failed:
                await asyncio.to_thread(_after, mark, self._build.recapture, self.layout.tensors())
                boot = True
            elif self._build is not None:
                phase = "done"  # _own_part makes the agreement itself if it fails
                own = await asyncio.to_thread(_after, mark, self._own_part, version)
                assert self._build.last is not None
                digest, stats = self._build.digest, self._build.last
                phase = "parts"

                async def agree() -> PartStats:
                    nonlocal phase
                    phase = "done"
                    self.part_stats = agreed = await asyncio.to_thread(mover.agree, version, digest, own, _figures(stats))
                    phase = "verdict"
                    for figure in FIGURES:  # the version's counts, every rank's summed
                        setattr(stats, figure, agreed.total(figure))
                    return agreed

                parts = leader_messages(mover, own, agree)
            bootstrap = _Bootstrap(self.layout, version) if boot else None
            try:
                stats = await sender.publish(version, parts, bootstrap=bootstrap, stats=stats)
            finally:
                if parts is not None:
                    await parts.aclose()  # parts posted and not taken are taken (bounded): the ranks' sends end
                if bootstrap is not None and not bootstrap.called and phase == "verdict":
                    # past the part agreement the others make the bootstrap's collective: so must this rank
                    await asyncio.to_thread(self.layout.follow)
        except BaseException as e:
            self._failed = True
            if phase in ("parts", "verdict"):  # the others wait for this rank: tell them, every rank raises
                with contextlib.suppress(WeightSyncError):
                    if phase == "parts":
                        await asyncio.to_thread(mover.agree, version, digest, None)
                    else:
                        await asyncio.to_thread(self._verdict, False)
                if isinstance(e, Exception):
                    raise GatherOrderError(f"v{version} failed on the leader ({e!r}): no rank published it") from e
            raise
        self._failed = False
        try:
            await asyncio.to_thread(self._verdict, True)
        except WeightSyncError as e:  # published all the same: a rank is gone, the next version will say so
            log.warning("sharded sync: v%d published, but its verdict did not reach every rank: %s", version, e)
        return stats

    def _follow_sharded(self, version: int) -> None:
        """A non-leader's sharded version: as ``_sharded``, its part sent to the leader, then the
        leader's verdict (the version published or not) awaited: every rank raises together."""
        self.stats.last = []
        assert self.mover is not None
        try:
            flags, failed = self._agree(version, 0, self._failed)
            if flags & REFUSED:
                raise WeightSyncError(f"the leader's Sender refused v{version} (see its error): no rank synced it")
            boot = bool(flags & BOOT)
            if flags & PLAN:
                self._share_plan(None)
                boot = True
            elif self._build is not None and failed:
                self._build.recapture(self.layout.tensors())
                boot = True
            elif self._build is not None:
                own = self._own_part(version)
                assert self._build.last is not None
                self.part_stats = agreed = self.mover.agree(version, self._build.digest, own, _figures(self._build.last))
                self.mover.send(agreed, own)
            if boot:
                self.layout.follow()
            if not self._verdict(None):
                raise GatherOrderError(f"v{version} failed on the leader (see its error): no rank published it")
        except BaseException:
            self._failed = True
            raise
        self._failed = False

    def _verdict(self, ok: bool | None) -> bool:
        """The leader's word on the version (``ok``; None on the other ranks, which wait for it,
        bounded): whether it was published. One broadcast of 8 bytes over the parts' group."""
        assert self.mover is not None
        mover = self.mover
        flag = torch.tensor([int(bool(ok))], dtype=torch.int64)
        mover.wait(dist.broadcast(flag, src=mover.global_rank(mover.leader), group=mover.group, async_op=True), "the version's verdict")
        return bool(flag.item())

    def _share_plan(self, plan: ReceiverPlan | None) -> None:
        """The receivers' plan on every rank, and each rank's compare captured from its shards."""
        assert self.mover is not None
        shared = share_plan(plan, self.mover)
        build = self.layout.build(shared)
        build.capture(self.layout.tensors())
        self._build = build

    def _own_part(self, version: int) -> Part:
        """This rank's part of ``version``. If building it fails, this rank still makes the
        part agreement (saying it has none): every rank then raises its ``GatherOrderError``,
        this one chained from its own error."""
        assert self._build is not None
        try:
            return self._build.part(self.layout.tensors(), version)
        except Exception as e:
            log.error("sharded sync: rank %d failed to build its part of v%d: %r", dist.get_rank(), version, e)
            assert self.mover is not None
            try:
                self.mover.agree(version, self._build.digest, None)
            except GatherOrderError as refused:
                raise refused from e
            raise

    # -- internals ----------------------------------------------------------------------
    def _expect_sender(self, sender: Sender | None) -> Sender:
        if self.is_leader and sender is None:
            raise ConfigError(f"rank {self.leader} leads the sharded sync: pass its Sender")
        if not self.is_leader and sender is not None:
            raise ConfigError(f"only rank {self.leader} holds the Sender; pass None on rank {dist.get_rank()}")
        return sender  # type: ignore[return-value]

    def _view(self) -> dict[str, torch.Tensor]:
        """What the leader's Sender reads (the layout's view)."""
        return self.layout.view()

    def _agree(self, version: int | None, flags: int = 0, failed: bool = False) -> tuple[int, bool]:
        """All ranks check (one small all-reduce) that they sync the same version with the
        same gather order, and all raise together when not: no rank is left waiting. The
        same all-reduce carries the leader's ``flags`` (what every rank does this version;
        the others pass 0) and whether any rank ``failed`` its last version: both returned."""
        digest = xxhash.xxh3_64()
        for item in self.layout.agreement():
            digest.update(f"{item};".encode())
        h = digest.intdigest() & (2**62 - 1)
        v = -1 if version is None else version
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        row = torch.tensor([v, -v, h, -h, flags if self.is_leader else 0, int(failed)], dtype=torch.int64, device=device)
        if self.mover is None:
            dist.all_reduce(row, op=dist.ReduceOp.MAX, group=self.group)
        else:  # the sharded build bounds its waits: a rank gone is a typed error within the timeout
            self.mover.wait(dist.all_reduce(row, op=dist.ReduceOp.MAX, group=self.group, async_op=True), f"v{version}'s agreement")
        top, low, htop, hlow, leader_flags, any_failed = row.tolist()
        if htop != -hlow:
            raise GatherOrderError("the ranks' models differ (keys, shapes or trainable keys): their gathers would not match")
        if top != -low:
            raise GatherOrderError(f"the ranks sync different versions (from {-low} to {top}): call sync in lockstep")
        return leader_flags, bool(any_failed)


class _Bootstrap:
    """The leader's bootstrap of one version, for ``Sender.publish``: the layout's (a collective
    the other ranks make after their part). ``called``: whether publish got that far; if not,
    the leader still makes the collective (``ShardLayout.follow``), so no rank is left in it."""

    def __init__(self, layout: ShardLayout, version: int) -> None:
        self.layout, self.version = layout, version
        self.called = False

    async def __call__(self, plan: SyncPlan) -> list[Message]:
        self.called = True
        keys = set(plan.tracked) | set(plan.bootstrap_keys() if plan.init_sync.enabled else [])
        return await self.layout.bootstrap(plan, self.version, [k for k in plan.state.tensors if k in keys])


def _figures(stats: SyncStats) -> list[int]:
    return [int(getattr(stats, figure)) for figure in FIGURES]


def _group_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_group_rank(group, rank)


def _parts_group(group: dist.ProcessGroup | None, parts_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """Where the parts travel: ``parts_group``, else ``group`` when it is gloo (host bytes),
    else a new gloo group of ``group``'s ranks (a collective of every rank of the world)."""
    if parts_group is not None:
        return parts_group
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = None if group is None else dist.get_process_group_ranks(group)
    return dist.new_group(ranks=ranks, backend="gloo")


def _after(mark: Mark, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on this (worker) thread once its streams wait for ``mark``."""
    mark.wait()
    return fn(*args)
