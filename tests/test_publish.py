"""``Sender.publish``: versions built elsewhere (a sharded trainer's ranks), served by a Sender
started with ``sharded=True``, with no version at rest: a bootstrap deferred to the next version.

In one process and without torch.distributed: a plain model is a sharded one of one rank
(``ShardBuild`` compares every tensor, as rank 0 compares plain tensors), its part unpacked
into the messages the leader would publish. Real sockets and receivers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch

from examples.tiny_model import build, train_step
from protocol.config import PatchConfig
from protocol.errors import ConfigError, StaleVersionError, WeightSyncError
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message
from receiver import Receiver
from receiver.session import follower
from sender import Sender
from sender.plan import SyncPlan
from sender.sharded.shard_build import ReceiverPlan, ShardBuild
from sender.sharded.shard_parts import unpack_part

CONFIG = {"weight_syncer": {"type": "patch", "patch": {"part_bytes": 2048}}}


def bf16(model: torch.nn.Module) -> str:
    return state_digest({k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in model.state_dict().items()})


class Trainer:
    """A trainer whose versions are built as one rank of a sharded build and published."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.model = build(seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(0)
        self.build: ShardBuild | None = None

    def step(self) -> None:
        train_step(self.model, self.optimizer, self.generator)

    def bootstrap(self, version: int) -> Any:
        async def make(plan: SyncPlan) -> list[Message]:
            tensors = self.model.state_dict()
            keys = [k for k in plan.state.tensors if k in set(plan.tracked)]
            return list(plan.bootstrap(version, tensors.__getitem__, keys)[1])

        return make

    def capture(self) -> None:
        plan = self.sender.plan
        assert plan is not None
        tensors = self.model.state_dict()
        self.build = ShardBuild.of_order(tensors, plan.tracked, ReceiverPlan.of(plan, PatchConfig(part_bytes=2048)))
        self.build.capture(tensors)

    def parts(self, version: int) -> list[Message]:
        assert self.build is not None
        part = self.build.part(self.model.state_dict(), version)
        return unpack_part(part) if part else []  # no change: Sender.publish makes the one empty part


async def stream(messages: list[Message], fail_after: int | None = None) -> AsyncIterator[Message]:
    for i, m in enumerate(messages):
        if fail_after is not None and i == fail_after:
            raise WeightSyncError("injected: a rank's part was lost")
        await asyncio.sleep(0)
        yield m


async def _waiting(sender: Sender) -> None:
    while not sender.bootstrap_wanted:
        await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def at_v1() -> AsyncIterator[tuple[Sender, Trainer, Receiver, torch.nn.Module]]:
    """A sharded sender started at v0, a receiver joined (its bootstrap deferred to the next
    version) and bootstrapped at v1, published with no patch: the sender, trainer, receiver
    and the receiver's model."""
    async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
        trainer = Trainer(sender)
        await sender.start(trainer.model, version=0, sharded=True)
        rollout = build(seed=3).to(torch.bfloat16)
        async with Receiver(rollout, sender.endpoint, CONFIG) as receiver:
            joined = asyncio.ensure_future(receiver.start(timeout=30))
            await _waiting(sender)  # its HELLO is in, its bootstrap deferred
            await asyncio.sleep(0.2)
            assert not joined.done() and receiver.version is None
            trainer.step()
            trainer.capture()
            await sender.publish(1, None, bootstrap=trainer.bootstrap(1))
            await asyncio.wait_for(joined, 30)
            assert receiver.version == 1 and not sender.bootstrap_wanted
            yield sender, trainer, receiver, rollout


async def test_a_receiver_is_bootstrapped_at_the_next_version_then_patched() -> None:
    async with at_v1() as (sender, trainer, receiver, rollout):
        async with receiver.reading():
            assert state_digest(rollout.state_dict()) == bf16(trainer.model)
        for version in (2, 3):
            trainer.step()
            messages = trainer.parts(version)
            stats = await sender.publish(version, stream(messages))
            assert stats.messages == len(messages) and stats.wire_bytes > 0
            await receiver.wait_for_version(version, timeout=30)
            async with receiver.reading():
                assert state_digest(rollout.state_dict()) == bf16(trainer.model)
        assert len(messages) > 1  # part_bytes 2048: several parts
        # a version with no change: no part from the trainer, one empty part served
        stats = await sender.publish(4, stream(trainer.parts(4)))
        assert stats.messages == 1
        await receiver.wait_for_version(4, timeout=30)


async def test_a_failed_version_publishes_nothing_and_the_next_resyncs() -> None:
    async with at_v1() as (sender, trainer, receiver, rollout):
        at_v1_digest = bf16(trainer.model)
        # a part lost midway, then a bootstrap that fails after every part: neither moves the version
        trainer.step()
        messages = trainer.parts(2)
        with pytest.raises(WeightSyncError, match="injected"):
            await sender.publish(2, stream(messages, fail_after=len(messages) - 1))

        async def failing(plan: SyncPlan) -> list[Message]:
            raise WeightSyncError("injected: the bootstrap's gather failed")

        with pytest.raises(WeightSyncError, match="gather failed"):
            await sender.publish(2, stream(messages), bootstrap=failing)
        assert sender.version == 1
        await asyncio.sleep(0.3)  # nothing of v2 completes at the receiver
        assert receiver.version == 1
        async with receiver.reading():
            assert state_digest(rollout.state_dict()) == at_v1_digest
        # the next version has no patch (the snapshot moved): every receiver resynced by bootstrap
        trainer.step()
        trainer.build.recapture(trainer.model.state_dict())  # type: ignore[union-attr]
        await sender.publish(3, None, bootstrap=trainer.bootstrap(3))
        await receiver.wait_for_version(3, timeout=30)
        async with receiver.reading():
            assert state_digest(rollout.state_dict()) == bf16(trainer.model)
        assert sender.receivers[receiver.identity]["resyncs"] >= 1


async def test_publish_is_serialised_refuses_stale_versions_and_the_wrong_sender() -> None:
    async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
        trainer = Trainer(sender)
        await sender.start(trainer.model, version=0, sharded=True)
        with pytest.raises(ConfigError, match="sharded"):
            await sender.sync(trainer.model, 1)
        # two at once: serialised; the lower one, if second, is stale and changes nothing
        results = await asyncio.gather(sender.publish(2, None), sender.publish(1, None), return_exceptions=True)
        assert not isinstance(results[0], BaseException)
        assert isinstance(results[1], StaleVersionError) and sender.version == 2
        with pytest.raises(StaleVersionError):
            await sender.publish(2, None)
        with pytest.raises(WeightSyncError, match="no receiver"):  # a bootstrap needs the receivers' plan
            await sender.publish(3, None, bootstrap=trainer.bootstrap(3))
        assert sender.version == 2
    async with Sender("tcp://127.0.0.1:0", CONFIG) as plain:
        await plain.start(build(seed=0))
        with pytest.raises(ConfigError, match="sharded=True"):
            await plain.publish(1, None)


async def test_a_deferred_bootstrap_waited_for_past_the_handshake_bound_is_answered_once_per_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bootstrap deferred to the next version waits as long as the trainer takes to make
    it: the sender sets no bound of its own. The receiver's does (each handshake message
    within peer_timeout + HANDSHAKE_GRACE, the grace cut to 0 here): it reconnects, with
    its backoff, and says HELLO again, and the sender drops the answer it was waiting on.
    So however long the trainer takes, the sender waits on one HELLO per receiver, and
    the next version bootstraps it."""
    monkeypatch.setattr(follower, "HANDSHAKE_GRACE", 0.0)
    async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
        trainer = Trainer(sender)
        await sender.start(trainer.model, version=0, sharded=True)
        rollout = build(seed=3).to(torch.bfloat16)
        kw: dict[str, Any] = {"peer_timeout": 0.3, "heartbeat_interval": 0.05, "reconnect_backoff": (0.05, 0.1)}
        async with Receiver(rollout, sender.endpoint, CONFIG, identity="r", **kw) as receiver:
            joined = asyncio.ensure_future(receiver.start(timeout=30))
            answering: list[int] = []  # HELLOs the sender is answering, sampled
            async with asyncio.timeout(30):
                while receiver.reconnects < 3:
                    # (one the new HELLO cancelled may not have finished yet: it is on its way out)
                    answering.append(sum(1 for t in asyncio.all_tasks()
                                         if "-hello-" in t.get_name() and not t.done() and not t.cancelling()))
                    await asyncio.sleep(0.01)
            assert not joined.done() and receiver.version is None
            assert max(answering) == 1, answering  # one at a time: each new HELLO replaced the last
            trainer.step()
            trainer.capture()
            await sender.publish(1, None, bootstrap=trainer.bootstrap(1))
            await asyncio.wait_for(joined, 30)
            assert receiver.version == 1
            async with receiver.reading():
                assert state_digest(rollout.state_dict()) == bf16(trainer.model)
