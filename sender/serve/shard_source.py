"""A sharded trainer's leader as a ``VersionSource``: the receivers' plan, but no version at rest.

Under the sharded build (``ShardedSync``) no rank holds the whole model: each holds
its shards and its shards' snapshot. A bootstrap (a receiver joining, or resynced) needs the
whole model, which only a gather made by every rank in lockstep can give, so it is built at
the next version: the server asks for it (``bootstrap`` says None and notes it is wanted),
the next ``ShardedSync.sync`` sees ``wanted``, every rank gathers the tracked tensors one by
one, and the leader ``offer``s the buckets of that version before it publishes it; the
server, waiting for the version to move, then serves them. So a receiver joining between
versions is bootstrapped at the next one.

The first receiver's HELLO fixes the plan (its dtypes), as ``TrainerSource`` does; later
receivers must match it. The ranks learn it at the next version (``ShardedSync``).
"""

from __future__ import annotations

from protocol.config import SyncConfig
from protocol.errors import ConfigError
from protocol.state import ModelState
from protocol.wire.framing import Message
from protocol.wire.messages import Hello, Welcome
from protocol.wire.metadata import ModelMetadata

from ..base import check_same, plan_for
from ..plan import SyncPlan


class ShardedSource:
    """The leader's ``VersionSource`` for ``state`` (its view of the sharded model) under ``config``."""

    def __init__(self, state: ModelState, config: SyncConfig) -> None:
        self.state, self.config = state, config
        self.plan: SyncPlan | None = None
        self.wanted = False  # a bootstrap was asked for since the last one offered
        self._offered: tuple[int | None, list[Message]] | None = None

    def offer(self, version: int | None, messages: list[Message]) -> None:
        """The bootstrap of ``version``, gathered by every rank: served until the version moves
        (the server keeps its own copy while receivers need it; this one is dropped once taken)."""
        self._offered = (version, messages)
        self.wanted = False

    def drop_offer(self) -> None:
        """Forget an offered bootstrap (the version moved on without it being asked for)."""
        self._offered = None

    # -- VersionSource ----------------------------------------------------------------
    async def admit(self, hello: Hello) -> Welcome:
        """The first receiver fixes the plan; later ones must match it exactly."""
        if self.plan is None:
            plan = plan_for(self.state, hello, self.config)
            if plan.view is not None:
                raise ConfigError(
                    "this receiver holds weights in block fp8; a sharded trainer's versions are not quantized yet: "
                    "serve fp8 rollouts from an unsharded Sender.sync, or hold the weights in bf16"
                )
            self.plan = plan
        else:
            check_same(self.plan, hello, self.config)
        return self.plan.welcome(self.config.type)

    async def bootstrap(self, version: int | None) -> list[Message] | None:
        """The offered bootstrap of ``version``; None (wanted: gathered at the next version) otherwise."""
        offered = self._offered
        if offered is not None and offered[0] == version:
            self._offered = None  # the server caches it while receivers need it
            return offered[1]
        self.wanted = True
        return None

    async def digest(self, version: int | None) -> str | None:
        """Not known: no rank holds the version whole (a receiver claiming it is resynced)."""
        return None

    def describe(self) -> ModelMetadata | None:
        return ModelMetadata.of(self.state.tensors) if self.plan is None else self.plan.metadata
