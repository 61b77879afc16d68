"""The trainer's model as a ``VersionSource``: what the sender daemon's server serves.

It holds the version at rest, the one every receiver is bootstrapped with or diffed
against: before the first receiver a copy of the tracked tensors (``hold``), after it
the builder's snapshot or retained copy. The first receiver's HELLO fixes the plan (its
dtypes) and the builder; every later receiver must declare the same metadata.
"""

from __future__ import annotations

import asyncio

import torch

from protocol.config import SyncConfig
from protocol.errors import ConfigError
from protocol.state import ModelState, StateLike, materialize, state_tensors, sync_keys
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message
from protocol.wire.messages import Hello, Welcome
from protocol.wire.metadata import ModelMetadata

from ..base import check_same, plan_for
from ..plan import Source, SyncPlan
from ..streams import Mark
from ..version.builder import VersionBuilder
from ..version.builders import make_builder


class TrainerSource:
    """``state`` (the model given to ``Sender.start``) under ``config``; ``model`` is the
    one last synced, whose frozen tensors the bootstraps read."""

    def __init__(self, state: ModelState, model: StateLike, config: SyncConfig) -> None:
        self.state, self.model, self.config = state, model, config
        self.plan: SyncPlan | None = None
        self.builder: VersionBuilder | None = None
        self._held: dict[str, torch.Tensor] | None = None  # the current version, before any receiver
        self._held_after: Mark | None = None  # the work that copied it (on the caller's streams)
        self._untracked: tuple[tuple[int, str], ...] | None = None  # WELCOME's digests of what is never sent
        self.hold(state.tensors)

    def hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of the current version until the first receiver says which dtypes
        it wants: the weights may move on before it joins, and it must get this version."""
        # Only what the first receiver's snapshot (or retained copy) takes: each tracked storage
        # once. Frozen keys come from the model, as in every bootstrap.
        keys, held = sync_keys(self.state), self._held
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ConfigError(f"this model has no {missing[0]!r}, which the model given to start() has")
        if held is None:
            held = self._held = {k: materialize(tensors[k]).detach().clone() for k in keys}
        else:
            for key in keys:
                held[key].copy_(materialize(tensors[key]).detach())
        self._held_after = Mark.now(held.values())  # the builder takes it over on another thread

    def at_rest(self) -> Source:
        """Tensors of the current version at rest: the snapshot or retained copy for
        tracked keys, the model for frozen ones (which training does not change)."""
        assert self.builder is not None and self.plan is not None
        model, plan = state_tensors(self.model), self.plan
        held = self.builder.held()
        if plan.view is None:
            return lambda key: held[key] if key in held else model[key]
        frozen: dict[str, torch.Tensor] = {}  # quantized frozen weights, once per call

        def get(key: str) -> torch.Tensor:
            if key in held:
                return held[key]
            if key not in frozen:
                frozen.update(plan.rollout(model, [key]))
            return frozen[key]

        return get

    @property
    def backlog_bytes(self) -> int:
        """Bytes read and waiting for the builder's encoder (0 before the first receiver)."""
        return 0 if self.builder is None else self.builder.backlog_bytes

    async def close(self) -> None:
        """Stop the builder's threads, once a read under way has ended."""
        if self.builder is not None:
            await self.builder.close()

    # -- VersionSource ----------------------------------------------------------------
    async def admit(self, hello: Hello) -> Welcome:
        """The first receiver fixes the plan; later ones must match it exactly."""
        if self.plan is None:
            plan = plan_for(self.state, hello, self.config)
            assert self._held is not None
            held, after = await plan.rolled(self._held, self._held_after)  # as the receivers hold it (fp8: quantized)
            builder = make_builder(plan, self.config)
            await builder.hold(held, after)
            self.plan, self.builder = plan, builder
            self._held = None  # the snapshot (or retained copy) holds the version from now on
        else:
            check_same(self.plan, hello, self.config)
        if self._untracked is None:  # what is never sent does not change: hashed once
            self._untracked = await asyncio.to_thread(self.plan.untracked_digests, self.at_rest())
        return self.plan.welcome(self.config.type, untracked=self._untracked)

    async def bootstrap(self, version: int | None) -> list[Message]:
        """The init-sync keys, plus every tracked key once the trainer has moved past its
        initial weights."""
        plan, builder = self.plan, self.builder
        assert plan is not None and builder is not None
        await builder.settled()
        keys = plan.bootstrap_keys() if plan.init_sync.enabled else []
        if version is not None:
            keys = [k for k in plan.state.tensors if k in set(keys) | set(plan.tracked)]
        _, messages = plan.bootstrap(version, self.at_rest(), keys)
        return await asyncio.to_thread(list, messages)

    async def digest(self, version: int | None) -> str:
        plan, builder = self.plan, self.builder
        assert plan is not None and builder is not None
        await builder.settled()
        source, aliases = self.at_rest(), plan.state.aliases

        def compute() -> str:
            view = {k: source(aliases.get(k, k)).to(plan.receiver_dtype(k)) for k in plan.metadata.keys}
            return state_digest(view, list(plan.metadata.keys))

        return await asyncio.to_thread(compute)

    def describe(self) -> ModelMetadata | None:
        return ModelMetadata.of(self.state.tensors) if self.plan is None else self.plan.metadata
