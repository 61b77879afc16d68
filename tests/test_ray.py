"""weightsync under Ray (examples/ray_actors.py): a trainer actor and rollout actors on a
local CPU cluster, finding each other through Ray, with the daemons unchanged.

One ``ray.init`` for the module (it takes seconds); every wait has a timeout so a broken
cluster fails the test instead of hanging it.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.ray_actors import TRAINER, RolloutActor, TrainerActor, curve_keys, init_local  # noqa: E402

WAIT = 60  # seconds for any one remote call


@pytest.fixture(scope="module")
def cluster() -> Iterator[float]:
    if ray.is_initialized():  # pragma: no cover - another module left one running
        ray.shutdown()
    seconds = init_local(num_cpus=4, object_store_memory=100 * 1024 * 1024)
    yield seconds
    ray.shutdown()


def get(refs: Any) -> Any:
    return ray.get(refs, timeout=WAIT)


def kill_and_release(actor: Any, name: str) -> None:
    """Kill a named actor and wait until Ray has let go of its name: ``ray.kill`` returns
    before the GCS marks the actor dead, and a new actor under the same name in that window
    raises ActorAlreadyExistsError (seen in CI)."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + WAIT
    while True:
        try:
            ray.get_actor(name)
        except ValueError:  # no live actor holds the name any more
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"Ray still holds the actor name {name!r} {WAIT} s after ray.kill")
        time.sleep(0.05)


def test_actors_sync_every_version_and_a_replacement_bootstraps(cluster: float) -> None:
    name = f"{TRAINER}-plain"
    # a short peer timeout: the killed rollout is forgotten quickly, so wait_acked sees only live ones
    trainer = TrainerActor.options(name=name).remote(peer_timeout=2.0, heartbeat_interval=0.2)
    rollouts = [RolloutActor.remote(f"rollout-{i}", trainer=name) for i in range(2)]
    actors = [trainer, *rollouts]
    try:
        starting = [r.start.remote(WAIT) for r in rollouts]  # before the trainer binds: they wait for it
        endpoint = get(trainer.start.remote())
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":0")
        digest = get(trainer.digest.remote())
        for status in get(starting):  # each found the trainer through Ray and was bootstrapped
            assert (status["endpoint"], status["version"], status["digest"]) == (endpoint, 0, digest)

        digests = {0: digest}
        for _ in range(3):
            synced = get(trainer.step.remote())
            digests[synced["version"]] = synced["digest"]
            for status in get([r.wait_for_version.remote(synced["version"]) for r in rollouts]):
                assert (status["version"], status["digest"]) == (synced["version"], synced["digest"]), status["identity"]
        assert len(set(digests.values())) == 4  # every step really changed the bf16 weights

        ray.kill(rollouts[1], no_restart=True)  # no goodbye: the sender must carry on without it
        for _ in range(2):
            synced = get(trainer.step.remote())
            status = get(rollouts[0].wait_for_version.remote(synced["version"]))
            assert (status["version"], status["digest"]) == (synced["version"], synced["digest"])
        current = synced

        replacement = RolloutActor.remote("rollout-1", trainer=name)  # a restarted worker, same identity
        actors.append(replacement)
        status = get(replacement.start.remote(WAIT))
        assert (status["version"], status["digest"]) == (current["version"], current["digest"])

        rollouts = [rollouts[0], replacement]
        synced = get(trainer.step.remote())
        for status in get([r.wait_for_version.remote(synced["version"]) for r in rollouts]):
            assert (status["version"], status["digest"]) == (synced["version"], synced["digest"])
        receivers = get(trainer.wait_acked.remote(synced["version"], WAIT))
        assert sorted(receivers) == ["rollout-0", "rollout-1"]
        sample = get(replacement.generate.remote([1, 2, 3, 4]))
        assert sample["version"] == synced["version"] and len(sample["tokens"]) == 8
        get([a.close.remote() for a in (trainer, *rollouts)])
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def test_curve_keys_travel_as_actor_arguments(cluster: float) -> None:
    """The multi-node recipe on loopback: CURVE keys handed to the actors through Ray; a
    rollout whose key the trainer does not allow never gets a version."""
    name = f"{TRAINER}-curve"
    server, (client, intruder_key) = curve_keys(2)
    server = type(server)(server.keys, frozenset({client.keys.public}))  # admit only the first
    trainer = TrainerActor.options(name=name).remote(curve=server)
    rollout = RolloutActor.remote("rollout-curve", trainer=name, curve=client)
    intruder = RolloutActor.remote("intruder", trainer=name, curve=intruder_key)
    actors = [trainer, rollout, intruder]
    try:
        get(trainer.start.remote())
        refused = intruder.start.remote(3.0)
        assert get(rollout.start.remote(WAIT))["digest"] == get(trainer.digest.remote())
        synced = get(trainer.step.remote())
        status = get(rollout.wait_for_version.remote(synced["version"]))
        assert (status["version"], status["digest"]) == (synced["version"], synced["digest"])
        with pytest.raises(asyncio.TimeoutError):  # Ray re-raises the actor's error as its own type too
            get(refused)
        assert sorted(get(trainer.receivers.remote())) == ["rollout-curve"]
        assert get(trainer.refused_keys.remote()) == [intruder_key.keys.public.decode()]
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)


def test_rollouts_find_a_restarted_trainer_through_ray(cluster: float) -> None:
    """The trainer actor dies and a new one takes its name (on another port): the rollouts'
    receivers ask Ray for the trainer's address before every session, so they reconnect to
    the new one by themselves and follow it bit for bit."""
    name = f"{TRAINER}-restart"
    timing = {"peer_timeout": 2.0, "heartbeat_interval": 0.2}
    trainer = TrainerActor.options(name=name).remote(**timing)
    rollouts = [RolloutActor.remote(f"rollout-{i}", trainer=name, **timing) for i in range(2)]
    actors = [trainer, *rollouts]
    try:
        first = get(trainer.start.remote())
        get([r.start.remote(WAIT) for r in rollouts])
        synced = get(trainer.step.remote())
        get([r.wait_for_version.remote(synced["version"]) for r in rollouts])

        kill_and_release(trainer, name)
        trainer = TrainerActor.options(name=name).remote(**timing)
        actors.append(trainer)
        second = get(trainer.start.remote())
        assert second != first
        for _ in range(3):
            synced = get(trainer.step.remote())
        for status in get([r.wait_for_version.remote(synced["version"]) for r in rollouts]):
            assert (status["endpoint"], status["version"], status["digest"]) == (second, synced["version"], synced["digest"])
        get([a.close.remote() for a in (trainer, *rollouts)])
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
