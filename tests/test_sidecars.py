"""Sidecar hand-off through shared memory: trainer -> sender sidecar, receiver sidecar -> engine.

Unit tests of ``protocol/host/shm.py`` (manifest, seqlock, crashed writers, cleanup), of the
``ipc_snapshot`` files, of the client/sidecar handshake (in-process, real sockets and
regions), and one run of real processes: a trainer publishing real AdamW steps through
``SidecarClient``, a ``python -m sender --shm`` sidecar (killed and restarted midway),
and two rollout engines, each mapped onto the region of its own ``python -m receiver
--shm`` sidecar, reading in a loop the whole time. Every read an engine makes must be one
whole version: its digest must be the trainer's for that version. Then ``ipc_snapshot``
on the rollout side: a receiver sidecar reloading snapshot files, rejecting one that does
not fit, and SIGKILLed and restarted under an engine that stays attached. No region may
outlive its test.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from daemon_helpers import HEARTBEAT, PEER_TIMEOUT, ROOT, YAML, Proc, Processes, Trainer, bf16_state, wait_until

from examples.tiny_model import build
from protocol.errors import MetadataMismatchError, ProtocolError, SharedMemoryError, StaleVersionError, TransportError
from protocol.host.shm import Layout, Region, leftover_regions, region_path, shm_dir
from protocol.host.snapfile import read_snapshot, snapshot_path, write_snapshot
from protocol.wire.checksum import state_digest
from receiver.control.attach import attach, engine_region
from sender.serve.client import SidecarClient
from sender.serve.sidecar import serve_shm

TIMING = ["--heartbeat", str(HEARTBEAT), "--peer-timeout", str(PEER_TIMEOUT)]
T = 30.0
STARTUP = 120.0  # six processes importing torch at once on two busy cores: slow, never hung


@pytest.fixture
def prefix() -> Iterator[str]:
    """A unique region-name prefix; the test fails if any region under it outlives it."""
    p = f"wstest-{uuid.uuid4().hex[:8]}"
    yield p
    left = leftover_regions(p)
    for name in left:  # clean up for the next run, then fail
        (shm_dir() / name).unlink(missing_ok=True)
    assert not left, f"leaked shared-memory regions: {left}"


def bf16_model(seed: int = 99) -> torch.nn.Module:
    return build(seed=seed).to(torch.bfloat16)


# -- protocol/host/shm.py -----------------------------------------------------------------------------
def test_region_round_trip_tied_weights_and_unlink(prefix: str) -> None:
    state = build(seed=3).state_dict()
    layout = Layout.of(state)
    assert layout.get("head.weight").offset == layout.get("embed.weight").offset  # tied: one place
    with Region.create(f"{prefix}-a", layout) as owner:
        assert owner.version is None and owner.seq == 0
        with owner.writing(5):
            assert owner.seq % 2 == 1
            owner.load(state)
        reader = Region.attach(f"{prefix}-a")
        views = reader.tensors()
        assert reader.version == 5 and reader.seq == 2
        assert views["embed.weight"].data_ptr() == views["head.weight"].data_ptr()
        assert state_digest(views) == state_digest(state)
        with reader.reading() as version:
            assert version == 5
        assert reader.read_consistent(lambda: views["steps"].clone())[0] == 5
        reader.close()  # an attacher only unmaps
        assert leftover_regions(prefix) == [f"{prefix}-a"]
    assert leftover_regions(prefix) == []
    assert reader.closed  # the owner marked it on unlink


def test_manifest_mismatch_names_the_key_and_leaves_the_module_alone(prefix: str) -> None:
    model = bf16_model()
    region = engine_region(model, f"{prefix}-m")
    try:
        assert model.embed.weight.data_ptr() == region.tensors()["embed.weight"].data_ptr()
        assert model.head.weight is model.embed.weight  # still tied after binding
        wrong = build(seed=1)  # fp32: the engine must be built at the receiver's dtype
        before = wrong.embed.weight.data_ptr()
        with pytest.raises(MetadataMismatchError, match=r"dtype torch\.float32"):
            attach(wrong, f"{prefix}-m")
        assert wrong.embed.weight.data_ptr() == before
        other = build(seed=1, dim=32).to(torch.bfloat16)
        with pytest.raises(MetadataMismatchError, match="shape"):
            attach(other, f"{prefix}-m")
        with pytest.raises(MetadataMismatchError, match="'extra'"):
            Layout.of(model.state_dict()).check({**model.state_dict(), "extra": torch.zeros(1)})
    finally:
        region.close()


def test_hostile_regions_are_rejected(prefix: str) -> None:
    path = region_path(f"{prefix}-junk")
    path.write_bytes(b"not a region" * 100)
    try:
        with pytest.raises(SharedMemoryError, match="not a weightsync region"):
            Region.attach(f"{prefix}-junk")
    finally:
        path.unlink()
    with pytest.raises(SharedMemoryError, match="no shared-memory region"):
        Region.attach(f"{prefix}-missing", timeout=0.05)
    with pytest.raises(SharedMemoryError, match="bad region name"):
        Region.attach("../etc/passwd")
    bad = Layout.of({"w": torch.zeros(4)}).to_bytes().replace(b"\x04", b"\x40")  # shape 4 -> 64: past the end
    with pytest.raises(SharedMemoryError):
        Layout.from_bytes(bad, 64)


def test_seqlock_writer_waits_for_readers_and_readers_for_the_writer(prefix: str) -> None:
    owner = Region.create(f"{prefix}-s", Layout.of({"w": torch.zeros(1000)}))
    reader = Region.attach(f"{prefix}-s")  # its own file description: flocks conflict as across processes
    w = reader.tensors()["w"]
    inside_write = threading.Event()
    done = threading.Event()

    def write(version: int) -> None:
        with owner.writing(version):
            inside_write.set()
            owner.tensors()["w"].fill_(version)
            time.sleep(0.05)
        done.set()

    try:
        with reader.reading() as version:
            writer = threading.Thread(target=write, args=(1,))
            writer.start()
            time.sleep(0.1)
            assert not inside_write.is_set(), "a writer entered while a reader held the version"
            assert version is None
        writer.join(T)
        assert done.is_set() and reader.version == 1 and bool((w == 1).all())
        # lock-free reads retry across a write: every copy is one whole version
        writer = threading.Thread(target=write, args=(2,))
        writer.start()
        seen = []
        while not done.is_set() or not seen:
            version, copy = reader.read_consistent(lambda: w.clone(), timeout=T)
            seen.append(version)
            assert bool((copy == version).all()), f"a copy mixed versions: {copy.unique()} at v{version}"
        writer.join(T)
        assert reader.read_consistent(lambda: None)[0] == 2
    finally:
        reader.close()
        owner.close()


def test_a_writer_that_crashes_mid_write_leaves_the_region_torn_until_rewritten(prefix: str) -> None:
    name = f"{prefix}-c"
    owner = Region.create(name, Layout.of({"w": torch.zeros(8)}))
    try:
        with owner.writing(1):
            owner.tensors()["w"].fill_(1)
        crash = (
            f"import os; from protocol.host.shm import Region; r = Region.attach({name!r})\n"
            "ctx = r.writing(2); ctx.__enter__(); r.tensors()['w'][:4] = 2; os._exit(9)"
        )
        assert subprocess.run([sys.executable, "-c", crash], cwd=ROOT, timeout=T).returncode == 9
        assert owner.seq % 2 == 1 and owner.version == 1  # the kernel dropped its flock; seq says torn
        with pytest.raises(SharedMemoryError, match="torn"), owner.reading(timeout=0.1):
            pass
        with pytest.raises(SharedMemoryError, match="no consistent read"):
            owner.read_consistent(lambda: None, timeout=0.1)
        with owner.writing(3):  # a complete write repairs it
            owner.tensors()["w"].fill_(3)
        with owner.reading(timeout=1) as version:
            assert version == 3 and owner.seq % 2 == 0
        with pytest.raises(RuntimeError), owner.writing(4):  # a write that fails part way stays torn
            raise RuntimeError("boom")
        assert owner.seq % 2 == 1 and owner.version == 3
    finally:
        owner.close()


def test_create_replaces_or_adopts_a_leftover(prefix: str) -> None:
    name = f"{prefix}-l"
    layout = Layout.of({"w": torch.zeros(4)})
    killed = Region.create(name, layout)
    with killed.writing(7):
        killed.tensors()["w"].fill_(7)
    killed._finalizer.detach()  # as if SIGKILLed: nobody unlinks it
    engine = Region.attach(name)
    adopted = Region.create(name, layout, adopt=True)  # a restarted receiver sidecar: same layout
    assert adopted.generation == engine.generation and adopted.version == 7 and not engine.closed
    adopted._finalizer.detach()
    replaced = Region.create(name, Layout.of({"w": torch.zeros(5)}), adopt=True)  # another layout: replaced
    assert replaced.generation != engine.generation and replaced.version is None and engine.closed
    for r in (engine, replaced, adopted, killed):
        r.close()


def test_ipc_snapshot_files_are_atomic_and_checked(tmp_path: Path, prefix: str) -> None:
    trainer = build(seed=7)
    path = write_snapshot(trainer.state_dict(), tmp_path, 3)
    assert path == snapshot_path(tmp_path, 3) and [p.name for p in tmp_path.iterdir()] == ["step_3.safetensors"]
    region = engine_region(bf16_model(), f"{prefix}-f")
    try:
        version, tensors = read_snapshot(path, region.layout)
        assert version == 3
        with region.writing(version):
            region.load(tensors)
        assert state_digest(region.tensors()) == state_digest(bf16_state(trainer.state_dict()))
        wrong = build(seed=7, dim=32).state_dict()
        bad = write_snapshot(wrong, tmp_path, 4)
        with pytest.raises(MetadataMismatchError, match="shape"):
            read_snapshot(bad, region.layout)
        renamed = bad.with_name("step_5.safetensors")
        os.rename(bad, renamed)
        with pytest.raises(ProtocolError, match="does not say version 5"):
            read_snapshot(renamed)
    finally:
        region.close()


def test_sender_watch_mode_serves_safetensors_snapshots(tmp_path: Path) -> None:
    from sender.checkpoints import candidates, load

    model = build(seed=7)
    torch.save(model.state_dict(), tmp_path / "step_1.pt")
    write_snapshot(model.state_dict(), tmp_path, 2)
    found = candidates(tmp_path.iterdir(), 1)
    assert [v for v, _ in found] == [2]
    assert state_digest(load(found[0][1])) == state_digest(model.state_dict())


# -- the client / sidecar handshake, in one process ---------------------------------------------------
def sidecar_args(tmp_path: Path, shm: str, endpoint: str = "tcp://127.0.0.1:0") -> argparse.Namespace:
    import sender.__main__ as smain

    return smain.parse_args(["--shm", shm, "--handoff", f"ipc://{tmp_path}/ctl", "--endpoint", endpoint, *TIMING])


@pytest.mark.timeout(60)
async def test_client_handshake_and_typed_errors(tmp_path: Path, prefix: str) -> None:
    args = sidecar_args(tmp_path, f"{prefix}-t")
    stop = asyncio.Event()
    sidecar = asyncio.ensure_future(serve_shm(args, stop))
    trainer = Trainer(seed=7)
    try:
        with SidecarClient(args.handoff, args.shm, timeout=T) as client:
            await asyncio.to_thread(client.publish, trainer.model, 0)
            for _ in range(3):  # each publish waits for the previous collect: never faster than the sidecar
                await asyncio.to_thread(client.publish, trainer.model, trainer.step())
            await asyncio.to_thread(client.flush)
            assert client.collected == 3 and client.sidecar_session
            with pytest.raises(StaleVersionError):
                await asyncio.to_thread(client.publish, trainer.model, 3)
            with pytest.raises(MetadataMismatchError, match="shape"):
                await asyncio.to_thread(client.publish, build(seed=7, dim=32), 4)
        # a trainer restarted with another model under the same name: the sidecar refuses it
        with SidecarClient(args.handoff, args.shm, timeout=T) as other:
            await asyncio.to_thread(other.publish, build(seed=7, dim=32), 10)
            with pytest.raises(MetadataMismatchError, match="differs from the one this sidecar serves"):
                await asyncio.to_thread(other.flush)
        with pytest.raises(TimeoutError):  # nobody listening: a clear timeout, not a hang
            with SidecarClient(f"ipc://{tmp_path}/nobody", f"{prefix}-n", timeout=0.3, resend_interval=0.1) as lonely:
                await asyncio.to_thread(lonely.publish, trainer.model, 0)
                await asyncio.to_thread(lonely.flush)
    finally:
        stop.set()
        await asyncio.wait_for(sidecar, T)


@pytest.mark.timeout(60)
async def test_a_sidecar_whose_endpoint_is_taken_stops_with_a_transport_error(tmp_path: Path, prefix: str) -> None:
    """Its own socket failing is not the trainer's error to answer: the sidecar stops, the
    ``TransportError`` (ZeroMQ's EADDRINUSE its cause) says where."""
    holder = zmq.Context.instance().socket(zmq.ROUTER)
    holder.setsockopt(zmq.LINGER, 0)
    port = holder.bind_to_random_port("tcp://127.0.0.1")
    args = sidecar_args(tmp_path, f"{prefix}-b", endpoint=f"tcp://127.0.0.1:{port}")
    sidecar = asyncio.ensure_future(serve_shm(args, asyncio.Event()))
    try:
        with SidecarClient(args.handoff, args.shm, timeout=T) as client:
            await asyncio.to_thread(client.publish, Trainer(seed=7).model, 0)  # returns once copied: the sidecar binds now
            with pytest.raises(TransportError) as info:
                await asyncio.wait_for(sidecar, T)
            assert info.value.errno == errno.EADDRINUSE and f"tcp://127.0.0.1:{port}" in str(info.value)
            client.close(wait=False)
    finally:
        sidecar.cancel()
        holder.close()


# -- real processes -----------------------------------------------------------------------------------
async def command(proc: Proc, line: str) -> None:
    assert proc.process.stdin is not None
    proc.process.stdin.write(f"{line}\n".encode())
    await proc.process.stdin.drain()


def observed(proc: Proc, version: int) -> bool:
    return any(e.get("event") == "observed" and e.get("version") == version for e in proc.events)


@pytest.mark.timeout(480)
async def test_trainer_sidecars_and_engines_as_processes(tmp_path: Path, prefix: str, procs: Processes) -> None:
    config = tmp_path / "patch.yaml"
    config.write_text(YAML["patch"])
    trainer_shm, handoff, endpoint = f"{prefix}-trainer", f"ipc://{tmp_path}/handoff", f"ipc://{tmp_path}/weights"
    sender_cmd = ["--shm", trainer_shm, "--handoff", handoff, "--endpoint", endpoint, "--config", str(config), *TIMING]
    sender = await procs.spawn("sender", "sender", *sender_cmd)
    await sender.wait_event(lambda e: e.get("event") == "handoff", STARTUP)
    receivers, engines = {}, {}
    for i, mode in enumerate(["reading", "snapshot"]):
        shm = f"{prefix}-engine{i}"
        receivers[i] = await procs.spawn(
            f"r{i}", "receiver", "--endpoint", endpoint, "--model", "examples.tiny_model:build", "--identity", f"r{i}",
            "--digest", "--shm", shm, "--config", str(config), *TIMING,
        )
        engines[i] = await procs.spawn("engine", "examples.sidecars", "engine", "--shm", shm, "--mode", mode, "--timeout", str(STARTUP))
    trainer = await procs.spawn(
        "trainer", "examples.sidecars", "trainer", "--shm", trainer_shm, "--handoff", handoff, "--steps", "0", stdin=asyncio.subprocess.PIPE,
    )
    digests: dict[int, str] = {}

    async def step(version: int, *, command_sent: bool = False, timeout: float = T) -> None:
        if version and not command_sent:
            await command(trainer, "step")
        event = await trainer.wait_event(lambda e: e.get("event") == "published" and e.get("version") == version, timeout)
        digests[version] = event["digest"]
        for i in receivers:
            applied = await receivers[i].wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version, timeout)
            assert applied["digest"] == digests[version], f"receiver {i} applied v{version} with another digest"
            got = await engines[i].wait_event(lambda e: e.get("event") == "observed" and e.get("version") == version, timeout)
            assert got["digest"] == digests[version], f"engine {i} saw v{version} with another digest"

    await step(0, timeout=STARTUP)
    for version in (1, 2):
        await step(version)
    await sender.kill()  # SIGKILL, no goodbye: the trainer's region survives, the restarted sidecar maps it again
    await command(trainer, "step")  # v3: publish waits until a sidecar has collected v2 (its answer may be lost)
    sender = await procs.spawn("sender2", "sender", *sender_cmd)
    listening = await sender.wait_event(lambda e: e.get("event") == "listening", STARTUP)
    assert listening["version"] in (2, 3)  # resumed from the version the region holds
    await step(3, command_sent=True, timeout=STARTUP)
    await step(4)
    for version in (5, 6):
        await step(version)
    await command(trainer, "quit")
    await trainer.wait_event(lambda e: e.get("event") == "stopped")
    assert await trainer.process.wait() == 0
    for proc in [*engines.values(), *receivers.values(), sender]:
        assert await proc.terminate() == 0, proc.tail()
    for i, proc in engines.items():
        assert not [e for e in proc.events if e.get("event") == "mixed"], proc.tail()
        for e in proc.events:
            if e.get("event") == "observed":
                assert e["digest"] == digests[e["version"]], f"engine {i} read a mixed v{e['version']}"
        stopped = await proc.wait_event(lambda e: e.get("event") == "stopped")
        assert stopped["reads"] > 0 and 6 in stopped["versions"]
    for proc in receivers.values():
        for e in proc.applied():
            assert e["digest"] == digests[e["version"]]


@pytest.mark.timeout(300)
async def test_receiver_sidecar_ipc_snapshot(tmp_path: Path, prefix: str, procs: Processes) -> None:
    watch, shm = tmp_path / "snapshots", f"{prefix}-snap"
    watch.mkdir()
    args = ["--load-strategy", "ipc_snapshot", "--watch", str(watch), "--shm", shm, "--model", "examples.tiny_model:build", "--digest"]
    receiver = await procs.spawn("r", "receiver", *args)
    engine_model = bf16_model()
    attached = await asyncio.to_thread(attach, engine_model, shm, timeout=STARTUP)
    trainer = Trainer(seed=7)
    try:
        for version in range(3):
            if version:
                trainer.step()
            write_snapshot(trainer.model.state_dict(), watch, version)
            event = await receiver.wait_event(lambda e, v=version: e.get("event") == "applied" and e.get("version") == v, STARTUP)
            assert event["digest"] == trainer.digests[version]
            with attached.reading() as held:
                assert held == version and state_digest(engine_model.state_dict()) == trainer.digests[version]
        write_snapshot(build(seed=7, dim=32).state_dict(), watch, 3)  # does not fit: rejected whole
        await wait_until(lambda: "rejected snapshot" in receiver.log.read_text())
        with attached.reading() as held:
            assert held == 2 and state_digest(engine_model.state_dict()) == trainer.digests[2]
        trainer.step()
        trainer.step()
        write_snapshot(trainer.model.state_dict(), watch, 4)
        event = await receiver.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == 4)
        assert event["digest"] == trainer.digests[4]
        assert 3 not in {e["version"] for e in receiver.applied()}
        version, state = attached.snapshot()
        assert version == 4 and state_digest(state) == trainer.digests[4]
        # the sidecar killed: its region stays; a restarted one adopts it, the engine stays attached
        await receiver.kill()
        receiver = await procs.spawn("r2", "receiver", *args)
        await receiver.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == 4, STARTUP)
        trainer.step()
        write_snapshot(trainer.model.state_dict(), watch, 5)
        await receiver.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == 5)
        with attached.reading() as held:
            assert held == 5 and state_digest(engine_model.state_dict()) == trainer.digests[5]
    finally:
        assert await receiver.terminate() == 0, receiver.tail()
        assert attached.closed  # the sidecar unlinked its region on the way out
        attached.close()
