"""examples/async_rl.py end to end: an in-test trainer, three rollout processes.

One run (module fixture), several claims about it. The trainer steps on its own clock
and syncs every version; the rollouts are real processes with real sockets:

* ``steady`` generates throughout;
* ``frozen`` is stopped with SIGSTOP for longer than ``K`` trainer steps, then continued
  (it loads weights in 50 ms, like an engine would, so that after SIGCONT its gate
  certainly sees the receiver still behind);
* ``slow`` loads weights in 400 ms, four trainer steps, so its receiver keeps falling
  more than ``K`` versions behind and its gate must hold it back.

Every sample carries the digest of the weights that generated it, taken under the same
read-lock hold as the generation: the trainer compares it with its own digest of the
version the sample is tagged with.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.async_rl import AsyncTrainer, Received, spawn_rollout, weights_digest  # noqa: E402
from protocol.wire.checksum import state_digest  # noqa: E402
from sender import Sender  # noqa: E402

K = 2
STEPS = 45
INTERVAL = 0.1
FREEZE_AT = 8  # trainer version at which ``frozen`` is stopped
FREEZE_SECONDS = 1.2
T = 60.0
ROLLOUTS = {"steady": [], "frozen": ["--slow-apply", "0.05"], "slow": ["--slow-apply", "0.4"]}


@dataclass
class Run:
    trainer: AsyncTrainer
    summary: dict[str, Any]
    events: dict[str, list[dict[str, Any]]]
    codes: dict[str, int | None]
    frozen: dict[str, Any] = field(default_factory=dict)  # versions and times around the freeze
    final_digest: str = ""

    def samples(self, identity: str) -> list[Received]:
        return sorted((r for r in self.trainer.received if r.sample.identity == identity), key=lambda r: r.sample.seq)


async def _collect(proc: asyncio.subprocess.Process, into: list[dict[str, Any]]) -> None:
    assert proc.stdout is not None
    async for raw in proc.stdout:
        with contextlib.suppress(json.JSONDecodeError):
            into.append(json.loads(raw))


async def _until(predicate: Any, timeout: float = T) -> None:
    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), timeout)


async def _scenario(logs: Path) -> Run:
    procs: dict[str, asyncio.subprocess.Process] = {}
    events: dict[str, list[dict[str, Any]]] = {name: [] for name in ROLLOUTS}
    readers: list[asyncio.Task[None]] = []
    async with Sender("tcp://127.0.0.1:0") as sender:
        trainer = AsyncTrainer(sender, k=K, steps=STEPS, step_interval=INTERVAL)
        await trainer.start()
        try:
            for name, extra in ROLLOUTS.items():
                with open(logs / f"{name}.log", "wb") as err:
                    procs[name] = await spawn_rollout(name, sender.endpoint, trainer.samples_endpoint, *extra,
                                                      stdout=asyncio.subprocess.PIPE, stderr=err.fileno())
                readers.append(asyncio.create_task(_collect(procs[name], events[name])))
            await trainer.wait_for_rollouts(len(ROLLOUTS), timeout=T)
            run = asyncio.create_task(trainer.run())
            await _until(lambda: trainer.version >= FREEZE_AT or run.done())
            frozen: dict[str, Any] = {"version_at_stop": trainer.version, "time_at_stop": time.monotonic()}
            os.kill(procs["frozen"].pid, signal.SIGSTOP)
            try:
                await asyncio.sleep(FREEZE_SECONDS)
            finally:
                frozen["version_at_cont"] = trainer.version
                frozen["acked_at_cont"] = sender.receivers.get("frozen", {}).get("acked")
                frozen["time_at_cont"] = time.monotonic()
                os.kill(procs["frozen"].pid, signal.SIGCONT)
            await asyncio.wait_for(run, T)
            summary = await trainer.finish(timeout=T)
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs.values())), T)
            await asyncio.gather(*readers)
        finally:
            for p in procs.values():
                if p.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signal.SIGCONT)
                        p.kill()
            await trainer.close()
    return Run(trainer, summary, events, {n: p.returncode for n, p in procs.items()}, frozen, weights_digest(trainer.model))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    logs = tmp_path_factory.mktemp("async_rl")
    return asyncio.run(asyncio.wait_for(_scenario(logs), 3 * T))


def test_tags_are_the_weights_used(run: Run) -> None:
    """Each sample's digest (taken under the read lock it generated under) is the
    trainer's digest of the version it is tagged with: the tag names the weights used."""
    received = run.trainer.received
    assert received, "no sample reached the trainer"
    assert all(r.tag_ok is True for r in received), [(r.sample.identity, r.sample.seq, r.sample.version) for r in received if not r.tag_ok]
    for name in ROLLOUTS:
        versions = [r.sample.version for r in run.samples(name)]
        assert versions, f"{name} sent no sample"
        assert versions == sorted(versions), f"{name}'s tags went backwards: {versions}"


def test_lag_never_exceeds_k(run: Run) -> None:
    """Consumed samples are at most K versions old; older ones are dropped, never used;
    and no rollout started a generation on weights it knew to be more than K behind."""
    consumed = [r for r in run.trainer.received if r.consumed]
    assert consumed and max(r.lag for r in consumed) <= K
    assert all(r.lag > K for r in run.trainer.received if not r.consumed)
    assert all(r.lag >= 0 for r in run.trainer.received)
    assert all(r.sample.latest - r.sample.version <= K for r in run.trainer.received)
    assert run.summary["max_lag"] <= K and run.summary["tag_mismatches"] == 0


def test_trainer_never_waits_for_a_frozen_rollout(run: Run, reliability: Any) -> None:
    """While ``frozen`` is stopped the trainer keeps stepping, well past K versions ahead
    of what ``frozen`` acknowledged, on samples from the other rollouts."""
    f = run.frozen
    stepped = f["version_at_cont"] - f["version_at_stop"]
    nominal = FREEZE_SECONDS / INTERVAL
    assert stepped >= max(K + 2, nominal / 3), f"only {stepped} steps in {FREEZE_SECONDS}s of freeze"
    assert f["acked_at_cont"] is not None and f["version_at_cont"] - f["acked_at_cont"] > K
    during = [r for r in run.trainer.received if r.consumed and f["version_at_stop"] < r.step <= f["version_at_cont"]]
    assert any(r.sample.identity == "steady" for r in during), "no sample consumed during the freeze"
    times = run.trainer.step_times
    assert len(times) == STEPS
    gaps = [b - a for a, b in itertools.pairwise(times) if f["time_at_stop"] <= a <= f["time_at_cont"]]
    assert gaps and max(gaps) < 0.75 * FREEZE_SECONDS, f"a step waited {max(gaps):.2f}s during the freeze"  # no step spans it
    reliability.record(
        steps_during_freeze=stepped, nominal_steps=int(nominal), max_step_gap_during_freeze=round(max(gaps), 3),
        frozen_acked_at_cont=f["acked_at_cont"], consumed=run.summary["consumed"], dropped=run.summary["dropped"],
        lags=run.summary["lags"], gate_waits={n: run.summary["rollouts"][n]["gate_waits"] for n in ROLLOUTS},
    )


def test_frozen_rollout_waits_instead_of_generating_stale(run: Run) -> None:
    """After SIGCONT, ``frozen`` may finish the one generation the freeze interrupted
    (the trainer drops it), then waits for its receiver: every later sample is tagged
    with a version within K of the trainer's version at SIGCONT. Its receiver catches up
    beside that generation, so on a loaded host it can be current before the rollout asks
    the gate again; then there is no wait, and the next sample is already fresh."""
    f = run.frozen
    after = [r for r in run.samples("frozen") if r.arrived > f["time_at_cont"]]
    assert after, "frozen sent nothing after SIGCONT"
    stale = [r for r in after if r.sample.version < f["version_at_cont"] - K]
    assert len(stale) <= 1 and stale == after[: len(stale)], [(r.sample.seq, r.sample.version) for r in stale]
    assert all(not r.consumed for r in stale)
    waits = [e for e in run.events["frozen"] if e.get("event") == "gate_wait" and e["latest"] >= f["version_at_cont"]]
    if waits:
        assert waits[0]["latest"] - waits[0]["version"] > K, waits[0]
    else:
        fresh = after[len(stale):]
        assert fresh, f"no gate wait after SIGCONT and no fresh sample: {run.events['frozen'][-5:]}"


def test_slow_rollout_waits_at_the_gate(run: Run) -> None:
    """``slow``'s receiver falls more than K behind; it waits rather than generating."""
    waits = [e for e in run.events["slow"] if e.get("event") == "gate_wait"]
    assert waits and all(e["lag"] > K for e in waits)
    slow = run.samples("slow")
    assert slow and all(r.sample.latest - r.sample.version <= K for r in slow)
    assert run.summary["rollouts"]["slow"]["gate_waits"] == len(waits)


def test_final_rollout_weights_equal_the_trainers(run: Run) -> None:
    digest = state_digest(run.trainer.model.state_dict())
    assert digest == run.final_digest == run.trainer.digests[STEPS]
    for name in ROLLOUTS:
        done = [e for e in run.events[name] if e.get("event") == "rollout_done"]
        assert done and done[0]["version"] == STEPS and done[0]["digest"] == digest, f"{name}: {done}"
    assert run.summary["digests_equal"] and run.codes == dict.fromkeys(ROLLOUTS, 0)
