"""One rank's gathers of a sharded (FSDP2) model's DTensors: one order on every rank, one at a
time, counted (``sender.sharded.sync``'s gathering build of an FSDP2 model, and the bootstraps of its sharded build).

Gathering a DTensor is a collective, so every rank must gather the same tensors in the same
order (``gather_order``). On the leader the gathers happen when the Sender asks for each
tensor (``materialize`` under a ``gathering`` hook, ``Gatherer.lead``), each dropped before
the next; every other rank gathers the same keys in the same order and drops each at once
(``Gatherer.follow``). A request out of order is a ``GatherOrderError``, never a mismatched
collective. ``GatherStats`` counts what was gathered and how much of it was alive at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from protocol.errors import GatherOrderError
from protocol.state import ModelState, gathering, is_dtensor, sync_keys

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


class Gatherer:
    """A rank's gathers of the ``order`` keys (``aliases``: each tied alias's canonical key)."""

    def __init__(self, order: list[str], aliases: Mapping[str, str]) -> None:
        self.order, self.aliases = order, dict(aliases)
        self.stats = GatherStats()
        self._released = threading.Condition(threading.RLock())  # RLock: a finalizer may run under it

    def gather(self, key: str, t: torch.Tensor) -> torch.Tensor:
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

    def follow(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Gather the ``order`` keys of ``tensors`` in order, each dropped at once (a non-leader)."""
        self.stats.last = []
        for key in self.order:
            full = self.gather(key, tensors[key])
            del full

    async def lead(self, call: Awaitable[T], view: Mapping[str, torch.Tensor]) -> T:
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

    def __init__(self, owner: Gatherer, view: Mapping[str, torch.Tensor]) -> None:
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
            full = self.owner.gather(key, t)
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
                full = self.owner.gather(key, self.view[key])
                del full
            self.cursor = len(order)
