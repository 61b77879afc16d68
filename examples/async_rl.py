"""Asynchronous RL with bounded staleness, on weightsync.

The trainer never waits for rollouts: every step it takes whatever samples have arrived,
does one policy-gradient update and ``sender.sync``s a new version. Rollout workers
(separate processes, each with a ``Receiver``) generate under
``receiver.reading(max_lag=k)``, which yields the version of the weights held, the tag of
every sample generated inside. Staleness is bounded by ``k`` on both sides:

* ``reading(max_lag=k)`` holds back a rollout whose weights are more than ``k`` versions
  behind the trainer's latest until its receiver has caught up (the latest comes from
  weightsync's own heartbeats; knowledge gone stale, as after the process was stopped, is
  asked afresh first);
* the trainer drops, and reports, any sample more than ``k`` versions old on arrival
  at its step (one generated just before a rollout froze, say).

Samples travel on a channel of the application's own (a ZeroMQ ROUTER/DEALER pair beside
weightsync's), which also says when to stop.

Task: a tiny transformer policy (examples/tiny_model.py, 16-token vocabulary) samples 8
tokens after a one-token prompt, 8 sequences per prompt; the reward is the fraction of
tokens equal to the one before (learn to repeat). The update is REINFORCE with a
per-prompt mean baseline and a truncated importance weight for the samples' lag.

    python examples/async_rl.py                  # trainer + 2 rollout processes, JSON lines
    python examples/async_rl.py --slow-apply 0.3 # the second rollout loads weights slowly
    python examples/async_rl.py rollout ...      # one rollout worker (spawned by the above)
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq
import zmq.asyncio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.tiny_model import TinyLM, build
from protocol.host.cli import report, setup_logging
from protocol.wire.checksum import state_digest
from receiver import Receiver, StrategyHooks
from sender import Sender

VOCAB = 16
LENGTH = 8  # tokens generated after the prompt
GROUP = 8  # sequences per prompt: one sample, one baseline


# -- the task ------------------------------------------------------------------------------------
def build_policy(seed: int) -> TinyLM:
    return build(seed=seed, vocab=VOCAB)


def rewards_of(tokens: torch.Tensor) -> torch.Tensor:
    """Fraction of generated tokens equal to the token before them."""
    return (tokens[:, 1:] == tokens[:, :-1]).float().mean(1)


@torch.no_grad()
def generate(model: TinyLM, prompt: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``GROUP`` continuations of ``prompt``; returns the tokens and their log-probs
    under the weights used (the behaviour policy, needed to correct for lag)."""
    tokens = torch.full((GROUP, 1), prompt, dtype=torch.long)
    logps = []
    for _ in range(LENGTH):
        logp = torch.log_softmax(model(tokens)[:, -1].float(), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=generator)
        logps.append(logp.gather(1, nxt))
        tokens = torch.cat([tokens, nxt], 1)
    return tokens, torch.cat(logps, 1)


def policy_loss(model: TinyLM, tokens: torch.Tensor, behaviour: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE, per-prompt mean baseline; the importance weight pi/mu is truncated at 1
    because the samples come from weights up to ``k`` versions old."""
    logp = torch.log_softmax(model(tokens[:, :-1]), -1).gather(-1, tokens[:, 1:, None])[..., 0]
    advantage = rewards - rewards.view(-1, GROUP).mean(1).repeat_interleave(GROUP)
    weight = (logp.detach() - behaviour).exp().clamp(max=1.0)
    return -(weight * advantage[:, None] * logp).mean()


def weights_digest(model: torch.nn.Module) -> str:
    return state_digest(model.state_dict())


# -- the sample channel --------------------------------------------------------------------------
@dataclass
class Sample:
    """One group of sequences and the version of the weights that generated it."""

    identity: str
    seq: int
    version: int  # receiver.version, read under the lock held while generating
    latest: int  # the trainer's latest version as the rollout knew it when it started
    digest: str  # of the weights used, under the same lock hold ("" when not verifying)
    tokens: list[list[int]]
    behaviour: list[list[float]]
    rewards: list[float]


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    return msgpack.unpackb(data, raw=False)


class TrainerLink:
    """The rollout's end of the sample channel: one request at a time, each answered by
    the trainer at once (whether to stop, and the final version, ride along)."""

    def __init__(self, endpoint: str, identity: str, context: zmq.asyncio.Context | None = None) -> None:
        self.socket = (context or zmq.asyncio.Context.instance()).socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.connect(endpoint)
        self.identity = identity
        self._nonce = 0

    async def request(self, kind: str, timeout: float = 60.0, **body: Any) -> dict[str, Any]:
        """Send one message, return the trainer's answer."""
        self._nonce += 1
        await self.socket.send(pack({"kind": kind, "identity": self.identity, "nonce": self._nonce, **body}))
        while True:  # answers to requests that timed out earlier are skipped
            answer = unpack(await asyncio.wait_for(self.socket.recv(), timeout))
            if answer.get("nonce") == self._nonce:
                return answer

    def close(self) -> None:
        self.socket.close()


# -- the rollout side ----------------------------------------------------------------------------
async def rollout_main(args: argparse.Namespace) -> None:
    """A rollout worker: generate, tag, submit, until the trainer says stop."""
    torch.set_num_threads(1)
    model = build_policy(seed=1000 + args.seed)  # other weights than the trainer's: the bootstrap aligns them
    generator = torch.Generator().manual_seed(args.seed)
    link = TrainerLink(args.samples, args.identity)

    async def slow(_: Any) -> None:  # an engine slow to load weights: each version waits, staged, before its commit
        await asyncio.sleep(args.slow_apply)

    # (not an on_update hook: those run in their own task, and the receiver commits on while they run)
    hooks = StrategyHooks(on_staged=slow) if args.slow_apply > 0 else None
    async with Receiver(model, args.sync, args.config, identity=args.identity, hooks=hooks) as receiver:
        await receiver.start(timeout=60)
        answer = await link.request("hello")
        k, seq, waits = answer["k"], 0, receiver.lag_waits
        while not answer["stop"]:
            prompt = int(torch.randint(0, VOCAB, (1,), generator=generator))
            waited = waits.count
            # Waits (outside the lock) while the weights are more than k versions behind; then
            # they stay at ``version`` until the block ends.
            async with receiver.reading(max_lag=k, timeout=60, max_age=args.max_age) as version:
                latest = receiver.latest_version  # what the bound was checked against (nothing ran between)
                if waits.count != waited:
                    report("gate_wait", identity=args.identity, **(waits.last or {}))
                tokens, behaviour = await asyncio.to_thread(generate, model, prompt, generator)
                digest = weights_digest(model) if args.verify else ""
            assert version is not None and latest is not None
            seq += 1
            sample = Sample(args.identity, seq, version, latest, digest, tokens.tolist(), behaviour.tolist(), rewards_of(tokens).tolist())
            answer = await link.request("sample", sample=dataclasses.asdict(sample))
        final = await receiver.wait_for_version(answer["final"], timeout=60)
        async with receiver.reading():
            digest = weights_digest(model)
        await link.request("done", version=final, digest=digest, samples=seq, gate_waits=waits.count)
        report("rollout_done", identity=args.identity, version=final, digest=digest, samples=seq,
               gate_waits=waits.count, gate_wait_seconds=round(waits.seconds, 3))
    link.close()


# -- the trainer side ----------------------------------------------------------------------------
@dataclass
class Received:
    """A sample as the trainer saw it: when, at which of its versions, and its verdict."""

    sample: Sample
    arrived: float  # time.monotonic() when it came in
    step: int  # the trainer step that took it
    lag: int  # the trainer's version then minus the sample's version
    consumed: bool  # lag <= k: used for the update; else dropped
    tag_ok: bool | None  # the sample's digest equals the trainer's digest of its version (None: not verified)


@dataclass
class AsyncTrainer:
    """Steps on its own clock with whatever samples arrived, and syncs each version.

    Nothing in the step loop waits for a rollout or an acknowledgement: the samples come
    in through a background task that answers each message at once, and ``sender.sync``
    returns once the changes are collected. ``step_interval`` stands for the compute of
    a real step.
    """

    sender: Sender
    k: int = 2
    steps: int = 60
    step_interval: float = 0.1
    lr: float = 3e-3
    seed: int = 0
    model: TinyLM = field(init=False)
    version: int = 0
    received: list[Received] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)  # monotonic start of each step
    digests: dict[int, str] = field(default_factory=dict)
    rollouts: dict[str, dict[str, Any]] = field(default_factory=dict)  # identity -> its "done" message, once sent
    samples_endpoint: str = ""

    def __post_init__(self) -> None:
        self.model = build_policy(self.seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=0.0)
        self._inbox: list[tuple[float, Sample]] = []
        self._stopping = False
        self._changed = asyncio.Condition()
        self._socket: zmq.asyncio.Socket | None = None
        self._serving: asyncio.Task[None] | None = None

    async def start(self, samples_endpoint: str = "tcp://127.0.0.1:*") -> AsyncTrainer:
        """Serve version 0 and open the sample channel."""
        await self.sender.start(self.model, version=0)
        self.digests[0] = weights_digest(self.model)
        self._socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(samples_endpoint)
        self.samples_endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._serving = asyncio.create_task(self._serve())
        return self

    async def wait_for_rollouts(self, count: int, timeout: float = 60.0) -> None:
        """Set-up only: wait until ``count`` rollouts have said hello (bootstrapped)."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: len(self.rollouts) >= count), timeout)

    async def _serve(self) -> None:
        assert self._socket is not None
        while True:
            peer, data = await self._socket.recv_multipart()
            msg = unpack(data)
            identity = msg["identity"]
            if msg["kind"] == "sample":
                self._inbox.append((time.monotonic(), Sample(**msg["sample"])))
            elif msg["kind"] == "hello":
                self.rollouts.setdefault(identity, {})
            elif msg["kind"] == "done":
                self.rollouts[identity] = msg
            answer = {"nonce": msg["nonce"], "latest": self.version, "k": self.k, "stop": self._stopping, "final": self.version}
            await self._socket.send_multipart([peer, pack(answer)])
            async with self._changed:
                self._changed.notify_all()

    def _step(self, step: int) -> dict[str, Any]:
        batch, self._inbox = self._inbox, []
        kept: list[Sample] = []
        lags: collections.Counter[int] = collections.Counter()
        dropped: collections.Counter[int] = collections.Counter()
        mismatches = 0
        for arrived, s in batch:
            lag = self.version - s.version
            expected = self.digests.get(s.version)
            tag_ok = None if not s.digest else s.digest == expected
            mismatches += tag_ok is False
            self.received.append(Received(s, arrived, step, lag, lag <= self.k, tag_ok))
            if lag <= self.k:
                kept.append(s)
                lags[lag] += 1
            else:
                dropped[lag] += 1
        loss = reward = None
        if kept:  # no samples: no update, but the version still moves on (nothing waits for rollouts)
            tokens = torch.tensor([t for s in kept for t in s.tokens])
            behaviour = torch.tensor([b for s in kept for b in s.behaviour])
            rewards = torch.tensor([r for s in kept for r in s.rewards])
            loss_t = policy_loss(self.model, tokens, behaviour, rewards)
            self.optimizer.zero_grad(set_to_none=True)
            loss_t.backward()
            self.optimizer.step()
            loss, reward = round(loss_t.item(), 5), round(float(rewards.mean()), 4)
        self.model.steps += 1
        return {
            "samples": len(kept),
            "lags": {str(lag): n for lag, n in sorted(lags.items())},
            "max_lag": max(lags, default=None),
            "dropped": sum(dropped.values()),
            "dropped_lags": {str(lag): n for lag, n in sorted(dropped.items())},
            "tag_mismatches": mismatches,
            "reward": reward,
            "loss": loss,
        }

    async def run(self) -> None:
        """The training loop: never awaits a rollout, a sample or an acknowledgement."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        for step in range(1, self.steps + 1):
            due += self.step_interval
            await asyncio.sleep(max(0.0, due - loop.time()))  # the rest of a real step: forward, backward, ...
            self.step_times.append(time.monotonic())
            fields = self._step(step)
            await self.sender.sync(self.model, step)  # returns once the changes are collected
            self.version = step
            self.digests[step] = weights_digest(self.model)
            report("step", version=step, k=self.k, **fields)

    async def finish(self, timeout: float = 60.0) -> dict[str, Any]:
        """Tell the rollouts to stop at the final version; their final weights must be ours."""
        self._stopping = True
        await self.sender.flush()
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: all("digest" in r for r in self.rollouts.values())), timeout)
        final = self.digests[self.version]
        consumed = [r for r in self.received if r.consumed]
        lags = collections.Counter(r.lag for r in consumed)
        summary = {
            "version": self.version,
            "k": self.k,
            "consumed": len(consumed),
            "dropped": len(self.received) - len(consumed),
            "lags": {str(lag): n for lag, n in sorted(lags.items())},
            "max_lag": max(lags, default=None),
            "tag_mismatches": sum(r.tag_ok is False for r in self.received),
            "rollouts": {name: {"version": r["version"], "samples": r["samples"], "gate_waits": r["gate_waits"], "equal": r["digest"] == final}
                         for name, r in sorted(self.rollouts.items())},
            "digests_equal": all(r["digest"] == final for r in self.rollouts.values()),
        }
        report("done", **summary)
        return summary

    async def close(self) -> None:
        if self._serving is not None:
            self._serving.cancel()
            await asyncio.gather(self._serving, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()


async def spawn_rollout(
    identity: str, sync: str, samples: str, *extra: str, stdout: int | None = None, stderr: int | None = None
) -> asyncio.subprocess.Process:
    """Start ``python examples/async_rl.py rollout ...`` as its own process."""
    seed = str(zlib.crc32(identity.encode()) % 10_000)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return await asyncio.create_subprocess_exec(
        sys.executable, str(Path(__file__).resolve()), "rollout", "--sync", sync, "--samples", samples, "--identity", identity,
        "--seed", seed, *extra, stdout=stdout, stderr=stderr, env=env,
    )


async def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    procs: list[asyncio.subprocess.Process] = []
    async with Sender("tcp://127.0.0.1:0", args.config) as sender:
        trainer = AsyncTrainer(sender, k=args.k, steps=args.steps, step_interval=args.step_interval, lr=args.lr)
        await trainer.start()
        try:
            for i in range(args.rollouts):
                extra = ["--config", args.config] if args.config else []
                if args.slow_apply > 0 and i == args.rollouts - 1:
                    extra += ["--slow-apply", str(args.slow_apply)]
                procs.append(await spawn_rollout(f"rollout-{i}", sender.endpoint, trainer.samples_endpoint, *extra))
            await trainer.wait_for_rollouts(args.rollouts, timeout=60)
            report("ready", sync=sender.endpoint, samples=trainer.samples_endpoint, rollouts=args.rollouts, k=args.k)
            await trainer.run()
            summary = await trainer.finish()
            codes = await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), 30)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
            await trainer.close()
    ok = summary["digests_equal"] and summary["tag_mismatches"] == 0 and (summary["max_lag"] or 0) <= args.k and not any(codes)
    return 0 if ok else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--k", type=int, default=2, help="staleness bound, in versions")
    p.add_argument("--rollouts", type=int, default=2)
    p.add_argument("--step-interval", type=float, default=0.1, help="seconds per trainer step (the compute of a real one)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--slow-apply", type=float, default=0.0, help="the last rollout takes this long more to load each version")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("rollout", help="one rollout worker (started by the trainer)")
    r.add_argument("--sync", required=True, help="the trainer's weightsync endpoint")
    r.add_argument("--samples", required=True, help="the trainer's sample channel")
    r.add_argument("--identity", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--slow-apply", type=float, default=0.0, help="take this long more to load each version (before its commit)")
    r.add_argument("--max-age", type=float, default=None,
                   help="ask the trainer's latest version afresh when what was heard is older than this (s; default: 2 heartbeats)")
    r.add_argument("--no-verify", dest="verify", action="store_false", help="do not send a digest of the weights with each sample")
    r.add_argument("--config", help="weight_syncer YAML")
    r.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    if args.command == "rollout":
        asyncio.run(rollout_main(args))
    else:
        sys.exit(asyncio.run(main(args)))
