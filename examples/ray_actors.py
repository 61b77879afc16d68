"""weightsync under Ray: a trainer actor running the ``Sender`` and rollout actors running
``Receiver``s, which find the trainer through Ray instead of a configured address.

The daemons are the in-process ones, unchanged: each actor is an async Ray actor, so
its ``async def`` methods and the daemon's background tasks share the actor's event loop.
The trainer binds ``tcp://<host>:0`` and hands out the port it got; a rollout's receiver
is given a resolver that looks the trainer up by name (``ray.get_actor(TRAINER,
namespace=NAMESPACE)``) and asks it for the endpoint, before every session: nothing about
addresses or ports is configured per worker, and a restarted trainer actor is found again.

Loopback (the default ``host``) is right for a one-node cluster. Across nodes, pass
``host=None`` (the node's IP, ``ray.util.get_node_ip_address()``) with CURVE keys: a
``protocol.net.security.CurveServer`` to the trainer and a ``CurveClient`` to each rollout,
as actor arguments (``--curve`` below does this on loopback).

    python examples/ray_actors.py --steps 5 --rollouts 2    # JSON lines, a local Ray cluster
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

import ray
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.tiny_model import build, generate, train_step  # noqa: E402
from protocol.host.cli import report  # noqa: E402
from protocol.wire.checksum import state_digest  # noqa: E402
from protocol.wire.dtypes import parse_float_dtype  # noqa: E402
from receiver import Receiver  # noqa: E402
from sender import Sender  # noqa: E402

NAMESPACE = "weightsync"
TRAINER = "weightsync-trainer"  # the trainer actor's name in NAMESPACE


def digest_at(model: torch.nn.Module, dtype: str) -> str:
    """The state digest a rollout holding ``dtype`` floats must have (equal means bit-identical)."""
    cast = parse_float_dtype(dtype)
    return state_digest({k: v.to(cast) if v.is_floating_point() else v for k, v in model.state_dict().items()})


def node_host(host: str | None) -> str:
    """``None`` means this node's address as Ray knows it: reachable from the other nodes."""
    return ray.util.get_node_ip_address() if host is None else host


@ray.remote
class TrainerActor:
    """A trainer that owns its model and optimizer and serves every version to the rollouts.

    ``start`` binds the sender; ``endpoint`` is what rollouts call to find it (it waits for
    ``start``, so the two may race). ``step`` trains once and syncs, returning as soon as the
    changes are collected; encoding and sending go on in the actor's background tasks.
    """

    def __init__(
        self,
        *,
        config: Any = None,
        host: str | None = "127.0.0.1",
        lr: float = 2e-5,
        seed: int = 0,
        **sender_options: Any,
    ) -> None:
        self.model = build(seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.version = 0
        self.sender = Sender(f"tcp://{node_host(host)}:0", config, **sender_options)
        self._started = asyncio.Event()

    async def start(self) -> str:
        await self.sender.start(self.model, version=self.version)
        self._started.set()
        return self.sender.endpoint

    async def endpoint(self, timeout: float = 60.0) -> str:
        """The bound address (real port): the rollouts' discovery call."""
        await asyncio.wait_for(self._started.wait(), timeout)
        return self.sender.endpoint

    async def step(self, *, flush: bool = False, dtype: str | None = "bfloat16") -> dict[str, Any]:
        """One AdamW step, then ``sync``. ``flush`` waits for the encoding (to report wire
        bytes); ``dtype`` adds the digest a rollout of that dtype must reach."""
        # in a thread: heartbeats and bootstraps keep being served during a long step
        loss = await asyncio.to_thread(train_step, self.model, self.optimizer, self.generator)
        self.version += 1
        stats = await self.sender.sync(self.model, self.version)
        if flush:
            await self.sender.flush()
        out = {"version": self.version, "loss": loss, **stats.as_dict()}
        if dtype is not None:
            out["digest"] = await self.digest(dtype)
        return out

    async def digest(self, dtype: str = "bfloat16") -> str:
        return await asyncio.to_thread(digest_at, self.model, dtype)

    async def wait_acked(self, version: int, timeout: float = 60.0) -> dict[str, Any]:
        """Wait until every connected rollout applied ``version``; returns who is connected."""
        await self.sender.wait_acked(version, timeout)
        return self.sender.receivers

    async def receivers(self) -> dict[str, Any]:
        return self.sender.receivers

    async def refused_keys(self) -> list[str]:
        """CURVE public keys the sender refused: a rollout missing from the allowlist shows up here."""
        return sorted(k.decode() if isinstance(k, bytes) else k for k in self.sender.rejected_keys)

    async def close(self) -> None:
        await self.sender.close()


@ray.remote
class RolloutActor:
    """A rollout worker whose model follows the trainer named ``trainer`` in ``namespace``.

    ``start`` discovers the trainer through Ray and returns once the receiver has
    bootstrapped to the trainer's current version. ``generate`` runs under the receiver's
    read lock, as an inference engine would.
    """

    def __init__(
        self,
        identity: str,
        *,
        trainer: str = TRAINER,
        namespace: str = NAMESPACE,
        config: Any = None,
        dtype: str = "bfloat16",
        seed: int = 1234,
        **receiver_options: Any,
    ) -> None:
        self.identity, self.trainer, self.namespace = identity, trainer, namespace
        self.config, self.dtype, self.options = config, dtype, receiver_options
        self.model = build(seed=seed).to(parse_float_dtype(dtype))  # other weights: the bootstrap aligns them
        self.receiver: Receiver | None = None

    async def find_trainer(self) -> str:
        """The trainer's endpoint, looked up by name each time: the receiver asks before
        every session, so a trainer actor Ray restarts on another port is found again."""
        trainer = ray.get_actor(self.trainer, namespace=self.namespace)  # ValueError until registered: retried
        return str(await trainer.endpoint.remote())

    async def start(self, timeout: float = 60.0) -> dict[str, Any]:
        self.receiver = Receiver(self.model, self.find_trainer, self.config, identity=self.identity, **self.options)
        await self.receiver.start(timeout=timeout)
        return await self.status()

    async def wait_for_version(self, version: int, timeout: float = 60.0) -> dict[str, Any]:
        assert self.receiver is not None, "start() first"
        await self.receiver.wait_for_version(version, timeout)
        return await self.status()

    async def status(self) -> dict[str, Any]:
        """Version, connection and the digest of the weights, taken under the read lock."""
        assert self.receiver is not None, "start() first"
        async with self.receiver.reading():
            digest = await asyncio.to_thread(state_digest, self.model.state_dict())
            version = self.receiver.version
        return {
            "identity": self.identity, "endpoint": self.receiver.endpoint, "version": version, "digest": digest,
            "connected": self.receiver.connected, "reconnects": self.receiver.reconnects,
        }

    async def generate(self, prompt: list[int], steps: int = 4) -> dict[str, Any]:
        assert self.receiver is not None, "start() first"
        async with self.receiver.reading():  # no version is committed mid-generation
            tokens = await asyncio.to_thread(generate, self.model, torch.tensor([prompt]), steps)
            version = self.receiver.version
        return {"version": version, "tokens": tokens[0].tolist()}

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()


def init_local(num_cpus: int = 4, **kwargs: Any) -> float:
    """Start a local Ray cluster whose workers can import this repository; returns seconds taken."""
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p), "OMP_NUM_THREADS": "1"}
    t = time.perf_counter()
    ray.init(num_cpus=num_cpus, include_dashboard=False, namespace=NAMESPACE, runtime_env={"env_vars": env}, **kwargs)
    return time.perf_counter() - t


def curve_keys(rollouts: int) -> tuple[Any, list[Any]]:
    """A CurveServer admitting ``rollouts`` fresh receiver keys, and their CurveClients.

    Made by the driver here for brevity; across nodes, each party would rather make its
    own key pair and hand only the public key to the others through Ray."""
    from protocol.net.security import CurveClient, CurveServer, KeyPair

    server = KeyPair.generate()
    clients = [KeyPair.generate() for _ in range(rollouts)]
    return CurveServer(server, frozenset(c.public for c in clients)), [CurveClient(c, server.public) for c in clients]


def main(args: argparse.Namespace) -> None:
    started = init_local(log_to_driver=False)
    report("ray", version=ray.__version__, startup_seconds=round(started, 2), nodes=len(ray.nodes()))
    try:
        server, clients = curve_keys(args.rollouts) if args.curve else (None, [None] * args.rollouts)
        if args.config:
            args.config = str(Path(args.config).resolve())  # the workers may run elsewhere
        trainer = TrainerActor.options(name=TRAINER).remote(config=args.config, lr=args.lr, curve=server)
        rollouts = [RolloutActor.remote(f"rollout-{i}", config=args.config, curve=c) for i, c in enumerate(clients)]
        endpoint = ray.get(trainer.start.remote(), timeout=60)
        digest = ray.get(trainer.digest.remote(), timeout=60)
        report("listening", endpoint=endpoint, curve=args.curve, version=0, digest=digest)
        for status in ray.get([r.start.remote(60.0) for r in rollouts], timeout=90):
            report("rollout", **status, equal=status["digest"] == digest)
        for _ in range(args.steps):
            synced = ray.get(trainer.step.remote(flush=True), timeout=60)
            version = synced["version"]
            states = ray.get([r.wait_for_version.remote(version) for r in rollouts], timeout=60)
            report(
                "synced", version=version, loss=round(synced["loss"], 4), changed_fraction=synced["changed_fraction"],
                wire_bytes=synced["wire_bytes"], digest=synced["digest"],
                rollouts={s["identity"]: {"version": s["version"], "equal": s["digest"] == synced["digest"]} for s in states},
            )
        sample = ray.get(rollouts[0].generate.remote([1, 2, 3, 4]), timeout=60)
        report("generated", **sample)
        ray.get([r.close.remote() for r in rollouts] + [trainer.close.remote()], timeout=60)
        report("done", version=args.steps, rollouts=len(rollouts))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--curve", action="store_true", help="encrypt with fresh CURVE keys passed to the actors (the multi-node recipe)")
    main(p.parse_args())
