"""The daemons as real processes, through their CLIs.

The test is the trainer: real AdamW steps on the tiny transformer, each version written
atomically as ``<watch>/step_<N>.pt`` for ``python -m sender`` to pick up. Two
``python -m receiver`` processes (bf16, other initial weights) report each applied
version with its state digest on stdout; on SIGTERM they save their state dict, which
must equal the trainer's weights cast to bf16, bit for bit. Then the faults: a receiver
killed with SIGKILL and restarted under the same identity, a receiver frozen (SIGSTOP)
for longer than the peer timeout, and the sender killed and restarted on its endpoint.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
import torch
from daemon_helpers import HEARTBEAT, PEER_TIMEOUT, YAML, Proc, Processes, Trainer, free_port, mismatches

MODEL = "examples.tiny_model:build"
TIMING = ["--heartbeat", str(HEARTBEAT), "--peer-timeout", str(PEER_TIMEOUT)]
STEPS = 5
SEED = 7  # the trainer's; the receiver CLIs build seed 0, so only the bootstrap makes them equal


class Cluster:
    """One sender CLI and its receiver CLIs, driven by an in-test trainer."""

    def __init__(self, procs: Processes, tmp_path: Path, mode: str, endpoint: str) -> None:
        self.procs, self.tmp, self.mode, self.endpoint = procs, tmp_path, mode, endpoint
        self.watch = tmp_path / "ckpt"
        self.watch.mkdir()
        self.config = tmp_path / f"{mode}.yaml"
        self.config.write_text(YAML[mode])
        self.trainer = Trainer(seed=SEED)
        self.trainer.save(self.watch)  # step_0.pt: what the sender serves at start
        self.sender: Proc | None = None
        self.receivers: dict[str, Proc] = {}
        self.saves: dict[str, Path] = {}

    async def start_sender(self, *extra: str) -> Proc:
        self.sender = await self.procs.spawn(
            "sender", "sender", "--watch", str(self.watch), "--model", MODEL, "--endpoint", self.endpoint,
            "--config", str(self.config), *TIMING, *extra,
        )
        listening = await self.sender.wait_event(lambda e: e.get("event") == "listening")
        assert listening["version"] == self.trainer.version
        self.endpoint = listening["endpoint"]  # the real port when asked for :0
        return self.sender

    async def start_receiver(self, identity: str, *extra: str) -> Proc:
        save = self.saves[identity] = self.tmp / f"{identity}-{len(self.procs.procs)}.pt"
        proc = await self.procs.spawn(
            identity, "receiver", "--endpoint", self.endpoint, "--model", MODEL, "--identity", identity, "--digest",
            "--save", str(save), "--config", str(self.config), *TIMING, *extra,
        )
        self.receivers[identity] = proc
        return proc

    async def converged(self, version: int, names: list[str] | None = None) -> None:
        """Each receiver reports ``version`` applied with the trainer's digest for it."""
        for name in names or list(self.receivers):
            proc = self.receivers[name]
            event = await proc.wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version)
            assert event["digest"] == self.trainer.digests[version], f"{name} applied v{version} with another digest"

    async def step(self, wait: bool = True, names: list[str] | None = None) -> int:
        self.trainer.step()
        self.trainer.save(self.watch)
        if wait:
            await self.converged(self.trainer.version, names)
        return self.trainer.version

    def check_reports(self) -> None:
        """Every version any receiver ever reported holds exactly the trainer's weights."""
        for name, proc in self.receivers.items():
            for event in proc.applied():
                v = event["version"]
                if "superseded_by" in event:  # a newer version was in when its hook reported: no digest of v to take
                    assert event["superseded_by"] > v, event
                    continue
                assert event["digest"] == self.trainer.digests[v], f"{name} reported v{v} with a wrong digest"

    async def stop_and_compare(self) -> None:
        """SIGTERM every receiver: each saves its state dict, bit-identical to the trainer's."""
        final = self.trainer.version
        for name, proc in self.receivers.items():
            assert await proc.terminate() == 0, proc.tail()
            stopped = await proc.wait_event(lambda e: e.get("event") == "stopped")
            assert stopped["version"] == final
            saved = torch.load(self.saves[name], map_location="cpu", weights_only=True)
            bad = mismatches(self.trainer.expected[final], saved)
            assert not bad, f"{name}'s saved state differs from the trainer's v{final} at {bad[:5]}"
        self.check_reports()
        if self.sender is not None and self.sender.process.returncode is None:
            assert await self.sender.terminate() == 0, self.sender.tail()


def endpoint_for(transport: str, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp_path}/weights.sock"


async def started(procs: Processes, tmp_path: Path, mode: str, transport: str, endpoint: str | None = None) -> Cluster:
    c = Cluster(procs, tmp_path, mode, endpoint or endpoint_for(transport, tmp_path))
    await c.start_sender()
    for name in ("r0", "r1"):
        await c.start_receiver(name)
    await c.converged(0)  # bootstrapped from other initial weights
    return c


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_cli_daemons_sync_every_step_bit_for_bit(mode: str, transport: str, procs: Processes, tmp_path: Path) -> None:
    c = await started(procs, tmp_path, mode, transport)
    for _ in range(STEPS):
        await c.step()
    assert c.sender is not None
    synced = [e for e in c.sender.events if e.get("event") == "synced"]
    assert [e["version"] for e in synced] == list(range(1, STEPS + 1))
    for e in synced:  # reported once the version is encoded (they were all 0 when reported before)
        assert e["messages"] > 0 and e["wire_bytes"] > 0 and "send_seconds" not in e, e
        assert e["encode_seconds"] > 0 if mode == "patch" else e["build_seconds"] > 0, e
    await c.stop_and_compare()


@pytest.mark.timeout(90)
async def test_a_bad_checkpoint_is_refused_and_the_sender_goes_on(procs: Processes, tmp_path: Path) -> None:
    """A checkpoint whose shapes differ from --model, and one that is not a checkpoint at all:
    each refused once with a CheckpointError naming the file and the first differing key,
    the last good version still served and the receivers never told goodbye; a good file
    written over the bad one is read again, and the versions go on."""
    c = await started(procs, tmp_path, "patch", "tcp")
    assert c.sender is not None
    state = c.trainer.model.state_dict()
    wrong = next(k for k, v in state.items() if v.dim() == 2)
    torch.save({**state, wrong: state[wrong][:-1]}, c.watch / "step_1.pt.tmp")
    (c.watch / "step_1.pt.tmp").rename(c.watch / "step_1.pt")
    refused = await c.sender.wait_event(lambda e: e.get("event") == "refused")
    assert refused["version"] == 1 and refused["path"].endswith("step_1.pt"), refused
    assert f"{wrong!r} has shape" in refused["error"], refused
    (c.watch / "step_2.pt").write_bytes(b"not a checkpoint")
    garbage = await c.sender.wait_event(lambda e: e.get("event") == "refused" and e.get("version") == 2)
    assert "cannot be read" in garbage["error"]
    await asyncio.sleep(3 * 0.2)  # a few polls: each bad file is refused once, not on every poll
    assert len([e for e in c.sender.events if e.get("event") == "refused"]) == 2
    assert c.sender.process.returncode is None and "CheckpointError" in c.sender.log.read_text()
    (c.watch / "step_2.pt").unlink()
    await c.step()  # the trainer's v1, written over the bad step_1.pt: read again, synced
    await c.step()
    await c.stop_and_compare()
    for name in c.receivers:
        assert "said goodbye" not in c.receivers[name].log.read_text()


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "transport"), [("patch", "tcp"), ("bucket", "ipc")])
async def test_receiver_killed_and_restarted_with_same_identity(mode: str, transport: str, procs: Processes, tmp_path: Path) -> None:
    c = await started(procs, tmp_path, mode, transport)
    await c.step()
    await c.step(wait=False)  # mid-run: r1 may or may not have applied it
    await c.receivers["r1"].kill()
    await c.converged(c.trainer.version, ["r0"])
    await c.step(names=["r0"])  # a version it misses entirely
    await c.start_receiver("r1")  # same identity, new process, initial weights again
    await c.converged(c.trainer.version, ["r1"])
    for _ in range(2):
        await c.step()
    await c.stop_and_compare()


@pytest.mark.timeout(90)
async def test_receiver_frozen_longer_than_peer_timeout_catches_up(procs: Processes, tmp_path: Path) -> None:
    c = await started(procs, tmp_path, "patch", "tcp")
    await c.step()
    frozen = c.receivers["r1"].process
    frozen.send_signal(signal.SIGSTOP)
    try:
        for _ in range(2):
            await c.step(names=["r0"])  # the trainer and r0 go on
        await asyncio.sleep(PEER_TIMEOUT + 1.0)  # the sender gives up on it
        await c.step(names=["r0"])
    finally:
        frozen.send_signal(signal.SIGCONT)
    await c.converged(c.trainer.version, ["r1"])
    await c.step()
    await c.stop_and_compare()


@pytest.mark.timeout(90)
async def test_sender_killed_and_restarted_on_same_endpoint(procs: Processes, tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    c = await started(procs, tmp_path, "patch", "tcp", endpoint)
    for _ in range(2):
        await c.step()
    assert c.sender is not None
    await c.sender.kill()  # no goodbye
    await c.step(wait=False)  # written while no sender is up
    await asyncio.sleep(PEER_TIMEOUT + 0.5)  # the receivers notice the silence and keep their version
    for proc in c.receivers.values():
        assert max(e["version"] for e in proc.applied()) == 2
        assert proc.process.returncode is None
    await c.start_sender()  # serves the newest checkpoint, v3
    await c.converged(3)
    for _ in range(2):
        await c.step()
    await c.stop_and_compare()


def test_cli_flags_used_here_exist() -> None:
    """The CLIs accept every flag these tests pass (argparse would exit 2 on an unknown one)."""
    import receiver.control.daemon as rmain
    import sender.__main__ as smain

    s = smain.parse_args(["--watch", "/tmp/x", "--model", MODEL, "--endpoint", "tcp://127.0.0.1:1", "--config", "c.yaml", *TIMING])
    assert s.heartbeat == HEARTBEAT and s.peer_timeout == PEER_TIMEOUT
    r = rmain.parse_args(["--endpoint", "ipc:///tmp/x", "--model", MODEL, "--identity", "r0", "--digest", "--save", "x.pt", *TIMING])
    assert r.digest and r.identity == "r0" and r.save == Path("x.pt")


# -- metrics (issue 37) ----------------------------------------------------------------------------
def _scraped(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(x.name, tuple(sorted(x.labels.items()))): x.value for f in text_string_to_metric_families(text) for x in f.samples}


async def test_both_daemons_metrics_follow_lag_resyncs_and_bootstrap_bytes(procs: Processes, tmp_path: Path) -> None:
    """The sender CLI with --metrics-address and two receiver CLIs with control APIs, scraped
    over HTTP: a receiver paused through its API lags on both sides' metrics, is resynced (one
    patch kept, one version in flight: it fell behind the ring) and is back at lag 0 once
    resumed; its bootstrap byte counter reached the model's size."""
    import aiohttp

    cluster = Cluster(procs, tmp_path, "patch", "tcp://127.0.0.1:0")
    sender = await cluster.start_sender("--metrics-address", "127.0.0.1:0", "--ring-size", "1", "--max-inflight", "1")
    listening = await sender.wait_event(lambda e: e.get("event") == "listening")
    sender_url = listening["metrics"]
    urls = {}
    for name in ("held", "running"):
        proc = await cluster.start_receiver(name, "--control", "127.0.0.1:0")
        urls[name] = (await proc.wait_event(lambda e: e.get("event") == "control"))["url"]
    await cluster.converged(0)
    model_bytes = sum({t.data_ptr(): t.numel() * 2 for t in cluster.trainer.model.state_dict().values()}.values())  # bf16, tied once
    async with aiohttp.ClientSession() as http:

        async def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
            async with http.get(url + "/metrics") as r:
                assert r.status == 200
                return _scraped(await r.text())

        await cluster.step()
        got = await scrape(sender_url)
        assert got[("weightsync_sender_receivers_connected", ())] == 2
        assert got[("weightsync_sender_receiver_lag_versions", (("receiver", "held"),))] == 0
        held = await scrape(urls["held"])
        assert held[("weightsync_receiver_bootstrap_bytes_total", ())] >= model_bytes

        async with http.post(urls["held"] + "/v1/pause") as r:
            assert r.status == 200
        for _ in range(3):
            await cluster.step(names=["running"])
        await asyncio.sleep(4 * HEARTBEAT)  # the receiver hears the sender's version in its heartbeats
        got = await scrape(sender_url)
        assert got[("weightsync_sender_receiver_lag_versions", (("receiver", "held"),))] >= 2
        assert got[("weightsync_sender_receiver_lag_seconds", (("receiver", "held"),))] > 0
        assert got[("weightsync_sender_receiver_lag_versions", (("receiver", "running"),))] == 0
        held = await scrape(urls["held"])
        assert held[("weightsync_receiver_sender_version", ())] == cluster.trainer.version
        assert held[("weightsync_receiver_lag_versions", ())] >= 2
        resyncs = got[("weightsync_sender_resyncs_total", ())]

        async with http.post(urls["held"] + "/v1/resume") as r:
            assert r.status == 200
        await cluster.converged(cluster.trainer.version, ["held"])
        await asyncio.sleep(4 * HEARTBEAT)
        got = await scrape(sender_url)
        assert got[("weightsync_sender_receiver_lag_versions", (("receiver", "held"),))] == 0
        assert got[("weightsync_sender_resyncs_total", ())] >= resyncs + 1  # behind the 1-patch ring: resynced
        held = await scrape(urls["held"])
        assert held[("weightsync_receiver_lag_versions", ())] == 0
    await cluster.stop_and_compare()
