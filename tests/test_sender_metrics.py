"""The sender's Prometheus metrics (issue 37): what the server counts (``Deliveries``,
``ServerCounts``), and a real Sender's ``/metrics`` scraped over HTTP while real receivers
join, lag behind when paused, catch up, and are resynced."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from examples.tiny_model import build, train_step
from protocol.errors import ConfigError
from protocol.net.deliveries import NACK_REASONS_KEPT, VERSIONS_KEPT, Deliveries, ServerCounts
from protocol.net.peers import Peer
from receiver import Receiver
from sender import Sender
from sender.__main__ import parse_args
from sender.serve.metrics import RECEIVER_SERIES, VERSION_SERIES

CONFIG = {"weight_syncer": {"type": "patch"}}
TOKEN = "a-metrics-token-of-enough-length"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, tuple(sorted(labels.items())))]


async def scrape(url: str, token: str | None = None) -> str:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics", headers=headers) as r:
        assert r.status == 200, await r.text()
        return await r.text()


# -- what the server counts ---------------------------------------------------------------------
def test_lag_counts_the_versions_a_receiver_lacks_and_since_when() -> None:
    d = Deliveries()
    for v, at in ((1, 10.0), (2, 11.0), (4, 15.0)):
        d.published(v, [], now=at)
    assert d.lag(4, 4, now=20.0) == (0, 0.0)
    assert d.lag(2, 4, now=20.0) == (1, 5.0)  # lacks v4, published 5 s ago
    assert d.lag(1, 4, now=20.0) == (2, 9.0)
    assert d.lag(None, 4, now=20.0) == (3, 10.0)
    assert d.lag(0, None, now=20.0) == (0, 0.0)
    for v in range(5, 5 + 2 * VERSIONS_KEPT):  # bounded: only the newest are remembered
        d.published(v, [], now=float(v))
    assert d.lag(None, 4 + 2 * VERSIONS_KEPT, now=1000.0)[0] == VERSIONS_KEPT


def test_a_version_is_delivered_once_every_receiver_connected_then_has_it() -> None:
    seen: list[tuple[int, float]] = []
    d = Deliveries(lambda v, s: seen.append((v, s)))
    d.published(1, [b"a", b"b"], now=0.0)
    d.published(2, [b"a", b"b", b"c"], now=1.0)
    d.acked(b"a", 2, now=2.0)  # a has both
    assert seen == []
    d.acked(b"b", 1, now=3.0)
    assert seen == [(1, 3.0)]
    d.left(b"c", now=4.0)  # c leaves: it is no longer waited for
    d.acked(b"b", 2, now=5.0)
    assert seen == [(1, 3.0), (2, 4.0)]
    d.published(3, [], now=6.0)  # nobody to deliver to: no delivery time
    assert len(seen) == 2


def test_nack_reasons_are_bounded_whatever_receivers_send() -> None:
    counts = ServerCounts()
    for i in range(1000):
        counts.nack(f"Reason{i}")
        counts.nack("not an identifier {i}\n")
    assert len(counts.nacks) == NACK_REASONS_KEPT
    assert counts.nacks["other"] == 1000 + 1000 - (NACK_REASONS_KEPT - 1)
    assert sum(counts.nacks.values()) == 2000


# -- a real Sender --------------------------------------------------------------------------------
async def test_metrics_follow_versions_lag_and_resyncs_over_http() -> None:
    model = build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    # one patch kept, one version in flight: a receiver paused for 3 versions falls behind the ring
    async with Sender("tcp://127.0.0.1:0", CONFIG, ring_size=1, max_inflight=1, metrics_address="127.0.0.1:0") as sender:
        await sender.start(model, version=0)
        assert sender.metrics_url is not None and sender.metrics_url.startswith("http://127.0.0.1:")
        text = await scrape(sender.metrics_url)
        assert value(text, "weightsync_sender_receivers_connected") == 0
        assert value(text, "weightsync_sender_version") == 0
        a = Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, CONFIG, identity="steady")
        b = Receiver(build(seed=2).to(torch.bfloat16), sender.endpoint, CONFIG, identity="paused")
        async with a, b:
            await asyncio.gather(a.start(), b.start())
            version = 0

            async def steps(count: int, reached: Receiver | None) -> None:
                """``count`` versions, each waited for at ``reached`` (None: every receiver)."""
                nonlocal version
                for _ in range(count):
                    version += 1
                    train_step(model, optimizer, generator)
                    await sender.sync(model, version)
                    await sender.flush()
                    if reached is None:
                        await sender.wait_acked(version, timeout=30)
                    else:
                        await reached.wait_for_version(version, timeout=30)

            await steps(2, None)
            text = await scrape(sender.metrics_url)
            assert value(text, "weightsync_sender_receivers_connected") == 2
            assert value(text, "weightsync_sender_versions_total", strategy="patch") == 2
            assert value(text, "weightsync_sender_wire_bytes_total") == sum(s.wire_bytes for s in sender.stats.values()) > 0
            assert value(text, "weightsync_sender_dense_bytes_total") == sum(s.dense_bytes for s in sender.stats.values())
            assert value(text, "weightsync_sender_changed_elements_total") == sum(s.changed_elements for s in sender.stats.values())
            assert value(text, "weightsync_sender_build_seconds_count") == 2
            assert value(text, "weightsync_sender_send_seconds_count") == 2  # both versions reached both receivers
            for who in ("steady", "paused"):
                assert value(text, "weightsync_sender_receiver_acked_version", receiver=who) == 2
                assert value(text, "weightsync_sender_receiver_lag_versions", receiver=who) == 0
            assert value(text, "weightsync_sender_version_phase_seconds", version="2", phase="build") == sender.stats[2].build_seconds
            assert value(text, "weightsync_sender_version_bytes", version="2", kind="wire") == sender.stats[2].wire_bytes

            # a paused receiver lags, in versions and seconds; it catches up once resumed
            await b.pause()
            await steps(3, a)
            # the steady receiver has committed v5; its ACK reaches the sender a moment later
            deadline = asyncio.get_running_loop().time() + 30
            while value(text := await scrape(sender.metrics_url), "weightsync_sender_receiver_lag_versions", receiver="steady") != 0:
                assert asyncio.get_running_loop().time() < deadline, "the sender never saw the steady receiver's ACK of v5"
                await asyncio.sleep(0.02)
            assert value(text, "weightsync_sender_receiver_lag_versions", receiver="paused") >= 2
            assert value(text, "weightsync_sender_receiver_lag_seconds", receiver="paused") > 0
            assert value(text, "weightsync_sender_lag_versions_max") >= 2
            assert value(text, "weightsync_sender_send_seconds_count") == 2  # v3..v5 not yet at every receiver
            await b.resume()
            await b.wait_for_version(version, timeout=30)
            await sender.wait_acked(version, timeout=30)
            text = await scrape(sender.metrics_url)
            assert value(text, "weightsync_sender_receiver_lag_versions", receiver="paused") == 0
            assert value(text, "weightsync_sender_receiver_lag_seconds", receiver="paused") == 0
            assert value(text, "weightsync_sender_send_seconds_count") == 5
            # it fell behind the ring while paused: resynced by bootstrap, and counted
            assert value(text, "weightsync_sender_resyncs_total") == sum(int(r["resyncs"]) for r in sender.receivers.values()) >= 1
            versions = {s.labels["version"] for f in text_string_to_metric_families(text) for s in f.samples if "version" in s.labels}
            assert len(versions) <= VERSION_SERIES  # the last versions only


async def test_per_receiver_series_stay_bounded_as_receivers_come_and_go() -> None:
    """1,000 receivers joining and leaving (as the server records them) leave no series behind,
    and no more than ``RECEIVER_SERIES`` receivers have series at once."""
    async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
        await sender.start(build(seed=0), version=0)
        peers: dict[bytes, Peer] = sender.server._peers
        sizes = []
        for wave in range(10):
            for i in range(100):
                identity = f"r{wave}-{i}".encode()
                peers[identity] = Peer(identity, acked=0)
            text = sender.metrics.render()[0].decode()
            sizes.append(len(text))
            series = sum(1 for s in samples(text) if s[0] == "weightsync_sender_receiver_lag_versions")
            assert series == min(RECEIVER_SERIES, len(peers))
            assert value(text, "weightsync_sender_receivers_connected") == len(peers)
            if wave % 2:
                peers.clear()
        peers.clear()
        text = sender.metrics.render()[0].decode()
        assert not any(name.startswith("weightsync_sender_receiver_") for name, _ in samples(text))
        assert max(sizes) < 3 * sizes[1]  # capped, not growing with the receivers seen


async def test_the_endpoint_needs_a_token_off_loopback_and_checks_it() -> None:
    with pytest.raises(ConfigError, match="needs a token"):
        Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="0.0.0.0:0")
    with pytest.raises(ConfigError, match="too short"):
        Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="127.0.0.1:0", metrics_token="short")
    async with Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="127.0.0.1:0", metrics_token=TOKEN) as sender:
        await sender.start(build(seed=0))
        url = sender.metrics_url
        assert url is not None
        async with aiohttp.ClientSession() as http:
            async with http.get(url + "/metrics") as r:
                assert r.status == 401
            async with http.get(url + "/metrics", headers={"Authorization": "Bearer wrong-token-of-enough-length"}) as r:
                assert r.status == 401
            async with http.get(url + "/health") as r:  # liveness: no token
                assert r.status == 200 and (await r.json())["healthy"] is True
        assert "weightsync_sender_version" in await scrape(url, TOKEN)
    async with aiohttp.ClientSession() as http:  # closed with the sender
        with pytest.raises(aiohttp.ClientConnectionError):
            async with http.get(url + "/health"):
                pass


def test_the_cli_takes_the_metrics_address_and_token(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    args = parse_args(["--watch", str(tmp_path), "--metrics-address", "127.0.0.1:9400"])
    assert args.metrics_address == "127.0.0.1:9400" and args.metrics_token is None
    monkeypatch.setenv("WEIGHTSYNC_METRICS_TOKEN", TOKEN)
    assert parse_args(["--watch", str(tmp_path)]).metrics_token == TOKEN


async def test_the_status_command_shows_a_paused_receivers_lag() -> None:
    """``python -m sender status`` in its own process against a live sender: the paused
    receiver's lag in the table, and ``--json`` parses to the same."""
    import json
    import subprocess
    import sys

    model = build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    async with Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="127.0.0.1:0", metrics_token=TOKEN) as sender:
        await sender.start(model, version=0)
        a = Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, CONFIG, identity="running")
        b = Receiver(build(seed=2).to(torch.bfloat16), sender.endpoint, CONFIG, identity="held")
        async with a, b:
            await asyncio.gather(a.start(), b.start())
            await b.pause()
            for version in (1, 2, 3):
                train_step(model, optimizer, generator)
                await sender.sync(model, version)
                await sender.flush()
                await a.wait_for_version(version, timeout=30)
            command = [sys.executable, "-m", "sender", "status", "--metrics", str(sender.metrics_url), "--token", TOKEN]

            def run(*extra: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([*command, *extra], capture_output=True, text=True, timeout=60)

            shown, as_json = await asyncio.gather(asyncio.to_thread(run), asyncio.to_thread(run, "--json"))
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines() if line.split()[:1] in (["running"], ["held"])}
    assert rows["running"][1] == "v3" and rows["running"][3] == "0"  # acked v3, lag 0
    assert rows["held"][1] == "v0" and int(rows["held"][3]) >= 2  # acked v0, lagging
    assert "sender at v3, 2 receivers connected" in shown.stdout
    status = json.loads(as_json.stdout)
    assert status["version"] == 3 and status["receivers"]["held"]["lag_versions"] >= 2
    assert status["receivers"]["running"]["lag_versions"] == 0
    assert [v["version"] for v in status["versions"]] == [1, 2, 3] and all(v["wire_bytes"] > 0 for v in status["versions"])
    nowhere = [sys.executable, "-m", "sender", "status", "--metrics", "http://127.0.0.1:9"]
    refused = subprocess.run(nowhere, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "cannot read" in refused.stderr


async def test_the_status_command_takes_the_logged_url_and_knows_a_sender_from_a_receiver() -> None:
    """The ``.../metrics`` URL the sender logs works as well as its base URL; a receiver's
    control port (it serves metrics too, a receiver's) and a page that is not Prometheus
    text are named as not a sender's metrics, exit 1 (it printed 'sender at vNone' and 0)."""
    import subprocess
    import sys

    async with Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="127.0.0.1:0") as sender:
        await sender.start(build(seed=0), version=4)
        async with Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, CONFIG, control_address="127.0.0.1:0") as receiver:
            await receiver.start()
            control = str(receiver.control_url)

            def status(url: str) -> subprocess.CompletedProcess[str]:
                return subprocess.run([sys.executable, "-m", "sender", "status", "--metrics", url], capture_output=True, text=True, timeout=60)

            base, logged, other = await asyncio.gather(
                asyncio.to_thread(status, str(sender.metrics_url)), asyncio.to_thread(status, f"{sender.metrics_url}/metrics"),
                asyncio.to_thread(status, control),
            )
    for shown in (base, logged):
        assert shown.returncode == 0 and "sender at v4, 1 receivers connected" in shown.stdout, shown.stderr
    assert other.returncode == 1 and "is not a weightsync sender's metrics" in other.stderr, (other.stdout, other.stderr)
    assert "sender at" not in other.stdout
    from sender.serve.status import not_a_sender

    assert not_a_sender("<html>hello</html>") is not None and not_a_sender("weightsync_sender_version 3\n") is None


async def test_a_metrics_port_in_use_is_a_transport_error_as_a_socket_port_is() -> None:
    """Every port weightsync opens fails alike when taken: a TransportError with EADDRINUSE
    (the metrics and control ports raised ConfigError, the ZeroMQ ports TransportError)."""
    import errno

    from protocol.errors import TransportError

    async with Sender("tcp://127.0.0.1:0", CONFIG, metrics_address="127.0.0.1:0") as first:
        await first.start(build(seed=0), version=0)
        taken = str(first.metrics_url).rsplit(":", 1)[1]
        async with Sender("tcp://127.0.0.1:0", CONFIG, metrics_address=f"127.0.0.1:{taken}") as second:
            with pytest.raises(TransportError, match="cannot serve") as caught:
                await second.start(build(seed=0), version=0)
            assert caught.value.errno == errno.EADDRINUSE
        port = first.endpoint.rsplit(":", 1)[1]
        with pytest.raises(TransportError) as zmq_caught:
            async with Sender(f"tcp://127.0.0.1:{port}", CONFIG) as third:
                await third.start(build(seed=0), version=0)
        assert zmq_caught.value.errno == errno.EADDRINUSE
