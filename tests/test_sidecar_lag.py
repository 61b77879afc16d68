"""Bounded staleness through a receiver sidecar: ``attach(...).reading(max_lag=k)``.

The sidecar (``python -m receiver --shm``) publishes in its region's header the trainer's
latest version as it hears it, and as of when (``receiver/control/sidecar_lag.py``); an
engine's bounded read yields only weights at most ``k`` versions behind it, while that
knowledge is current. First the header and the rule on a region this test owns (the
sidecar's side played in process, the engine's on its own mapping, so the flocks conflict
as across processes); then real sidecar processes following a real ``Sender`` doing AdamW
steps, with the engine in this process: a slow engine against fast versions, a sidecar
paused through its control API while the trainer goes ahead, one stopped with SIGSTOP,
and one cut off from its sender.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from daemon_helpers import CONFIGS, DAEMON_KW, HEARTBEAT, YAML, Proc, Processes, Trainer, wait_until
from test_sidecars import STARTUP, TIMING, bf16_model, prefix  # noqa: F401 - prefix: the region-leak fixture

from protocol.errors import ConfigError, SharedMemoryError, WeightSyncError, WeightSyncTimeout
from protocol.host.shm import Layout, Region
from protocol.wire.checksum import state_digest
from receiver.control.attach import AttachedModel, attach, engine_region
from sender import Sender

T = 30.0
MAX_AGE = 2 * HEARTBEAT  # the sidecar's: two of its heartbeat intervals


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    began = time.monotonic()
    return fn(), time.monotonic() - began


def read(attached: AttachedModel, **kw: Any) -> int | None:
    with attached.reading(**kw) as version:
        return version


# -- the header and the rule, in one process ---------------------------------------------------
def test_the_bound_against_what_the_owner_published(prefix: str) -> None:  # noqa: F811
    owner = engine_region(bf16_model(), f"{prefix}-b", max_age=0.3)
    engine = attach(bf16_model(seed=5), f"{prefix}-b")
    try:
        heard = engine.latest
        assert heard is not None and heard.version is None and heard.age() == math.inf
        assert heard.max_age == pytest.approx(0.3) and heard.publisher == os.getpid()
        with pytest.raises(WeightSyncTimeout, match=r"max_lag=0 .*has not heard the trainer's latest"):
            read(engine, max_lag=0, timeout=0.2)  # nothing heard: nothing vouched for
        with owner.writing(3):
            pass
        owner.publish_latest(5, time.monotonic(), 0.3)
        assert engine.latest is not None and engine.latest.version == 5 and engine.latest.age() < 0.3
        assert read(engine, max_lag=2, timeout=T) == 3  # 2 behind is within 2
        with pytest.raises(WeightSyncTimeout, match=r"max_lag=1 .*v3 is more than 1 versions behind v5") as info:
            read(engine, max_lag=1, timeout=0.3, max_age=10.0)
        last = {"version": 3, "latest": 5, "lag": 2, "seconds": pytest.approx(0.3, abs=0.5)}
        assert engine.lag_waits.timeouts == 2 and engine.lag_waits.last == last
        assert isinstance(info.value, TimeoutError)

        # a commit while a bounded reader waits: it waits outside the hold, or the write could not go in
        def commit() -> None:
            time.sleep(0.2)
            with owner.writing(4):
                pass

        writer = threading.Thread(target=commit)
        writer.start()
        (version, took) = timed(lambda: read(engine, max_lag=1, timeout=T, max_age=10.0))
        writer.join(T)
        assert version == 4 and took >= 0.15 and engine.lag_waits.count == 3
        # knowledge older than max_age is not current, whatever the lag: waited for, never vouched for
        owner.publish_latest(5, time.monotonic() - 1.0, 0.3)
        with pytest.raises(WeightSyncTimeout, match=r"knowledge of the trainer's latest \(v5\) is 1.* old, older than max_age=0.3s"):
            read(engine, max_lag=5, timeout=0.2)
        assert read(engine, max_lag=5, timeout=T, max_age=2.0) == 4  # the caller's own max_age
        assert read(engine) == 4  # no bound: the weights held, as ever
        # refreshed while a reader waits: it goes in
        threading.Timer(0.2, lambda: owner.publish_latest(5, time.monotonic(), 0.3)).start()
        assert read(engine, max_lag=1, timeout=T) == 4
        # a publication its publisher died in the middle of (its seqlock left odd): never current
        h = owner._header
        h[11] = int(h[11]) + 1
        with pytest.raises(WeightSyncTimeout, match="has not heard"):
            read(engine, max_lag=5, timeout=0.2)
        owner.publish_latest(5, time.monotonic(), 0.3)  # the next publication repairs it
        assert int(h[11]) % 2 == 0 and read(engine, max_lag=1, timeout=T) == 4
        with pytest.raises(SharedMemoryError, match="only its owner"):
            engine.region.publish_latest(9, time.monotonic(), 0.3)
        # a region of an older sidecar: its latest slots are zero (unused then); refused at once, clearly
        h[11:16] = 0
        assert engine.latest is None
        with pytest.raises(SharedMemoryError, match="publishes no trainer's latest version"):
            read(engine, max_lag=0, timeout=T)
        assert read(engine) == 4 and engine.snapshot()[0] == 4  # unbounded reads as ever
        # the sidecar stopped (the region closed) with the engine behind: no version will ever come here
        owner.publish_latest(6, time.monotonic(), 30.0)
        owner.unlink()
        with pytest.raises(WeightSyncError, match="never will be: its sidecar stopped") as stopped:
            read(engine, max_lag=1, timeout=T)
        assert type(stopped.value) is WeightSyncError  # at once, not a timeout
        assert read(engine, max_lag=2, timeout=T) == 4  # within the bound, the knowledge still current: read
    finally:
        engine.close()
        owner.close()


def test_bad_bounds_are_config_errors(prefix: str) -> None:  # noqa: F811
    owner = engine_region(bf16_model(), f"{prefix}-a", max_age=0.3)
    engine = attach(bf16_model(), f"{prefix}-a")
    try:
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(ConfigError, match="max_lag must be an int >= 0"):
                engine.reading(max_lag=bad)  # type: ignore[arg-type]
        for bad_age in (0, -1.0, math.nan, math.inf, "1", True):
            with pytest.raises(ConfigError, match="max_age must be a number of seconds > 0"):
                engine.reading(max_lag=0, max_age=bad_age)  # type: ignore[arg-type]
        assert engine.lag_waits.count == 0  # refused before any wait
        with pytest.raises(SharedMemoryError, match="latest_max_age must be > 0"):
            Region.create(f"{prefix}-z", Layout.of({"w": torch.zeros(2)}), latest_max_age=0)
    finally:
        engine.close()
        owner.close()


def test_an_adopted_leftover_publishes_what_its_new_owner_says(prefix: str) -> None:  # noqa: F811
    name, layout = f"{prefix}-l", Layout.of({"w": torch.zeros(4)})
    killed = Region.create(name, layout, latest_max_age=0.5)
    killed.publish_latest(7, time.monotonic(), 0.5)
    killed._finalizer.detach()  # as if SIGKILLed: nobody unlinks it
    engine = Region.attach(name)
    snapshots = Region.create(name, layout, adopt=True)  # a sidecar that follows no trainer: what was published is withdrawn
    assert engine.latest() is None and snapshots.generation == engine.generation
    snapshots._finalizer.detach()
    follows = Region.create(name, layout, adopt=True, latest_max_age=0.2)  # one that follows a trainer: nothing heard yet
    heard = engine.latest()
    assert heard is not None and heard.version is None and heard.age() == math.inf and heard.max_age == pytest.approx(0.2)
    for r in (engine, follows, snapshots, killed):
        r.close()


@pytest.mark.timeout(120)
async def test_the_sidecar_stops_with_its_publishers_failure(tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """The publisher is the daemon's task: if it fails, the sidecar stops with its error
    (and unlinks its region) rather than go on with engines' bounds left to go stale."""
    import receiver.control.daemon as daemon
    from receiver.control.sidecar_lag import LatestPublisher

    config = tmp_path / "patch.yaml"
    config.write_text(YAML["patch"])
    trainer = Trainer(seed=7)
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await sender.start(trainer.model, version=trainer.version)
    args = daemon.parse_args(["--endpoint", sender.endpoint, "--model", "examples.tiny_model:build", "--shm", f"{prefix}-p",
                              "--config", str(config), *TIMING])
    real, calls = LatestPublisher.publish, 0

    def breaks(self: LatestPublisher) -> int | None:
        nonlocal calls
        calls += 1
        if calls > 40:
            raise RuntimeError("the publisher broke")
        return real(self)

    monkeypatch.setattr(LatestPublisher, "publish", breaks)
    try:
        with pytest.raises(RuntimeError, match="the publisher broke"):
            await asyncio.wait_for(daemon.serve(args, asyncio.Event()), T)
    finally:
        await sender.close()


# -- real sidecar processes --------------------------------------------------------------------
@dataclass
class Rig:
    trainer: Trainer
    sender: Sender
    sidecar: Proc
    attached: AttachedModel
    model: torch.nn.Module
    control: str | None = None
    began: list[int] = field(default_factory=lambda: [0])  # the newest version whose sync has begun

    async def step(self) -> int:
        self.began[0] = self.trainer.version + 1  # from now on the sender may say it: heard before sync returns
        return await self.trainer.step_and_sync(self.sender)

    async def applied(self, version: int) -> None:
        await self.sidecar.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version, STARTUP)

    def heard(self) -> int | None:
        heard = self.attached.latest
        return None if heard is None else heard.version

    async def call(self, path: str) -> None:
        assert self.control is not None
        async with aiohttp.ClientSession() as http, http.post(f"{self.control}{path}") as resp:
            assert resp.status == 200, await resp.text()


@pytest.fixture
async def rig(tmp_path: Path, prefix: str, procs: Processes) -> AsyncIterator[Callable[..., Any]]:  # noqa: F811
    made: list[Rig] = []

    async def make(*extra: str) -> Rig:
        config = tmp_path / "patch.yaml"
        config.write_text(YAML["patch"])
        trainer = Trainer(seed=7)
        sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
        await sender.start(trainer.model, version=trainer.version)
        shm = f"{prefix}-s{len(made)}"
        sidecar = await procs.spawn(
            "sidecar", "receiver", "--endpoint", sender.endpoint, "--model", "examples.tiny_model:build", "--identity", "side",
            "--shm", shm, "--config", str(config), *TIMING, *extra,
        )
        model = bf16_model()
        attached = await asyncio.to_thread(attach, model, shm, timeout=STARTUP)
        r = Rig(trainer, sender, sidecar, attached, model)
        made.append(r)
        if "--control" in extra:
            r.control = (await sidecar.wait_event(lambda e: e.get("event") == "control", STARTUP))["url"]
        await r.applied(0)
        return r

    yield make
    for r in made:
        await r.sender.close()
        if r.sidecar.process.returncode is None:
            os.kill(r.sidecar.process.pid, signal.SIGCONT)
            assert await r.sidecar.terminate() == 0, r.sidecar.tail()
        r.attached.close()


@dataclass
class Read:
    k: int
    began: int  # the newest version whose sync had begun when the read began
    heard: int | None  # the latest the sidecar had published then
    before: int | None  # the version the region held then
    held: int | None  # the version the read yielded
    digest: str  # the weights' digest inside the hold


@pytest.mark.timeout(300)
async def test_a_slow_engine_reads_within_max_lag_of_fast_versions(rig: Any) -> None:
    """The trainer syncs a version as soon as the sidecar has heard the one before and
    ``PACE`` has passed (so at most one version is in flight that the region does not
    name); the engine holds each read ``SLOW`` seconds, longer than versions take to come,
    so the sidecar's commits queue behind it and its next read begins behind. Each read
    must yield weights at most ``k`` behind what the sidecar had published when the read
    began, so at most ``k + 1`` behind what the sender had begun to publish; the weights
    inside are the version's, bit for bit (by digest)."""
    r = await rig()
    SLOW, PACE, READS = 0.25, 0.1, 6
    reads: list[Read] = []
    attached, model = r.attached, r.model

    def heard_at_least(version: int) -> bool:
        heard = r.heard()
        return heard is not None and heard >= version

    def engine() -> None:
        for k in (0, 1):
            for _ in range(READS):
                began, heard, before = r.began[0], r.heard(), attached.version
                with attached.reading(max_lag=k, timeout=T) as held:
                    digest = state_digest(model.state_dict())
                    time.sleep(SLOW)  # a slow generation: the sidecar's next commit waits for it
                reads.append(Read(k, began, heard, before, held, digest))

    reader = asyncio.ensure_future(asyncio.to_thread(engine))
    while not reader.done():
        version = await r.step()
        await wait_until(lambda v=version: heard_at_least(v) or reader.done(), T)  # type: ignore[misc]
        await asyncio.sleep(PACE)
    await reader
    assert len(reads) == 2 * READS
    for read_ in reads:
        assert read_.held is not None and read_.digest == r.trainer.digests[read_.held], read_
        assert read_.heard is not None and read_.held >= read_.heard - read_.k, read_
        assert read_.held >= read_.began - read_.k - 1, read_
    behind = [x for x in reads if x.k == 0 and x.heard is not None and (x.before or -1) < x.heard]
    assert behind, f"no read began behind: the bound was never put to work ({reads})"
    assert attached.lag_waits.count >= len(behind) and attached.lag_waits.timeouts == 0


@pytest.mark.timeout(300)
async def test_a_paused_stopped_or_cut_off_sidecar_times_bounded_reads_out_and_unbounded_ones_read_as_ever(rig: Any) -> None:
    r = await rig("--control", "127.0.0.1:0")
    attached = r.attached
    await r.step()
    await r.applied(1)
    assert await asyncio.to_thread(read, attached, max_lag=0, timeout=T) == 1
    # paused through its control API: the trainer goes ahead, the sidecar hears it and holds its weights
    await r.call("/v1/pause")
    for _ in range(3):
        await r.step()
    await wait_until(lambda: r.heard() == 4)
    assert attached.version == 1
    with pytest.raises(WeightSyncTimeout, match=r"max_lag=1 .*v1 is more than 1 versions behind v4"):
        await asyncio.to_thread(read, attached, max_lag=1, timeout=0.5)
    assert await asyncio.to_thread(read, attached, max_lag=3, timeout=T) == 1  # 3 behind is within 3
    assert await asyncio.to_thread(read, attached) == 1  # no bound: as ever

    def fresh() -> tuple[int | None, str]:
        with attached.reading(max_lag=0, timeout=T) as held:
            return held, state_digest(r.model.state_dict())

    waiting = asyncio.ensure_future(asyncio.to_thread(fresh))
    await asyncio.sleep(0.5)
    assert not waiting.done()
    await r.call("/v1/resume")
    held, digest = await waiting
    assert held == 4 and digest == r.trainer.digests[4]

    # stopped (SIGSTOP): it publishes nothing; what it heard ages past max_age and is vouched for no more
    os.kill(r.sidecar.process.pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(3 * MAX_AGE)
        began = time.monotonic()
        with pytest.raises(WeightSyncTimeout, match=r"max_lag=5 .*older than max_age=0.2s: the sidecar is stopped, stalled or cut off"):
            await asyncio.to_thread(read, attached, max_lag=5, timeout=0.5)
        assert 0.5 <= time.monotonic() - began < 5
        assert await asyncio.to_thread(read, attached) == 4  # no bound: the weights held, as ever
    finally:
        os.kill(r.sidecar.process.pid, signal.SIGCONT)
    assert await asyncio.to_thread(read, attached, max_lag=0, timeout=T) == 4  # it refreshes what it knows

    # cut off: the sender gone, the sidecar's knowledge ages; nothing newer is vouched for, or the old
    await r.sender.close()
    await wait_until(lambda: attached.latest is not None and attached.latest.age() > MAX_AGE, T)
    with pytest.raises(WeightSyncTimeout, match=r"max_lag=5 .*(older than max_age|has not heard)"):  # reconnecting: heard anew
        await asyncio.to_thread(read, attached, max_lag=5, timeout=0.5)
    assert await asyncio.to_thread(read, attached) == 4
    assert attached.lag_waits.timeouts == 3
