"""Progress of long transfers (issue 37): ``protocol.progress.Progress`` on a fake clock, and a
real bootstrap and resync slowed by the test proxy, logged on both sides with a falling ETA; the
receiver's bootstrap byte counter, its lag behind the sender's version and its last phase times."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from proxy import Proxy

from examples.tiny_model import build, train_step
from protocol import progress
from protocol.progress import Progress
from receiver import Receiver
from sender import Sender

CONFIG = {"weight_syncer": {"type": "patch", "patch": {"init_sync": {"bucket_size": 32 << 10}}}}  # bootstraps of ~8 messages
ETA = re.compile(r"ETA ([0-9.]+)s")


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_long_transfer_logs_every_few_seconds_a_short_one_never(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.progress")
    clock = Clock()
    caplog.set_level(logging.INFO, "test.progress")
    short = Progress(log, "short", 1000, clock=clock)
    for _ in range(10):
        clock.now += 0.1
        short.advance(100)
    short.finish()
    assert not caplog.records
    long = Progress(log, "long", 10_000_000, peer="r1", clock=clock)
    for _ in range(80):  # 1 MB/s for 10 s
        clock.now += 0.125
        long.advance(125_000)
    long.finish()
    lines = [r for r in caplog.records if r.getMessage().startswith("long")]
    assert len(lines) == 2 + 1  # at 5 s and 10 s (after 2 s, every 5 s), then done
    first = lines[0]
    assert "5.0 MB of 10.0 MB (50%), 1.0 MB/s, ETA 5.0s" in first.getMessage()
    assert first.bytes_done == 5_000_000 and first.bytes_total == 10_000_000 and first.peer == "r1"  # type: ignore[attr-defined]
    assert first.eta_s == pytest.approx(5.0) and first.rate_Bps == pytest.approx(1e6)  # type: ignore[attr-defined]
    assert lines[-1].getMessage().endswith("done in 10.0s")
    unknown = Progress(log, "unknown", None, clock=clock)
    clock.now += 3
    unknown.advance(10)
    assert unknown.eta is None and "ETA" not in caplog.records[-1].getMessage()


async def test_a_slow_bootstrap_logs_progress_on_both_sides(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(progress, "AFTER", 0.5)
    monkeypatch.setattr(progress, "EVERY", 0.5)
    caplog.set_level(logging.INFO)
    model = build(seed=0)  # ~120K parameters: ~250 KB at bf16
    rollout = build(seed=1).to(torch.bfloat16)
    model_bytes = sum({t.data_ptr(): t.numel() * t.element_size() for t in rollout.state_dict().values()}.values())  # tied: once
    # one patch kept, one version in flight: paused for 3 versions, the receiver is resynced after
    async with Sender("tcp://127.0.0.1:0", CONFIG, ring_size=1, max_inflight=1) as sender:
        await sender.start(model, version=0)
        host, port = sender.endpoint.removeprefix("tcp://").rsplit(":", 1)
        async with Proxy((host, int(port)), rate=96 << 10) as proxy:  # a few seconds for the bootstrap
            async with Receiver(rollout, proxy.endpoint, CONFIG, identity="slow") as receiver:
                seen: list[tuple[float, float]] = []  # the sender's transfer gauges while the bootstrap goes

                async def watch() -> None:
                    while True:
                        text = sender.metrics.render()[0].decode()
                        got = {(x.name, tuple(x.labels.items())): x.value for f in text_string_to_metric_families(text) for x in f.samples}
                        key = (("receiver", "slow"),)
                        if ("weightsync_sender_transfer_bytes_done", key) in got:
                            seen.append((got[("weightsync_sender_transfer_bytes_done", key)], got[("weightsync_sender_transfer_bytes_total", key)]))
                        await asyncio.sleep(0.2)

                watching = asyncio.ensure_future(watch())
                await receiver.start(timeout=60)
                await asyncio.sleep(0.5)
                watching.cancel()
                done = [d for d, _ in seen]
                assert len(seen) >= 2 and done == sorted(done) and done[0] < done[-1] <= seen[-1][1]  # rising bytes done, of the total
                assert abs(seen[-1][1] - model_bytes) < 0.05 * model_bytes
                after = {x.name for f in text_string_to_metric_families(sender.metrics.render()[0].decode()) for x in f.samples}
                assert "weightsync_sender_transfer_bytes_done" not in after  # done: no series left
                text = receiver.metrics.render()[0].decode()
                got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
                assert got["weightsync_receiver_bootstrap_bytes_total"] >= model_bytes  # headers on top
                assert got["weightsync_receiver_bootstrap_bytes_total"] < 1.05 * model_bytes

                # the receiver's view of its lag: behind while paused, 0 once resumed
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
                generator = torch.Generator().manual_seed(0)
                await receiver.pause()
                for version in (1, 2, 3):
                    train_step(model, optimizer, generator)
                    await sender.sync(model, version)
                for _ in range(300):  # heartbeats carry the sender's version (behind the patches, on this slow link)
                    got = {s.name: s.value for f in text_string_to_metric_families(receiver.metrics.render()[0].decode()) for s in f.samples}
                    if got["weightsync_receiver_sender_version"] == 3:
                        break
                    await asyncio.sleep(0.1)
                assert got["weightsync_receiver_sender_version"] == 3 and got["weightsync_receiver_lag_versions"] == 3
                assert receiver.version == 0  # paused: nothing applied
                await receiver.resume()
                await receiver.wait_for_version(3, timeout=60)
                assert sender.receivers["slow"]["resyncs"] == 1  # behind the 1-patch ring: a whole model again
                for _ in range(100):  # the sender follows the resync until the receiver's kernel has all of it
                    if not sender.server.transfers:
                        break
                    await asyncio.sleep(0.1)
                assert not sender.server.transfers
                samples = {(s.name, tuple(s.labels.items())): s.value
                           for f in text_string_to_metric_families(receiver.metrics.render()[0].decode()) for s in f.samples}
                assert samples[("weightsync_receiver_lag_versions", ())] == 0
                assert samples[("weightsync_receiver_last_phase_seconds", (("phase", "decode"),))] > 0
    sides = (("sender", "sending bootstrap to receiver slow"), ("receiver", "receiver slow bootstrap from"),
             ("sender's resync", "sending v3 to receiver slow"), ("receiver's resync", "receiver slow resync from"))
    for side, pattern in sides:
        lines = [r.getMessage() for r in caplog.records if pattern in r.getMessage() and "done in" not in r.getMessage()]
        etas = [float(m.group(1)) for line in lines if (m := ETA.search(line))]
        assert len(etas) >= 2, f"{side}: {lines}"
        assert etas[-1] < etas[0], f"{side}: the ETA did not fall: {lines}"
        assert any("done in" in r.getMessage() for r in caplog.records if pattern in r.getMessage()), side


# -- structured logs ------------------------------------------------------------------------------
async def test_json_logs_carry_the_version_the_receiver_and_the_bytes() -> None:
    import io
    import json

    from protocol.host.logs import json_logging

    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        json_logging("INFO", stream)
        model = build(seed=0)
        async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
            await sender.start(model, version=0)
            async with Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, CONFIG, identity="json-r") as receiver:
                await receiver.start()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
                train_step(model, optimizer, torch.Generator().manual_seed(0))
                stats = await sender.sync(model, 1)
                await sender.flush()
                await receiver.wait_for_version(1, timeout=30)
        try:
            raise ValueError("a traceback")
        except ValueError:
            logging.getLogger("test.json").exception("with an exception", extra={"version": 7})
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= set(line) for line in lines)
    joined = [x for x in lines if x["message"].startswith("receiver json-r joined")]
    assert joined and joined[0]["receiver"] == "json-r" and joined[0]["version"] == 0
    connected = [x for x in lines if x["message"].startswith("receiver json-r connected")]
    assert connected and connected[0]["version"] == 0 and connected[0]["receiver"] == "json-r"
    synced = [x for x in lines if x.get("version") == 1 and "wire_bytes" in x]
    assert synced and synced[0]["wire_bytes"] == stats.wire_bytes and synced[0]["build_s"] == stats.build_seconds
    failed = [x for x in lines if x["logger"] == "test.json"]
    assert failed[0]["version"] == 7 and "ValueError: a traceback" in failed[0]["exc"]


def test_both_clis_take_a_log_format(tmp_path: Path) -> None:
    from receiver.control.daemon import parse_args as receiver_args
    from sender.__main__ import parse_args as sender_args

    assert sender_args(["--watch", str(tmp_path), "--log-format", "json"]).log_format == "json"
    assert sender_args(["--watch", str(tmp_path)]).log_format == "text"
    assert receiver_args(["--model", "examples.tiny_model:build", "--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        sender_args(["--watch", str(tmp_path), "--log-format", "xml"])


BAR_SCRIPT = """
import logging, sys
from protocol import progress
from protocol.host.logs import setup_logging
setup_logging("INFO")
progress.AFTER = progress.EVERY = 0.0
on = progress.use_bars()
now = [0.0]
p = progress.Progress(logging.getLogger("t"), "transfer", 1000, clock=lambda: now[0])
for i in range(10):
    now[0] += 1.0
    p.advance(100)
p.finish()
print("bars", on, file=sys.stderr)
"""


def test_a_terminal_gets_a_bar_a_pipe_gets_plain_lines() -> None:
    import os
    import pty
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    master, slave = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", BAR_SCRIPT], cwd=root, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=slave, timeout=60, check=True)
    finally:
        os.close(slave)
    chunks = []
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the child's side is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    terminal = b"".join(chunks).decode(errors="replace")
    assert "bars True" in terminal
    assert "transfer: 100%|" in terminal and "1.00k/1.00k" in terminal  # tqdm's bar
    assert " of 1.0 KB" not in terminal  # no progress lines beside it
    piped = subprocess.run([sys.executable, "-c", BAR_SCRIPT], cwd=root, capture_output=True, text=True, timeout=60, check=True).stderr
    assert "bars False" in piped and "|" not in piped
    assert "transfer: 500 B of 1.0 KB (50%)" in piped and "done in 10.0s" in piped


async def test_a_failing_progress_watcher_is_logged_by_its_owner(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The receiver's byte-count watcher (``receiver/session/incoming.py``) failing only costs the
    figures: ``Incoming.close`` logs its error at WARNING and still finishes the progress."""
    from receiver.session import incoming

    class Link:
        reads = 0

        def bytes_received(self) -> int | None:
            self.reads += 1
            if self.reads > 2:  # the first reads: watch() and the watcher's start
                raise OSError("the connection's counters are gone")
            return 0

    class Finished(Progress):
        finished = False

        def finish(self) -> None:
            self.finished = True
            super().finish()

    monkeypatch.setattr(incoming, "WATCH_EVERY", 0.0)
    caplog.set_level(logging.INFO)
    progress = Finished(logging.getLogger("test.progress"), "bootstrap", 1000)
    watched = incoming.Incoming(Link(), progress)
    watched.watch()
    assert watched.watcher is not None
    await asyncio.wait_for(asyncio.wait((watched.watcher,)), 10)
    await watched.close()
    failed = [r for r in caplog.records if r.name == incoming.__name__]
    assert [r.levelno for r in failed] == [logging.WARNING] and "counters are gone" in failed[0].getMessage()
    assert progress.finished
