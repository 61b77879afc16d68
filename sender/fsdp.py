"""FSDP2 (``fully_shard``) trainers: every rank's shards streamed to one ``Sender``.

Gathering a DTensor is a collective, so every rank of the mesh must gather the same
tensors in the same order, and the rank hosting the Sender must never hold the whole
model gathered. ``ShardedSync`` makes both hold:

* the order is ``gather_order`` (tracked keys without aliases, in
  state-dict order), computed on every rank and checked equal across ranks at ``start``;
* on the leader (the rank with the Sender) each gather happens when the Sender asks
  for that tensor (``materialize`` under a ``gathering`` hook): it is diffed against the
  snapshot (patch) or cast into the retained copy (bucket) and dropped before the next.
  A request out of order is a ``GatherOrderError``, never a mismatched collective;
* every other rank gathers the same keys in the same order and drops each at once.

Weights the Sender does not track (frozen) are gathered once, at ``start``, into plain
tensors the leader keeps: a receiver joining at any time is bootstrapped from them and
the snapshot without a collective. Buffers are not sharded by FSDP2 and are read locally.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import xxhash
from torch import nn

from protocol.errors import ConfigError, GatherOrderError, WeightSyncError
from protocol.state import ModelState, gathering, is_dtensor, resolve_state, sync_keys

if TYPE_CHECKING:
    from .service import Sender
    from .stats import SyncStats

log = logging.getLogger(__name__)
T = TypeVar("T")
RELEASE_WAIT = 1.0  # seconds a gather waits for the previous gathered tensor to be freed


def gather_order(state: ModelState) -> list[str]:
    """The DTensors a sender gathers at every version, in the order it gathers them.

    The one definition every rank of a sharded model follows: the collectives of one
    version match only if each rank gathers exactly these keys, in this order.
    """
    return [k for k in sync_keys(state) if is_dtensor(state.tensors[k])]

@dataclass
class GatherStats:
    """What this rank gathered. ``peak_live``/``peak_bytes``: the most gathered full
    tensors (and their bytes) alive at once, tracked by storage lifetime."""

    gathers: int = 0
    last: list[str] = field(default_factory=list)  # keys gathered by the last start/sync, in order
    live: int = 0
    live_bytes: int = 0
    peak_live: int = 0
    peak_bytes: int = 0
    overlaps: int = 0  # gathers that found the previous gathered tensor still alive after RELEASE_WAIT


class ShardedSync:
    """One FSDP2 model's weights, gathered tensor by tensor for one ``Sender``.

    Every rank builds one from its sharded model and calls ``start`` once and ``sync`` at
    every version, in lockstep; the ``leader`` rank (a global rank) passes its Sender,
    the others ``None``. Construct the Sender with ``trainable_keys=sharded.trainable_keys``
    (they are also what ``trainable_keys`` here selects). ``group`` is the process group
    of the mesh (default: the world).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        trainable_keys: Iterable[str] | None = None,
        group: dist.ProcessGroup | None = None,
        leader: int = 0,
    ) -> None:
        self.model, self.group, self.leader = model, group, leader
        self.is_leader = dist.get_rank() == leader
        state = resolve_state(model, trainable_keys)
        self.aliases = state.aliases
        self.trainable_keys = list(state.tracked)
        # Each tied alias right after its canonical key: a sender copying every key (its
        # hold before the first receiver) asks for the alias next, and gets the same copy.
        self._layout: list[str] = []
        for key in state.tensors:
            if key not in self.aliases:
                self._layout += [key, *(a for a, c in self.aliases.items() if c == key)]
        tensors = {k: state.tensors[k] for k in self._layout}
        self.order = gather_order(ModelState(tensors, [k for k in self._layout if k in set(state.tracked)], self.aliases))
        tracked = set(state.tracked)
        self._static_keys = [k for k in self._layout if k not in tracked and k not in self.aliases and is_dtensor(tensors[k])]
        self._static: dict[str, torch.Tensor] | None = None
        self._shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        self.stats = GatherStats()
        self._released = threading.Condition(threading.RLock())  # RLock: a finalizer may run under it
        self.version: int | None = None

    # -- every rank ---------------------------------------------------------------------
    async def start(self, sender: Sender | None, *, version: int | None = None) -> None:
        """Check the ranks agree, gather the untracked weights once, and start ``sender``."""
        if not self.is_leader:
            self._expect_sender(sender)
            await asyncio.to_thread(self.follow_start, version)
            return
        sender = self._expect_sender(sender)
        await asyncio.to_thread(self._agree, version)
        self._static = await asyncio.to_thread(self._gather_static, True)
        view = self._view()
        await self._lead(sender.start(view, version=version), view)
        self.version = version

    async def sync(self, sender: Sender | None, version: int) -> SyncStats | None:
        """``sender.sync`` on the leader (its stats), the matching gathers elsewhere (None)."""
        if not self.is_leader:
            self._expect_sender(sender)
            await asyncio.to_thread(self.follow, version)
            return None
        sender = self._expect_sender(sender)
        if self._static is None:
            raise WeightSyncError("ShardedSync.start() must come first")
        await asyncio.to_thread(self._agree, version)
        view = self._view()
        stats = await self._lead(sender.sync(view, version), view)
        self.version = version
        return stats

    # -- the other ranks, without an event loop -------------------------------------------
    def follow_start(self, version: int | None = None) -> None:
        """A non-leader rank's ``start``: the same checks and gathers, nothing kept."""
        self._agree(version)
        self._gather_static(False)
        self._follow()
        self._static = {}
        self.version = version

    def follow(self, version: int) -> None:
        """A non-leader rank's ``sync``: gather the leader's keys in order, dropping each."""
        if self._static is None:
            raise WeightSyncError("ShardedSync.follow_start() must come first")
        self._agree(version)
        self._follow()
        self.version = version

    # -- internals ----------------------------------------------------------------------
    def _expect_sender(self, sender: Sender | None) -> Sender:
        if self.is_leader and sender is None:
            raise ConfigError(f"rank {self.leader} leads the sharded sync: pass its Sender")
        if not self.is_leader and sender is not None:
            raise ConfigError(f"only rank {self.leader} holds the Sender; pass None on rank {dist.get_rank()}")
        return sender  # type: ignore[return-value]

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = self.model.state_dict()
        if tensors.keys() != self._shapes.keys():
            raise WeightSyncError("the sharded model's state-dict keys changed since ShardedSync was built")
        return tensors

    def _view(self) -> dict[str, torch.Tensor]:
        """What the leader's Sender reads: live DTensors for tracked keys, the copies
        gathered at start for the rest, aliases after their canonical key."""
        assert self._static is not None
        tensors = self._tensors()
        static = self._static
        return {k: static[self.aliases.get(k, k)] if self.aliases.get(k, k) in static else tensors[k] for k in self._layout}

    def _agree(self, version: int | None) -> None:
        """All ranks check (one small all-reduce) that they sync the same version with the
        same gather order, and all raise together when not: no rank is left waiting."""
        digest = xxhash.xxh3_64()
        for key in [*self.order, "|", *self._static_keys]:
            digest.update(f"{key}{self._shapes.get(key, '')};".encode())
        h = digest.intdigest() & (2**62 - 1)
        v = -1 if version is None else version
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else torch.device("cpu")
        both = torch.tensor([v, -v, h, -h], dtype=torch.int64, device=device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.group)
        top, low, htop, hlow = both.tolist()
        if htop != -hlow:
            raise GatherOrderError("the ranks' models differ (keys, shapes or trainable keys): their gathers would not match")
        if top != -low:
            raise GatherOrderError(f"the ranks sync different versions (from {-low} to {top}): call sync in lockstep")

    def _gather_static(self, keep: bool) -> dict[str, torch.Tensor]:
        tensors = self._tensors()
        kept = {}
        for key in self._static_keys:
            full = tensors[key].full_tensor().detach()  # type: ignore[attr-defined]
            if keep:
                kept[key] = full.clone() if full.data_ptr() == tensors[key].to_local().data_ptr() else full  # type: ignore[attr-defined]
            del full
        return kept

    def _gather(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """One collective, counted; the result is tracked until its storage is freed.

        The previous result is waited for first: dropped by the Sender, its buffer may
        still be held for a moment by the collective backend (gloo frees its work
        objects on its own thread), and two gathered tensors would then coexist.
        """
        with self._released:
            if not self._released.wait_for(lambda: self.stats.live == 0, timeout=RELEASE_WAIT):
                self.stats.overlaps += 1
                if self.stats.overlaps == 1:
                    log.warning("sharded sync: a gathered tensor is still alive when %r is gathered", key)
        full: torch.Tensor = t.full_tensor()  # type: ignore[attr-defined]
        self.stats.gathers += 1
        self.stats.last.append(key)
        if full.data_ptr() != t.to_local().data_ptr():  # type: ignore[attr-defined]  # a replicated one is not a copy
            nbytes = full.untyped_storage().nbytes()
            with self._released:
                s = self.stats
                s.live += 1
                s.live_bytes += nbytes
                s.peak_live, s.peak_bytes = max(s.peak_live, s.live), max(s.peak_bytes, s.live_bytes)
            weakref.finalize(full.untyped_storage(), self._freed, nbytes)
        return full

    def _freed(self, nbytes: int) -> None:
        with self._released:
            self.stats.live -= 1
            self.stats.live_bytes -= nbytes
            self._released.notify_all()

    def _follow(self) -> None:
        tensors = self._tensors()
        self.stats.last = []
        for key in self.order:
            full = self._gather(key, tensors[key])
            del full

    async def _lead(self, call: Awaitable[T], view: Mapping[str, torch.Tensor]) -> T:
        """Run a Sender call whose gathers follow ``self.order``; whatever it leaves
        ungathered (it failed, say) is gathered afterwards, so the other ranks finish."""
        self.stats.last = []
        hook = _Leader(self, view)
        try:
            with gathering(hook):
                return await call
        finally:
            await asyncio.to_thread(hook.finish)


class _Leader:
    """The leader's gather hook for one start/sync: serves the Sender's requests in
    ``order``, once each (a tied alias asked right after its key gets the same tensor)."""

    def __init__(self, owner: ShardedSync, view: Mapping[str, torch.Tensor]) -> None:
        self.owner, self.view = owner, view
        self.keys = {id(t): k for k, t in view.items() if is_dtensor(t)}
        self.position = {k: i for i, k in enumerate(owner.order)}
        self.aliased = set(owner.aliases.values())
        self.cursor = 0
        self.memo: tuple[str, torch.Tensor] | None = None
        self.active = True
        self.lock = threading.Lock()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        with self.lock:
            if not self.active:
                raise GatherOrderError("a DTensor was gathered outside ShardedSync.start/sync; the other ranks are not gathering")
            key = self.keys.get(id(t))
            if key is None:
                raise GatherOrderError("the Sender gathered a DTensor that is not in the view ShardedSync gave it")
            key = self.owner.aliases.get(key, key)
            if self.memo is not None and self.memo[0] == key:
                return self.memo[1]
            self.memo = None  # dropped before the next gather
            at = self.position.get(key)
            if at != self.cursor:
                expected = self.owner.order[self.cursor] if self.cursor < len(self.owner.order) else "nothing more"
                raise GatherOrderError(
                    f"the Sender gathered {key!r} where the other ranks gather {expected!r}: "
                    "construct it with trainable_keys=ShardedSync.trainable_keys"
                )
            self.cursor += 1
            full = self.owner._gather(key, t)
            if key in self.aliased:
                self.memo = (key, full)
            return full

    def finish(self) -> None:
        with self.lock:
            self.active, self.memo = False, None
            order = self.owner.order
            if self.cursor < len(order):
                log.warning("sharded sync: gathering %d keys the Sender did not ask for", len(order) - self.cursor)
            for key in order[self.cursor:]:
                full = self.owner._gather(key, self.view[key])
                del full
            self.cursor = len(order)
