"""FSDP2 (``fully_shard``) models as ``ShardedSync`` sees them (``FsdpLayout``): DTensors
placed ``Shard(0)`` or ``Replicate`` on a 1-D mesh, keyed and shaped as the model's own state
dict, so the receivers' names are the trainer's.

* The sharded build's keys: each rank's rows of each tracked DTensor (``shards.local_range``),
  a plain tensor (a buffer FSDP2 leaves whole) compared by rank 0.
* Gathers (``gathers.Gatherer``): gathering a DTensor is a collective, so every rank gathers the
  same tensors in the same order (``gather_order``: tracked keys without aliases, in state-dict
  order); on the leader each gather happens when its Sender asks for the tensor, and is dropped
  before the next. The gathering build gathers every version; the sharded one only for a
  bootstrap.
* Weights the Sender does not track (frozen) are gathered once, at ``start``, into plain tensors
  the leader keeps: a receiver joining at any time is bootstrapped from them without a
  collective.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

import torch
from torch import nn

from protocol.errors import WeightSyncError
from protocol.state import ModelState, is_dtensor, resolve_state, sync_keys
from protocol.wire.framing import Message

from ..plan import SyncPlan
from .gathers import Gatherer, gather_order
from .shard_build import ReceiverPlan, ShardBuild
from .shards import local_range

T = TypeVar("T")


class FsdpLayout:
    """An FSDP2 model's layout for ``ShardedSync`` (its ``ShardLayout``): every rank builds one
    from its own sharded ``model``; ``trainable_keys`` as the leader's Sender's."""

    gathers = True  # the gathering build is possible

    def __init__(self, model: nn.Module, trainable_keys: Iterable[str] | None = None, *, sharded: bool = True) -> None:
        self.model = model
        state = resolve_state(model, trainable_keys)
        self.aliases = state.aliases
        self.trainable_keys = list(state.tracked)
        # Each tied alias right after its canonical key: a sender copying every key (its
        # hold before the first receiver) asks for the alias next, and gets the same copy.
        self.keys: list[str] = []
        for key in state.tensors:
            if key not in self.aliases:
                self.keys += [key, *(a for a, c in self.aliases.items() if c == key)]
        tensors = {k: state.tensors[k] for k in self.keys}
        tracked_state = ModelState(tensors, [k for k in self.keys if k in set(state.tracked)], self.aliases)
        self.order = gather_order(tracked_state)
        self.compared = sync_keys(tracked_state)  # what the sharded build compares: DTensors and plain tensors (buffers)
        tracked = set(state.tracked)
        self.static_keys = [k for k in self.keys if k not in tracked and k not in self.aliases and is_dtensor(tensors[k])]
        self.static: dict[str, torch.Tensor] | None = None
        self.shapes = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items()}
        self.gatherer = Gatherer(self.order, self.aliases)
        self.stats = self.gatherer.stats
        if sharded:
            for key in self.compared:  # a placement the sharded build cannot compare: say so now
                local_range(tensors[key], key)

    def agreement(self) -> list[str]:
        """What every rank must have alike (digested by ``ShardedSync``'s agreement)."""
        return [f"{k}{self.shapes.get(k, '')}" for k in [*self.order, "|", *self.static_keys]]

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors = self.model.state_dict()
        if tensors.keys() != self.shapes.keys():
            raise WeightSyncError("the sharded model's state-dict keys changed since ShardedSync was built")
        return tensors

    def view(self) -> dict[str, torch.Tensor]:
        """What the leader's Sender reads: live DTensors for tracked keys, the copies gathered at
        ``start`` for the rest, aliases after their canonical key."""
        if self.static is None:
            raise WeightSyncError("ShardedSync.start() must come first")
        tensors, static = self.tensors(), self.static
        return {k: static[self.aliases.get(k, k)] if self.aliases.get(k, k) in static else tensors[k] for k in self.keys}

    def start(self, keep: bool) -> None:
        """Gather the untracked weights once (a collective): the leader (``keep``) keeps them."""
        tensors = self.tensors()
        kept = {}
        for key in self.static_keys:
            full = tensors[key].full_tensor().detach()  # type: ignore[attr-defined]
            if keep:
                kept[key] = full.clone() if full.data_ptr() == tensors[key].to_local().data_ptr() else full  # type: ignore[attr-defined]
            del full
        self.static = kept

    def build(self, plan: ReceiverPlan) -> ShardBuild:
        """This rank's compare of its shards for the receivers' ``plan``."""
        return ShardBuild.of_order(self.tensors(), self.compared, plan)

    async def lead(self, call: Callable[[dict[str, torch.Tensor]], Awaitable[T]]) -> T:
        """The leader's Sender ``call`` of a ``view`` (the one its gathers are served from, in order)."""
        view = self.view()
        return await self.gatherer.lead(call(view), view)

    def follow(self) -> None:
        """The other ranks' side of ``lead``: the same gathers, in order, each dropped."""
        self.gatherer.follow(self.tensors())

    async def bootstrap(self, plan: SyncPlan, version: int, keys: Sequence[str]) -> list[Message]:
        """The leader's bootstrap of ``keys`` at ``version``, gathered tensor by tensor with the
        other ranks (which ``follow``)."""
        view = self.view()
        _, messages = plan.bootstrap(version, view.__getitem__, list(keys))
        return await self.gatherer.lead(asyncio.to_thread(list, messages), view)
