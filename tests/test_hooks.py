"""A receiver strategy's hooks are given once, at construction, as one frozen record.

Nothing assigns a hook afterwards: the strategy refuses it, and so does the record. A
``Receiver`` composes its own hooks (its model lock, the hold, its relay's) with a
caller's, so a relay's ``on_commit`` and an engine's run side by side, the engine's first.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import pytest
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, assert_matches, receiver_model

from protocol.errors import ConfigError
from receiver import PendingVersion, Receiver, StrategyHooks, make_receiver
from sender import Sender

HOOK_NAMES = ["write_guard", "commit_gate", "on_staged", "on_commit", "keep_messages", "hooks", "_hooks"]


@pytest.mark.parametrize("name", HOOK_NAMES)
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_a_strategy_refuses_a_hook_assigned_after_construction(mode: str, name: str) -> None:
    def on_commit(pending: PendingVersion) -> None:
        pass

    strategy = make_receiver(CONFIGS[mode], StrategyHooks(on_commit=[on_commit]))
    with pytest.raises(AttributeError, match="at construction"):
        setattr(strategy, name, None)
    assert strategy.hooks.on_commit == (on_commit,)  # a list given is kept as a tuple
    strategy.version = 3  # what is not a hook is the strategy's to set
    assert strategy.version == 3


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(StrategyHooks)])
def test_the_hooks_record_is_frozen(name: str) -> None:
    hooks = StrategyHooks()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(hooks, name, None)
    with pytest.raises((AttributeError, TypeError)):  # slots: no new attribute either
        hooks.extra = 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("given", ["write_guard", "commit_gate"])
def test_a_receiver_keeps_its_write_guard_and_commit_gate(given: str) -> None:
    """``wrap_write`` wraps a receiver's writes and ``hold`` gates its commits: a caller's
    record cannot replace either."""

    async def gate(pending: PendingVersion) -> None:
        pass

    hooks = StrategyHooks(write_guard=contextlib.nullcontext if given == "commit_gate" else lambda: contextlib.nullcontext(),
                          commit_gate=gate if given == "commit_gate" else None)
    with pytest.raises(ConfigError, match="receiver's own"):
        Receiver(receiver_model(), "tcp://127.0.0.1:1", CONFIGS["patch"], hooks=hooks)


@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_a_relay_and_a_callers_on_commit_both_run_in_order(mode: str) -> None:
    """A relay whose caller hands it an ``on_commit`` (an engine installing layers): each
    version calls the caller's hook first, inside the write, and the relay's after it, so
    the relay serves a version only once the caller's hook is through; a leaf below the
    relay gets every version."""
    trainer = Trainer()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS[mode], **DAEMON_KW)
    receivers: list[Receiver] = []
    seen: list[tuple[int | None, int | None]] = []  # (version committed, the relay's served version then)
    relay: Receiver | None = None

    def engine_hook(pending: PendingVersion) -> None:
        assert relay is not None and relay.relay is not None
        assert relay.lock.acquire_read(blocking=False) is False  # inside the write
        seen.append((pending.version, relay.relay.server.version))

    try:
        await asyncio.wait_for(sender.start(trainer.model, version=trainer.version), T)
        relay = Receiver(receiver_model(), sender.endpoint, CONFIGS[mode], identity="relay", relay_endpoint="tcp://127.0.0.1:0",
                         hooks=StrategyHooks(on_commit=(engine_hook,)), **DAEMON_KW)
        receivers.append(relay)
        assert relay.relay is not None and relay.strategy.hooks.on_commit[0] is engine_hook
        assert len(relay.strategy.hooks.on_commit) == 2  # the relay's, after the caller's
        await relay.start(timeout=T)
        relay_endpoint = relay.relay_endpoint
        assert relay_endpoint is not None
        leaf = Receiver(receiver_model(2), relay_endpoint, CONFIGS[mode], identity="leaf", **DAEMON_KW)
        receivers.append(leaf)
        await leaf.start(timeout=T)
        for _ in range(3):
            version = await trainer.step_and_sync(sender)
            for r in (relay, leaf):
                await r.wait_for_version(version, timeout=T)
                await assert_matches(r, trainer, version)
        # the bootstrap, then v1..v3: each seen by the caller's hook before the relay served it
        assert seen == [(0, None), (1, 0), (2, 1), (3, 2)], seen
        assert relay.relay.server.version == 3
    finally:
        for r in reversed(receivers):
            await asyncio.wait_for(r.close(), T)
        await asyncio.wait_for(sender.close(), T)
