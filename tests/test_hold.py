"""Receiver(hold=True): versions stage in the background and are written only inside
update_weights (what the vLLM backend runs on), and the pre-HELLO metadata query."""

from __future__ import annotations

import asyncio

import pytest
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, assert_matches, receiver_model, wait_until

from protocol.errors import ConfigError, StateError
from receiver import Receiver
from receiver.describe import ask_metadata
from sender import Sender


async def test_held_receiver_stages_versions_and_commits_only_in_update_weights() -> None:
    trainer = Trainer(seed=0)
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=0)
        async with Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], hold=True, **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)  # the first bootstrap commits: the model held no version
            await assert_matches(receiver, trainer, 0)
            assert receiver.is_paused and receiver.connected

            v1 = await trainer.step_and_sync(sender)
            v2 = await trainer.step_and_sync(sender)
            await wait_until(lambda: receiver.pending_version == v1)  # staged while "generating"
            assert await receiver.sender_version(T) == v2
            await asyncio.sleep(0.3)
            await assert_matches(receiver, trainer, 0)  # nothing written outside update_weights

            # Two calls at once: the control lock runs them one after the other.
            first, second = await asyncio.gather(receiver.update_weights(v1, timeout=T), receiver.update_weights(v2, timeout=T))
            assert (first, second) == (v1, v2)
            await assert_matches(receiver, trainer, v2)
            with pytest.raises(StateError, match="cannot resume"):
                await receiver.resume()


async def test_a_held_receivers_resync_waits_for_update_weights() -> None:
    """A restarted sender resyncs the receiver with a bootstrap: held, it waits staged."""
    trainer = Trainer(seed=0)
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await sender.__aenter__()
    await sender.start(trainer.model, version=0)
    endpoint = sender.endpoint
    receiver = Receiver(receiver_model(), endpoint, CONFIGS["patch"], hold=True, **DAEMON_KW)
    try:
        await receiver.start(timeout=T)
        await sender.close()
        for _ in range(3):
            trainer.step()
        v3 = trainer.version
        sender = Sender(endpoint, CONFIGS["patch"], **DAEMON_KW)
        await sender.__aenter__()
        await sender.start(trainer.model, version=v3)  # a new session: the receiver must resync
        await wait_until(lambda: receiver.pending_version == v3)
        await asyncio.sleep(0.3)
        await assert_matches(receiver, trainer, 0)
        assert await receiver.update_weights(v3, timeout=T) == v3
        await assert_matches(receiver, trainer, v3)
    finally:
        await receiver.close()
        await sender.close()


async def test_ask_metadata_before_hello() -> None:
    trainer = Trainer(seed=0)
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=0)
        meta = await ask_metadata(["tcp://127.0.0.1:1", sender.endpoint], timeout=5)  # a dead upstream first
        state = trainer.model.state_dict()
        assert list(meta.keys) == list(state)
        assert [tuple(s) for s in meta.shapes] == [tuple(t.shape) for t in state.values()]
        assert sender.receivers == {}  # asking is not joining


def test_a_held_receiver_cannot_relay() -> None:
    with pytest.raises(ConfigError, match="cannot relay"):
        Receiver(receiver_model(), "tcp://127.0.0.1:1", CONFIGS["patch"], hold=True, relay_endpoint="tcp://127.0.0.1:0")
