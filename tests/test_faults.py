"""The fault matrix: crashes, a corrupting wire, replays, a frozen receiver, and load.

Each test ends with every receiver bit-identical to the trainer (real AdamW steps on
``examples.tiny_model``, fp32, synced to bf16 receivers that start from other weights) and
records its figures through the ``reliability`` fixture (see ``conftest.py``): versions
published, versions applied per receiver, resyncs, NACKs, reconnects, digests equal.

What runs where, honestly:

* crashes (``kill -9``) of a receiver mid-bootstrap and mid-patch: the sender in this
  process, the victim a ``python -m receiver`` process behind ``tests/proxy.py``, which
  stalls the chosen message half-way on the wire so the kill lands inside it;
* ``kill -9`` of the sender mid-sync: ``python -m sender --watch`` as a process, the
  receivers in this process (so their versions, NACKs and reconnects can be read);
* corruption, duplication, replay, reordering: in-process daemons over real TCP through
  the proxy, which rewrites the sender's ZMTP frames (bytes flipped *inside tensor
  payloads*, so only the per-buffer checksums can catch them);
* a frozen receiver: a ``python -m receiver`` process under SIGSTOP while the in-process
  trainer keeps calling ``sync()``;
* load, 16 receivers x 100 versions: in-process receivers (16 processes would mostly
  measure two cores' worth of torch imports), all over TCP loopback.

The receiver with mismatched metadata is ``test_daemons.py::test_metadata_mismatch_*``,
a receiver killed and restarted between versions and the sender killed between versions
are in ``test_processes.py``, and hostile messages at the strategy level in
``test_hostile.py`` / ``test_atomicity.py``: not repeated here.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_helpers import (
    CONFIGS,
    DAEMON_KW,
    HEARTBEAT,
    PEER_TIMEOUT,
    YAML,
    Proc,
    Processes,
    T,
    Trainer,
    assert_matches,
    free_port,
    mismatches,
    receiver_model,
    wait_until,
)
from proxy import Corrupt, Duplicate, Proxy, Reorder, Replay, Stall, Tamper, Wire, of_type

from protocol.errors import ResyncLimitError, StaleVersionError, WeightSyncError
from protocol.wire.checksum import state_digest
from protocol.wire.framing import MessageType
from receiver import Receiver
from receiver.session import follower as receiver_follower
from sender import Sender
from sender.stats import SyncStats

MODEL = "examples.tiny_model:build"
TIMING = ["--heartbeat", str(HEARTBEAT), "--peer-timeout", str(PEER_TIMEOUT)]


# -- figures ----------------------------------------------------------------------------------
class Applied:
    """Every version an in-process receiver publishes, in order, and the weights it holds
    then, read under its read lock and checked against the trainer's image of the version
    held: a digest that is not that version's would be a half-applied (or wrongly applied) one.
    (Its hook runs in the hooks' own task: a newer version may be in by then, and is checked.)"""

    def __init__(self, receiver: Receiver, trainer: Trainer) -> None:
        self.receiver, self.trainer = receiver, trainer
        self.log: list[tuple[int | None, str]] = []  # (version, kind) in commit order
        self.wrong: list[int | None] = []
        receiver.on_update(self._seen)

    async def _seen(self, version: int | None) -> None:
        stats = self.receiver.stats.get(version) if version is not None else None
        self.log.append((version, stats.kind if stats else "resumed"))
        async with self.receiver.reading() as held:
            digest = state_digest(self.receiver.model.state_dict())
        if version is None or held is None or held < version or digest != self.trainer.digests.get(held):
            self.wrong.append(version)

    @property
    def versions(self) -> list[int | None]:
        return [v for v, _ in self.log]

    @property
    def bootstraps(self) -> int:
        return sum(kind == "bootstrap" for _, kind in self.log)


def nacks(receiver: Receiver) -> dict[str, int]:
    """NACKs this receiver sent, by reason (its Prometheus counter)."""
    out: dict[str, int] = {}
    for metric in receiver.metrics.registry.collect():
        if metric.name == "weightsync_receiver_nacks":
            for sample in metric.samples:
                if sample.name.endswith("_total") and sample.value:
                    out[sample.labels["reason"]] = int(sample.value)
    return out


def in_process_figures(trainer: Trainer, sender: Sender | None, watches: dict[str, Applied]) -> dict[str, Any]:
    peers = sender.receivers if sender is not None else {}
    return {
        "versions_published": trainer.version,
        "applied": {name: len(w.log) for name, w in watches.items()},
        "bootstraps": {name: w.bootstraps for name, w in watches.items()},
        "resyncs": {name: int(peers[name]["resyncs"]) for name in watches if name in peers},  # type: ignore[call-overload]
        "nacks": {name: sum(nacks(w.receiver).values()) for name, w in watches.items()},
        "reconnects": {name: w.receiver.reconnects for name, w in watches.items()},
        "wrong_versions_published": sum(len(w.wrong) for w in watches.values()),
        "final_digests_equal": all(
            w.receiver.version == trainer.version and state_digest(w.receiver.model.state_dict()) == trainer.digests[trainer.version]
            for w in watches.values()
        ),
    }


def process_figures(trainer: Trainer, procs: dict[str, Proc]) -> dict[str, Any]:
    return {
        "applied": {name: len(p.applied()) for name, p in procs.items()},
        "bootstraps": {name: sum(e.get("kind") == "bootstrap" for e in p.applied()) for name, p in procs.items()},
        "wrong_versions_published": sum(
            e["digest"] != trainer.digests[e["version"]] for p in procs.values() for e in p.applied() if "superseded_by" not in e
        ),
    }


# -- set-up -----------------------------------------------------------------------------------
class Rig:
    """An in-process sender, optionally a proxy in front of it, receivers of any kind."""

    def __init__(self, tmp_path: Path, mode: str = "patch", config: dict[str, Any] | None = None) -> None:
        self.tmp, self.mode = tmp_path, mode
        self.syncer = CONFIGS[mode] if config is None else config
        self.trainer = Trainer()
        self.sender: Sender | None = None
        self.proxy: Proxy | None = None
        self.receivers: list[Receiver] = []
        self.watches: dict[str, Applied] = {}
        self.procs = Processes(tmp_path)
        self.config = tmp_path / f"{mode}.yaml"
        self.config.write_text(YAML[mode])

    async def start_sender(self, **kw: Any) -> Sender:
        self.sender = Sender("tcp://127.0.0.1:0", self.syncer, **{**DAEMON_KW, **kw})
        await asyncio.wait_for(self.sender.start(self.trainer.model, version=self.trainer.version), T)
        return self.sender

    async def start_proxy(
        self, tamper: Tamper | None = None, upstream: str | None = None, delay: float = 0.0, rate: float | None = None,
        upstream_waits: bool = False,
    ) -> Proxy:
        host, port = (upstream or self.endpoint).removeprefix("tcp://").rsplit(":", 1)
        self.proxy = await Proxy((host, int(port)), delay=delay, tamper=tamper, rate=rate, upstream_waits=upstream_waits).start()
        return self.proxy

    @property
    def endpoint(self) -> str:
        assert self.sender is not None
        return self.sender.endpoint

    async def receiver(self, identity: str, endpoint: str, *, start: bool = True, **kw: Any) -> Receiver:
        r = Receiver(receiver_model(), endpoint, self.syncer, identity=identity, **{**DAEMON_KW, **kw})
        self.receivers.append(r)
        self.watches[identity] = Applied(r, self.trainer)
        if start:
            await r.start(timeout=T)
        return r

    async def receiver_process(self, identity: str, endpoint: str) -> Proc:
        return await self.procs.spawn(
            identity, "receiver", "--endpoint", endpoint, "--model", MODEL, "--identity", identity, "--digest",
            "--save", str(self.tmp / f"{identity}-{len(self.procs.procs)}.pt"), "--config", str(self.config), *TIMING,
        )

    async def step(self, *, wait: bool = True) -> int:
        assert self.sender is not None
        version = await self.trainer.step_and_sync(self.sender)
        if wait:
            await self.converged(version)
        return version

    async def converged(self, version: int | None = None) -> None:
        """Every in-process receiver holds ``version`` (default: the trainer's), bit for bit."""
        version = self.trainer.version if version is None else version
        for r in self.receivers:
            await r.wait_for_version(version, timeout=T)
            async with r.reading():
                assert r.version == version, f"{r.identity} at v{r.version}, expected v{version}"
                bad = mismatches(self.trainer.expected[version], r.model.state_dict())
                assert not bad, f"{r.identity} differs from the trainer's v{version} at {bad[:5]}"
            await r.hooks_idle(T)  # its watch has seen every version published so far

    async def close(self) -> None:
        await self.procs.cleanup()
        for r in self.receivers:
            await asyncio.wait_for(r.close(), T)
        if self.proxy is not None:
            await self.proxy.close()
        if self.sender is not None:
            await asyncio.wait_for(self.sender.close(), T)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    r = Rig(tmp_path)
    try:
        yield r
    finally:
        await r.close()


async def process_converged(proc: Proc, trainer: Trainer, version: int) -> None:
    event = await proc.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version)
    assert event["digest"] == trainer.digests[version], f"{proc.name} applied v{version} with another digest"


async def stop_and_compare(proc: Proc, trainer: Trainer, save: Path) -> None:
    """SIGTERM: the receiver process saves its state dict, which must be the trainer's, bit for bit."""
    assert await proc.terminate() == 0, proc.tail()
    stopped = await proc.wait_event(lambda e: e.get("event") == "stopped")
    assert stopped["version"] == trainer.version
    saved = torch.load(save, map_location="cpu", weights_only=True)
    bad = mismatches(trainer.expected[trainer.version], saved)
    assert not bad, f"{proc.name}'s saved state differs from the trainer's v{trainer.version} at {bad[:5]}"
    for event in proc.applied():
        assert event["digest"] == trainer.digests[event["version"]], f"{proc.name} reported v{event['version']} with a wrong digest"


def saved_path(rig: Rig, proc: Proc) -> Path:
    index = rig.procs.procs.index(proc)
    return rig.tmp / f"{proc.name}-{index}.pt"


# -- the wire corrupts payload bytes ----------------------------------------------------------
PATCH, BUCKET, BOOTSTRAP = MessageType.PATCH.value, MessageType.BUCKET.value, MessageType.BOOTSTRAP.value


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_corrupted_payload_is_caught_nacked_and_resynced(mode: str, tmp_path: Path, reliability: Any) -> None:
    """Bytes flipped inside the tensor buffers (header, sizes and frame count intact) of
    the messages of v2 and v4, to both receivers, are caught by the payload checksums,
    NACKed and resynced: no receiver ever publishes a version whose weights are not
    exactly the trainer's, and all end bit-identical to it."""
    rig = Rig(tmp_path, mode)
    try:
        await rig.start_sender()
        data = PATCH if mode == "patch" else BUCKET
        tamper = Corrupt(lambda w: w.type == data and w.version in {2, 4} and len(w.frames) > 1, limit=None, offsets=(0.25, 0.75))
        proxy = await rig.start_proxy(tamper)
        for name in ("r0", "r1"):
            await rig.receiver(name, proxy.endpoint)
        await rig.converged(0)
        for _ in range(6):
            await rig.step()
        figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
        caught = {name: nacks(w.receiver).get("IntegrityError", 0) for name, w in rig.watches.items()}
        figures.update(corrupted_messages=tamper.hits, integrity_errors_caught=caught)
        reliability.record(**figures)
        assert tamper.hits >= 4, tamper.log
        for name in rig.watches:
            assert caught[name] >= 2 and figures["resyncs"][name] >= 2, figures
        assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures
    finally:
        await rig.close()


@pytest.mark.timeout(60)
async def test_corrupted_resync_is_nacked_again(tmp_path: Path, reliability: Any) -> None:
    """v2's patch is corrupted, and so is the resync bootstrap the NACK brings: the
    receiver must reject that one too and ask again, and converge on the third try."""
    rig = Rig(tmp_path, "patch")
    try:
        await rig.start_sender()
        tamper = Corrupt(_resync_selector(PATCH), limit=None)
        proxy = await rig.start_proxy(tamper)
        r = await rig.receiver("r0", proxy.endpoint)
        await rig.converged(0)
        await rig.step()
        await rig.trainer.step_and_sync(rig.sender)
        try:
            await r.wait_for_version(2, timeout=2 * PEER_TIMEOUT + 1)  # a timeout here is the bug, not slowness
        finally:
            figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
            figures.update(corrupted_messages=tamper.hits, integrity_errors_caught=nacks(r).get("IntegrityError", 0))
            reliability.record(**figures)
        await rig.converged()
    finally:
        await rig.close()


def _resync_selector(data: int) -> Any:
    """v2's data message, and the first resync bootstrap after it, per connection."""
    state: dict[int, set[str]] = {}

    def select(w: Wire) -> bool:
        done = state.setdefault(w.connection, set())
        if len(w.frames) < 2:
            return False
        if w.type == data and w.version == 2 and "data" not in done:
            done.add("data")
            return True
        if w.type == BOOTSTRAP and "data" in done and "resync" not in done:
            done.add("resync")
            return True
        return False

    return select


@pytest.mark.timeout(90)
async def test_resyncs_refused_again_and_again_are_bounded(rig: Rig, reliability: Any) -> None:
    """v2's patch is corrupted, and so is every resync bootstrap after it (its last
    bucket, so each resync costs one NACK): the sender spaces the resyncs out and sends
    ``max_resyncs`` of them, then drops the receiver with a ``ResyncLimitError``, which the
    receiver stops with, holding v1 whole. The sender serves the next receiver as usual."""
    sender = await rig.start_sender(max_resyncs=3, resync_backoff=(0.01, 0.04))
    tamper = Corrupt(_refused_forever(PATCH), limit=None)
    proxy = await rig.start_proxy(tamper)
    r = await rig.receiver("r0", proxy.endpoint)
    await rig.converged(0)
    await rig.step()
    await rig.trainer.step_and_sync(sender)
    with pytest.raises(WeightSyncError) as stopped:  # unbounded, this waits for v2 until T
        await r.wait_for_version(2, timeout=T)
    figures = in_process_figures(rig.trainer, sender, rig.watches)
    figures.update(corrupted_messages=tamper.hits, nacks_by_reason=nacks(r))
    reliability.record(**figures)
    assert isinstance(stopped.value.__cause__, ResyncLimitError), stopped.value
    assert tamper.hits == 1 + 3 and nacks(r) == {"IntegrityError": 4}, figures  # the patch, then 3 resyncs
    assert "r0" not in sender.receivers and not r.healthy
    assert str(r.status()["error"]).startswith("ResyncLimitError: sender reported: receiver r0 refused 3 resyncs in a row")
    assert r.version == 1 and state_digest(r.model.state_dict()) == rig.trainer.digests[1]
    assert figures["wrong_versions_published"] == 0, figures
    other = await rig.receiver("r1", rig.endpoint)  # straight to the sender: it carries on
    await other.wait_for_version(2, timeout=T)
    await assert_matches(other, rig.trainer, 2)


def _refused_forever(data: int) -> Any:
    """v2's data message, and the last bucket of every resync bootstrap after it, per connection."""
    after: set[int] = set()

    def select(w: Wire) -> bool:
        if len(w.frames) < 2 or w.header is None:
            return False
        if w.type == data and w.version == 2:
            after.add(w.connection)
            return True
        return w.type == BOOTSTRAP and w.connection in after and w.header.get("last") is True

    return select


@pytest.mark.timeout(60)
async def test_a_failed_pump_fails_the_sender_and_drops_its_receiver(rig: Rig) -> None:
    """A bug in serving one receiver (here the resync that v2's corrupted patch asks for
    cannot be built: an injected RuntimeError) must not vanish with its task: the receiver
    is dropped, and the error reaches the sender's owner, from ``wait_acked`` and ``sync``.
    (The pump task caught only PeerGone and was not kept: it died silently, the receiver
    stayed registered and heartbeated, and ``wait_acked(2)`` waited forever.)"""
    sender = await rig.start_sender()
    proxy = await rig.start_proxy(Corrupt(lambda w: w.type == PATCH and w.version == 2 and len(w.frames) > 1))
    r = await rig.receiver("r0", proxy.endpoint)
    await rig.converged(0)
    await rig.step()

    async def broken() -> list[Any]:
        raise RuntimeError("the resync could not be built")

    sender.server.resync_messages = broken  # type: ignore[method-assign]
    await rig.trainer.step_and_sync(sender)
    with pytest.raises(WeightSyncError, match="could not be built") as failed:
        await sender.wait_acked(2, timeout=T)
    assert isinstance(failed.value.__cause__, RuntimeError) and sender.failure is failed.value.__cause__
    assert "r0" not in sender.receivers
    rig.trainer.step()
    with pytest.raises(WeightSyncError, match="could not be built"):
        await sender.sync(rig.trainer.model, 3)
    assert r.version == 1 and state_digest(r.model.state_dict()) == rig.trainer.digests[1]


@dataclass
class CorruptThenStall(Stall):
    """Corrupt what ``corrupt`` selects; stall (as ``Stall``) what ``select`` selects."""

    corrupt: Corrupt = field(default_factory=lambda: Corrupt(lambda w: False))

    def emit(self, w: Wire) -> list[Wire]:
        return self.corrupt.emit(w)


@pytest.mark.timeout(60)
async def test_load_instant_torn_version_keeps_readers_out_and_is_resynced(tmp_path: Path, reliability: Any) -> None:
    """bucket.load_instant writes each bucket as it arrives. v2's second bucket is
    corrupted on the wire when its first is already in the model: the receiver now holds
    no whole version, so it keeps its write side (readers wait), says it is at no version,
    publishes nothing and NACKs; the resync (held half-way on the wire here, to look at
    the torn receiver) is written over it and published as v2, bit for bit."""
    rig = Rig(tmp_path, "bucket")
    try:
        sender = await rig.start_sender()
        corrupt = Corrupt(lambda w: w.type == BUCKET and w.version == 2 and (w.header or {}).get("part") == 1 and len(w.frames) > 1)
        tamper = CorruptThenStall(lambda w: w.type == BOOTSTRAP and corrupt.hits == 1 and len(w.frames) > 1, corrupt=corrupt)
        proxy = await rig.start_proxy(tamper)
        r = await rig.receiver("r0", proxy.endpoint)
        await rig.converged(0)
        await rig.step()
        await rig.trainer.step_and_sync(sender)
        await asyncio.wait_for(tamper.stalled.wait(), T)  # the NACK came, its resync is half-way here
        assert corrupt.hits == 1 and r.strategy.torn and r.version is None
        readable = r.lock.acquire_read(blocking=False)
        if readable:
            r.lock.release_read()
        assert not readable, "readers were let into a torn model"
        assert rig.watches["r0"].versions == [0, 1], rig.watches["r0"].log
        tamper.release()
        await rig.converged(2)
        figures = in_process_figures(rig.trainer, sender, rig.watches)
        figures.update(corrupted_messages=corrupt.hits, nacks_by_reason=nacks(r))
        reliability.record(**figures)
        assert rig.watches["r0"].log[-1] == (2, "bootstrap") and not r.strategy.torn
        assert nacks(r) == {"IntegrityError": 1} and figures["wrong_versions_published"] == 0, figures
        await rig.step()
    finally:
        await rig.close()


@pytest.mark.timeout(60)
async def test_racing_syncs_the_stale_one_is_refused(rig: Rig) -> None:
    """``sync(6)`` and ``sync(5)`` at once: the one that waited for the lock is checked
    under it, so ``sync(5)`` is a ``StaleVersionError`` and changes nothing. (Checked
    before the lock, both succeeded and the sender ended at v5, sending "v5 on base v6",
    which the receiver NACKed and the resync to v5 too, in a loop.)"""
    sender = await rig.start_sender()
    r = await rig.receiver("r0", rig.endpoint)
    for _ in range(4):
        await rig.step()
    rig.trainer.step()
    rig.trainer.step()  # the model is at v6
    model = rig.trainer.model
    first, second = await asyncio.wait_for(asyncio.gather(sender.sync(model, 6), sender.sync(model, 5), return_exceptions=True), T)
    assert isinstance(first, SyncStats) and first.version == 6, first
    assert isinstance(second, StaleVersionError) and (second.current, second.got) == (6, 5), second
    assert sender.version == 6
    await rig.converged(6)
    await rig.step()  # v7 follows as a patch on v6
    assert rig.watches["r0"].log[-2:] == [(6, "patch"), (7, "patch")], rig.watches["r0"].log
    assert sender.receivers["r0"]["resyncs"] == 0 and not nacks(r)


# -- duplicated, replayed, reordered messages on the wire -------------------------------------
def _wire_tamper(kind: str) -> Tamper:
    patches = of_type(PATCH, payload=True)
    if kind == "duplicated":
        return Duplicate(lambda w: patches(w) and w.version == 2)
    if kind == "replayed":  # v2's patch again, a few messages (heartbeats included) later: stale by then
        return Replay(lambda w: patches(w) and w.version == 2, after=3)
    return Reorder(lambda w: patches(w) and w.version in (3, 4), limit=1)  # v4 arrives before v3


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", ["duplicated", "replayed", "reordered"])
async def test_duplicated_replayed_reordered_patches_on_the_wire(kind: str, rig: Rig, reliability: Any) -> None:
    """The daemons over a wire that repeats or reorders the sender's patch messages (the
    strategy-level cases are in test_atomicity.py): a repeated version is never applied
    twice, a patch on the wrong base never applied at all; resyncs repair the gap."""
    await rig.start_sender(max_inflight=4)  # room for two patches in flight, so they can be swapped
    tamper = _wire_tamper(kind)
    proxy = await rig.start_proxy(tamper)
    for name in ("r0", "r1"):
        await rig.receiver(name, proxy.endpoint)
    await rig.converged(0)
    await rig.step()
    for _ in range(4):  # back to back: several versions on the wire at once
        await rig.step(wait=False)
    await rig.converged()
    for _ in range(2):
        await rig.step()
    figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
    figures.update(tampered_messages=tamper.hits, nacks_by_reason={n: nacks(w.receiver) for n, w in rig.watches.items()})
    reliability.record(**figures)
    assert tamper.hits >= 1, tamper.log
    for name, w in rig.watches.items():
        versions = [v for v in w.versions if v is not None]
        patches = [v for v, kind in w.log if kind == "patch"]
        assert len(patches) == len(set(patches)), f"{name} applied a patch twice: {w.log}"
        assert versions == sorted(versions), f"{name} went backwards: {w.log}"
    assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures
    if kind != "reordered":  # a version the receiver already holds is dropped: nothing to NACK, nothing to resync
        assert all(not nacks(w.receiver) for w in rig.watches.values()), figures
        assert all(p["resyncs"] == 0 for p in rig.sender.receivers.values()), rig.sender.receivers



@pytest.mark.timeout(90)
async def test_connections_reset_mid_stream_converge(rig: Rig, reliability: Any) -> None:
    """The proxy resets every TCP connection (RST both ways) three times while versions
    are in flight: messages queued for a dropped connection are lost, ZeroMQ reconnects
    underneath, and the receivers catch up from the ring or by a resync."""
    await rig.start_sender(max_inflight=4)
    proxy = await rig.start_proxy()
    for name in ("r0", "r1"):
        await rig.receiver(name, proxy.endpoint)
    await rig.converged(0)
    for _ in range(3):
        for _ in range(2):
            await rig.step(wait=False)
        await wait_until(lambda: proxy.open_connections == 2)  # both (re)connected
        proxy.sever()
    await rig.converged()
    for _ in range(2):
        await rig.step()
    figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
    figures.update(connections_reset=proxy.stats.severed, connections=proxy.stats.connections)
    reliability.record(**figures)
    assert proxy.stats.severed == 6 and proxy.stats.connections >= 8
    assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures

# -- a slow link: one message takes longer than peer_timeout ----------------------------------
SLOW_TIMEOUT = 1.0  # the receivers' peer_timeout in these tests
SLOW_RATE = 96 << 10  # bytes a second the proxy forwards to the receiver
ONE_BUCKET = {  # the tiny model's bootstrap, and a bucket version, in one message each
    "patch": {"type": "patch", "patch": {"init_sync": {"bucket_size": 1 << 20}}},
    "bucket": {"type": "bucket", "bucket": {"bucket_size": 1 << 20}},
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("held", [False, True], ids=["heartbeats-through", "heartbeats-held"])
@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_a_message_slower_than_peer_timeout_is_waited_for_while_it_arrives(
    mode: str, held: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reliability: Any,
) -> None:
    """ZeroMQ hands a message over only once all of it is in, and the sender's heartbeats
    queue behind it: a bootstrap bucket or a version that takes longer than peer_timeout
    on the link used to read as silence, so the receiver reconnected, and the next copy
    was as slow, forever. Bytes still arriving are not silence: the receiver joins and
    follows with no reconnect. The handshake's own bound is cut to peer_timeout here, so
    it is crossed too.

    ``held``: the other direction. On a shaped link with a deep queue, the
    acknowledgements the receiver's TCP waits for sit behind the message it is receiving,
    so its heartbeats reach the sender only after it (the proxy holds them while the
    sender's bytes are still being forwarded). The sender, its peer_timeout cut to 1 s
    too, used to drop the receiver as silent mid-message, and it reconnected; the
    receiver's kernel acknowledging the sender's bytes is life."""
    monkeypatch.setattr(receiver_follower, "HANDSHAKE_GRACE", 0.0)
    rig = Rig(tmp_path, mode, ONE_BUCKET[mode])
    try:
        await rig.start_sender(**({"peer_timeout": SLOW_TIMEOUT} if held else {}))
        proxy = await rig.start_proxy(rate=SLOW_RATE, upstream_waits=held)
        with caplog.at_level(logging.INFO, logger="protocol.net.server"):
            r = await rig.receiver("slow", proxy.endpoint, peer_timeout=SLOW_TIMEOUT)
            boot = proxy.stats.largest
            await rig.converged(0)
            for _ in range(2):
                await rig.step()
        figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
        drops = [rec.getMessage() for rec in caplog.records if "dropped: silent" in rec.getMessage()]
        figures.update(rate_Bps=SLOW_RATE, peer_timeout_s=SLOW_TIMEOUT, bootstrap_message_s=round(boot / SLOW_RATE, 2),
                       largest_message_s=round(proxy.stats.largest / SLOW_RATE, 2), dropped_as_silent=len(drops))
        reliability.record(**figures)
        assert boot / SLOW_RATE > 2 * SLOW_TIMEOUT, "the bootstrap must be a message slower than peer_timeout"
        assert not drops and r.reconnects == 0, figures
        assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures
    finally:
        await rig.close()


@pytest.mark.timeout(90)
async def test_a_message_stalled_on_the_wire_is_still_silence(rig: Rig, reliability: Any) -> None:
    """The other side of the test above: half a message, then nothing (a sender host gone,
    a route lost). No byte arrives, so peer_timeout still ends the session; once the
    stream moves again the receiver is back on the current version."""
    await rig.start_sender()
    stall = Stall(lambda w: w.type == PATCH and w.version == 1, fraction=0.5)
    proxy = await rig.start_proxy(stall)
    r = await rig.receiver("r0", proxy.endpoint)
    await rig.converged(0)
    await rig.step(wait=False)
    await asyncio.wait_for(stall.stalled.wait(), T)
    await wait_until(lambda: r.reconnects >= 1, timeout=T)
    stall.release()
    await rig.converged()
    await rig.step()
    figures = in_process_figures(rig.trainer, rig.sender, rig.watches)
    reliability.record(**figures)
    assert figures["reconnects"]["r0"] >= 1
    assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures


# -- kill -9 of a receiver process mid-bootstrap and mid-patch ----------------------------------
@pytest.mark.timeout(90)
@pytest.mark.parametrize("during", ["bootstrap", "patch"])
async def test_receiver_killed_mid_message_and_restarted(during: str, rig: Rig, reliability: Any) -> None:
    """``python -m receiver`` is SIGKILLed while a bootstrap bucket (the second of its
    init bootstrap) or a patch is half-way through the wire to it; the trainer and the
    other receiver go on; the victim restarted under its identity converges."""
    sender = await rig.start_sender()
    bystander = await rig.receiver("bystander", rig.endpoint)  # straight to the sender
    if during == "bootstrap":
        stall = Stall(lambda w: w.type == BOOTSTRAP and len(w.frames) > 1 and w.header is not None and w.header.get("part") == 1, finish=False)
    else:
        stall = Stall(lambda w: w.type == PATCH and w.version == 2, finish=False)
    proxy = await rig.start_proxy(stall)
    victim = await rig.receiver_process("victim", proxy.endpoint)
    if during == "patch":
        await process_converged(victim, rig.trainer, 0)
        await rig.step()
        await process_converged(victim, rig.trainer, 1)
        await rig.step(wait=False)
    await asyncio.wait_for(stall.stalled.wait(), T)
    await victim.kill()  # mid-message: half of it is in the victim's socket
    stall.release()
    before = max((e["version"] for e in victim.applied()), default=None)
    for _ in range(2):
        await rig.step()  # the bystander goes on
    again = await rig.receiver_process("victim", proxy.endpoint)  # same identity, initial weights again
    await process_converged(again, rig.trainer, rig.trainer.version)
    for _ in range(2):
        await rig.step()
        await process_converged(again, rig.trainer, rig.trainer.version)
    await stop_and_compare(again, rig.trainer, saved_path(rig, again))
    figures = in_process_figures(rig.trainer, sender, rig.watches)
    victims = process_figures(rig.trainer, {"victim-before-kill": victim, "victim-restarted": again})
    figures.update(
        killed_during="bootstrap of v0, bucket 2" if during == "bootstrap" else "patch v2",
        victim_version_at_kill=before, victim=victims, victim_final_digest_equal=True, stalled_messages=stall.hits,
    )
    reliability.record(**figures)
    assert stall.hits == 1
    assert before == (None if during == "bootstrap" else 1), victim.applied()  # nothing half-applied was published
    assert victims["wrong_versions_published"] == 0
    assert figures["final_digests_equal"], figures
    assert bystander.version == rig.trainer.version


# -- kill -9 of the sender process mid-sync ---------------------------------------------------
@pytest.mark.timeout(90)
async def test_sender_killed_mid_sync_and_restarted(rig: Rig, tmp_path: Path, reliability: Any) -> None:
    """``python -m sender`` is SIGKILLed while v2's patch is half-way to one receiver (the
    other, connected directly, may already hold v2). Both keep serving the version they
    had, whole, through a silence longer than the peer timeout; the restarted sender
    (newest checkpoint, v3) brings both to v3 and on."""
    trainer, watch = rig.trainer, tmp_path / "ckpt"
    watch.mkdir()
    trainer.save(watch)
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"

    async def start_sender() -> Proc:
        proc = await rig.procs.spawn(
            "sender", "sender", "--watch", str(watch), "--model", MODEL, "--endpoint", endpoint, "--config", str(rig.config), *TIMING,
        )
        await proc.wait_event(lambda e: e.get("event") == "listening")
        return proc

    sender = await start_sender()
    stall = Stall(lambda w: w.type == PATCH and w.version == 2, finish=False)
    proxy = await rig.start_proxy(stall, upstream=endpoint)
    r0 = await rig.receiver("r0", proxy.endpoint)
    r1 = await rig.receiver("r1", endpoint)

    async def step() -> None:
        trainer.step()
        trainer.save(watch)

    await rig.converged(0)
    await step()
    await rig.converged(1)
    await step()
    await asyncio.wait_for(stall.stalled.wait(), T)
    await sender.kill()  # mid-sync: v2 is half-way to r0
    stall.release()
    await step()  # v3 is written while no sender is up
    await asyncio.sleep(PEER_TIMEOUT + 0.5)
    held = {}
    for r in (r0, r1):  # both still serve a whole version
        assert r.healthy
        async with r.reading():
            held[r.identity] = r.version
            assert r.version in (1, 2) and state_digest(r.model.state_dict()) == trainer.digests[r.version]
    assert held["r0"] == 1  # the half patch was never applied
    restarted = await start_sender()
    await rig.converged(3)
    for _ in range(2):
        await step()
        await rig.converged()
    figures = in_process_figures(trainer, None, rig.watches)
    synced = [e for e in restarted.events if e.get("event") == "synced"]
    figures.update(
        versions_held_while_down=held,
        resyncs={name: info["resyncs"] for name, info in synced[-1]["receivers"].items()} if synced else {},
    )
    reliability.record(**figures)
    assert all(r.reconnects >= 1 for r in (r0, r1))
    assert figures["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures
    assert await restarted.terminate() == 0


# -- a frozen receiver process while the trainer keeps syncing ---------------------------------
@pytest.mark.timeout(90)
async def test_frozen_receiver_never_blocks_sync_and_catches_up(rig: Rig, reliability: Any) -> None:
    """A ``python -m receiver`` process is SIGSTOPped (it reads nothing, acks nothing) while
    the in-process trainer syncs eight more versions, more than the sender's ring and
    credits hold: every ``sync()`` returns (each under ``T``, the only bound asserted),
    the fast receiver follows each version; after SIGCONT the frozen one catches up."""
    sender = await rig.start_sender(ring_size=3, max_inflight=1)
    fast = await rig.receiver("fast", rig.endpoint)
    slow = await rig.receiver_process("slow", rig.endpoint)
    await process_converged(slow, rig.trainer, 0)
    await rig.step()
    await process_converged(slow, rig.trainer, 1)
    sync_seconds: list[float] = []
    slow.process.send_signal(signal.SIGSTOP)
    try:
        for _ in range(8):
            began = time.perf_counter()
            await rig.step(wait=False)  # sync() under wait_for(T): a blocked sync fails the test
            sync_seconds.append(time.perf_counter() - began)
            await rig.converged()
    finally:
        slow.process.send_signal(signal.SIGCONT)
    await process_converged(slow, rig.trainer, rig.trainer.version)
    await rig.step()
    await process_converged(slow, rig.trainer, rig.trainer.version)
    peers = sender.receivers  # before the slow one says goodbye
    await stop_and_compare(slow, rig.trainer, saved_path(rig, slow))
    figures = in_process_figures(rig.trainer, sender, rig.watches)
    figures.update(
        slow=process_figures(rig.trainer, {"slow": slow}),
        slow_versions_skipped=rig.trainer.version + 1 - len({e["version"] for e in slow.applied()}),
        slow_resyncs=peers.get("slow", {}).get("resyncs"),
        max_sync_seconds_while_frozen=round(max(sync_seconds), 3),
    )
    reliability.record(**figures)
    assert figures["slow"]["wrong_versions_published"] == 0 and figures["final_digests_equal"], figures
    assert fast.version == rig.trainer.version


# -- load: 16 receivers x 100 versions --------------------------------------------------------
RECEIVERS, VERSIONS = 16, 100


@pytest.mark.timeout(120)
async def test_sixteen_receivers_one_hundred_versions(rig: Rig, reliability: Any) -> None:
    """16 in-process receivers over TCP loopback, 100 real optimizer steps synced back to
    back (the trainer waits for nobody; the ring holds every version, so no receiver needs
    a resync): each receiver commits every version exactly once, in order, each one
    checked against the trainer's digest the moment it is published."""
    sender = await rig.start_sender(ring_size=VERSIONS + 1, ring_bytes=1 << 40, max_inflight=4)  # no byte cap either
    receivers = [await rig.receiver(f"r{i:02d}", rig.endpoint) for i in range(RECEIVERS)]
    await sender.wait_acked(0, timeout=T)
    began = time.perf_counter()
    for _ in range(VERSIONS):
        await rig.step(wait=False)
    await sender.flush()
    await sender.wait_acked(VERSIONS, timeout=4 * T)
    seconds = time.perf_counter() - began
    await rig.converged(VERSIONS)
    figures = in_process_figures(rig.trainer, sender, rig.watches)
    lost = {r.identity: sorted(set(range(VERSIONS + 1)) - set(rig.watches[r.identity].versions)) for r in receivers}
    figures = {
        "receivers": RECEIVERS,
        "versions_published": VERSIONS,
        "versions_applied_min": min(figures["applied"].values()),
        "versions_applied_max": max(figures["applied"].values()),
        "versions_lost": sum(len(v) for v in lost.values()),
        "half_applied": figures["wrong_versions_published"],
        "resyncs": sum(figures["resyncs"].values()),
        "nacks": sum(figures["nacks"].values()),
        "reconnects": sum(figures["reconnects"].values()),
        "final_digests_equal": figures["final_digests_equal"],
        "seconds": round(seconds, 1),
    }
    reliability.record(**figures)
    for r in receivers:
        assert rig.watches[r.identity].versions == list(range(VERSIONS + 1)), f"{r.identity}: {rig.watches[r.identity].log}"
    assert figures["versions_lost"] == 0 and figures["half_applied"] == 0 and figures["final_digests_equal"], figures
