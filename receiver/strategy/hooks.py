"""What a receiver strategy calls around each version (``StrategyHooks``), given once when
it is built."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, fields
from typing import Any

from protocol.wire.framing import Message

from .pending import PendingVersion

WriteGuard = Callable[[], AbstractAsyncContextManager[Any]]
OnCommit = Callable[[PendingVersion], None]
OnPart = Callable[[PendingVersion, Message], None]
VersionGate = Callable[[PendingVersion], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StrategyHooks:
    """What a strategy calls around each version, given once when it is built.

    Frozen, and refused by the strategy after construction: who writes, who waits and who
    is told are fixed for its life, so two owners (a relay, an engine) cannot overwrite
    each other's hook. ``Receiver`` composes its own (the model lock, the hold, its
    relay's) with a caller's (``Receiver(hooks=)``)."""

    # Held while a version is written; the daemon makes it its model lock's write side.
    write_guard: WriteGuard = contextlib.nullcontext
    # Awaited before a handshake's bootstrap is written: a daemon that commits only when
    # asked (Receiver(hold=True)) holds a resync there until then.
    commit_gate: VersionGate | None = None
    # Awaited once a version is staged, before it can be committed: an engine prepares
    # what it can off the hold (receiver/vllm re-packs layers ahead). Its error fails the receive.
    on_staged: VersionGate | None = None
    # Called in order inside the write, once the whole version is in the model (an engine
    # installs layers, a relay serves it onwards); one that raises leaves the model torn.
    on_commit: Sequence[OnCommit] = ()
    # Keep each version's messages as received (``PendingVersion.messages``): a relay forwards them.
    keep_messages: bool = False
    # Called with each message of a version once it has passed its checks (decoded and
    # staged), before the version is whole: a relay forwards a patch's parts on at once.
    on_part: OnPart | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_commit", tuple(self.on_commit))  # a list given stays unshared and fixed


# The attributes a strategy refuses to have set after construction (``ReceiverBase.__setattr__``).
HOOK_NAMES = frozenset({"hooks", "_hooks", *(f.name for f in fields(StrategyHooks))})
