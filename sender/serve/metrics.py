"""Prometheus metrics of one ``Sender``, in its own registry (several senders in one process
must not collide in the global one), and the opt-in HTTP endpoint that serves them
(``Sender(metrics_address=...)``, ``python -m sender --metrics-address``).

Counted as versions are synced (``SenderMetrics.synced``); read at scrape time from the
sender and its server (``_Collector``): connected receivers, each one's acknowledged version,
lag and credits, resyncs, NACKs, refused handshakes, the encoder's backlog, and the last
versions' phase times and bytes. Label sets are bounded: per-receiver series exist only for
receivers connected now, at most ``RECEIVER_SERIES`` of them (the furthest behind first), and
per-version series only for the last ``VERSION_SERIES`` versions.

The endpoint follows the receiver's control API: loopback by default, a bearer token required
anywhere else (``/health`` open), no encryption (put TLS in front beyond a trusted network).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from protocol.net.http import bearer_auth, check_token, parse_address, serve
from protocol.net.server import VersionServer

from ..stats import SyncStats
from .lag import LagBound

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
RECEIVER_SERIES = 128  # receivers with series of their own, at most (the furthest behind)
VERSION_SERIES = 5  # the last versions with phase-time and byte series
TOKEN_ENV = "WEIGHTSYNC_METRICS_TOKEN"
PHASES = ("build", "encode", "send", "backlog_wait", "d2h")


class Observed(Protocol):
    """What the metrics read of a ``Sender`` at scrape time."""

    server: VersionServer
    lag: LagBound

    @property
    def failure(self) -> BaseException | None: ...

    @property
    def encode_backlog_bytes(self) -> int: ...


class SenderMetrics:
    """Counters the sender updates as it syncs, plus what it holds read at scrape time."""

    def __init__(self, sender: Observed) -> None:
        self.sender = sender
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.versions = Counter("weightsync_sender_versions", "Versions synced", ["strategy"], registry=r)
        self.wire_bytes = Counter("weightsync_sender_wire_bytes", "Bytes of the versions' messages (every frame, once a version)", registry=r)
        self.dense_bytes = Counter("weightsync_sender_dense_bytes", "Bytes a full copy of each version would have sent", registry=r)
        self.changed = Counter("weightsync_sender_changed_elements", "Elements changed, summed over versions", registry=r)
        self.build_seconds = Histogram(
            "weightsync_sender_build_seconds", "Time a sync blocked the trainer (compare and collect, or the buckets)", buckets=_SECONDS, registry=r
        )
        self.encode_seconds = Histogram(
            "weightsync_sender_encode_seconds", "Encoding a version's changes that the compare did not hide", buckets=_SECONDS, registry=r
        )
        self.send_seconds = Histogram(
            "weightsync_sender_send_seconds", "From a version's publication to its ACK by every receiver connected then",
            buckets=_SECONDS, registry=r,
        )
        self.recent: list[tuple[SyncStats, float | None]] = []  # the last versions, with their send seconds once known
        r.register(_Collector(self))

    def synced(self, stats: SyncStats) -> None:
        """A version is built and published (its stats are final but for its delivery)."""
        self.versions.labels(stats.strategy).inc()
        self.wire_bytes.inc(stats.wire_bytes)
        self.dense_bytes.inc(stats.dense_bytes)
        self.changed.inc(stats.changed_elements)
        self.build_seconds.observe(stats.build_seconds)
        self.encode_seconds.observe(stats.encode_seconds)
        self.recent = [*self.recent, (stats, None)][-VERSION_SERIES:]

    def delivered(self, version: int, seconds: float) -> None:
        """Every receiver connected when ``version`` was published has acknowledged it."""
        self.send_seconds.observe(seconds)
        self.recent = [(s, seconds if s.version == version else sent) for s, sent in self.recent]

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type. Call it on the sender's event
        loop thread: it reads records only that thread changes."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Collector(Collector):
    def __init__(self, metrics: SenderMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        sender = self.metrics.sender
        server = sender.server
        version = server.version
        yield GaugeMetricFamily("weightsync_sender_version", "The current version (-1: none)", -1 if version is None else version)
        peers = list(server.peers.values())
        yield GaugeMetricFamily("weightsync_sender_receivers_connected", "Receivers connected now", len(peers))
        now = time.monotonic()
        lags = sorted(((server.deliveries.lag(p.acked, version, now), p) for p in peers), key=lambda x: (-x[0][0], -x[0][1]))
        acked = GaugeMetricFamily("weightsync_sender_receiver_acked_version", "A receiver's acknowledged version (-1: none)", labels=["receiver"])
        lag = GaugeMetricFamily("weightsync_sender_receiver_lag_versions", "Published versions a receiver has not acknowledged", labels=["receiver"])
        lag_s = GaugeMetricFamily(
            "weightsync_sender_receiver_lag_seconds", "Seconds since the oldest version a receiver lacks was published", labels=["receiver"]
        )
        credits = GaugeMetricFamily(
            "weightsync_sender_receiver_inflight", "Versions sent to a receiver and not yet acknowledged", labels=["receiver"]
        )
        heard = GaugeMetricFamily("weightsync_sender_receiver_silence_seconds", "Seconds since a receiver was last heard from", labels=["receiver"])
        sent = GaugeMetricFamily(
            "weightsync_sender_receiver_sent_version", "The version a receiver will hold once what was sent to it is applied (-1: none)",
            labels=["receiver"],
        )
        ack_age = GaugeMetricFamily(
            "weightsync_sender_receiver_ack_age_seconds", "Seconds since a receiver's last ACK (since it joined, if none)", labels=["receiver"]
        )
        for (behind, seconds), p in lags[:RECEIVER_SERIES]:
            acked.add_metric([p.name], -1 if p.acked is None else p.acked)
            lag.add_metric([p.name], behind)
            lag_s.add_metric([p.name], seconds)
            credits.add_metric([p.name], len(p.inflight))
            heard.add_metric([p.name], now - p.last_seen)
            sent.add_metric([p.name], -1 if p.sent is None else p.sent)
            ack_age.add_metric([p.name], now - (p.acked_at if p.acked_at is not None else p.joined_at))
        yield from (acked, lag, lag_s, credits, heard, sent, ack_age)
        done = GaugeMetricFamily(
            "weightsync_sender_transfer_bytes_done", "A whole model going to a receiver now (a bootstrap, resync or buckets): bytes done",
            labels=["receiver"],
        )
        total = GaugeMetricFamily("weightsync_sender_transfer_bytes_total", "That transfer's bytes in all", labels=["receiver"])
        eta = GaugeMetricFamily("weightsync_sender_transfer_eta_seconds", "That transfer's seconds left at its rate so far", labels=["receiver"])
        connected = {p.identity for _, p in lags[:RECEIVER_SERIES]}
        for identity, progress in list(server.transfers.items()):
            if identity in connected:
                name = identity.decode(errors="replace")
                done.add_metric([name], progress.done)
                total.add_metric([name], progress.total or 0)
                left = progress.eta
                if left is not None:
                    eta.add_metric([name], left)
        yield from (done, total, eta)
        furthest = max((x[0][0] for x in lags), default=0)
        yield GaugeMetricFamily("weightsync_sender_lag_versions_max", "The furthest any connected receiver is behind, in versions", furthest)
        yield CounterMetricFamily("weightsync_sender_resyncs", "Receivers resynced by bootstrap", server.counts.resyncs)
        nacks = CounterMetricFamily("weightsync_sender_nacks", "Updates receivers rejected, by reason", labels=["reason"])
        for reason, count in sorted(server.counts.nacks.items()):
            nacks.add_metric([reason], count)
        yield nacks
        yield CounterMetricFamily("weightsync_sender_handshakes_refused", "CURVE handshakes refused (key not allowed)", server.rejected_handshakes)
        yield CounterMetricFamily("weightsync_sender_bytes_queued", "Bytes queued for receivers (every receiver's copy)", server.bytes_sent)
        yield GaugeMetricFamily("weightsync_sender_encode_backlog_bytes", "Collected bytes waiting for the encoder now", sender.encode_backlog_bytes)
        bound, counts = sender.lag, sender.lag.counts
        policy = GaugeMetricFamily("weightsync_sender_lag_policy", "The staleness bound: max_lag (-1: none), by lag_policy", labels=["policy"])
        policy.add_metric([bound.policy], -1 if bound.max_lag is None else bound.max_lag)
        yield policy
        yield CounterMetricFamily("weightsync_sender_lag_waits", "Syncs that waited for receivers beyond max_lag", counts.waits)
        yield CounterMetricFamily("weightsync_sender_lag_wait_seconds", "Seconds syncs waited for receivers beyond max_lag", counts.wait_seconds)
        yield CounterMetricFamily("weightsync_sender_lag_timeouts", "Waits for receivers beyond max_lag that ran out", counts.timeouts)
        yield CounterMetricFamily("weightsync_sender_lag_drops", "Receivers beyond max_lag left behind, to be resynced", counts.drops)
        yield CounterMetricFamily("weightsync_sender_lag_over", "Receivers found beyond max_lag at a sync, any policy", counts.over)
        yield CounterMetricFamily("weightsync_sender_behind_asks", "Receivers' asks for versions they never received, acted on", server.counts.behind)
        yield CounterMetricFamily("weightsync_sender_ring_resends", "Patches sent again from the ring to receivers that asked for them",
                                  server.counts.ring_resends)
        yield CounterMetricFamily("weightsync_sender_bucket_resends", "Bucket versions sent again to receivers that asked for them",
                                  server.counts.bucket_resends)
        phases = GaugeMetricFamily("weightsync_sender_version_phase_seconds", "A recent version's phase times", labels=["version", "phase"])
        sizes = GaugeMetricFamily(
            "weightsync_sender_version_bytes", "A recent version's bytes on the wire and as a full copy", labels=["version", "kind"]
        )
        for stats, delivered in self.metrics.recent:
            v = str(stats.version)
            times = (stats.build_seconds, stats.encode_seconds, delivered, stats.backlog_wait_seconds, stats.d2h_seconds)
            for phase, value in zip(PHASES, times):
                if value is not None:
                    phases.add_metric([v, phase], value)
            sizes.add_metric([v, "wire"], stats.wire_bytes)
            sizes.add_metric([v, "dense"], stats.dense_bytes)
        yield phases
        yield sizes


class MetricsServer:
    """Serves a sender's metrics over HTTP (``/metrics``; ``/health`` without a token)."""

    def __init__(self, metrics: SenderMetrics, address: str = "127.0.0.1:0", token: str | None = None) -> None:
        self.metrics = metrics
        self.host, self.port = parse_address(address, "metrics address")
        check_token(self.host, token, "metrics endpoint", f"Sender(metrics_token=...), --metrics-token or ${TOKEN_ENV}")
        self.token = token
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self) -> str:
        """Bind and serve; returns the resolved ``http://host:port``."""
        middlewares = [] if self.token is None else [bearer_auth(self.token, _unauthorized, ("/health",), "metrics endpoint")]
        app = web.Application(middlewares=middlewares)
        app.add_routes([web.get("/metrics", self._metrics), web.get("/health", self._health)])
        self._runner, self.url = await serve(app, self.host, self.port, "metrics endpoint")
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        # On the event loop's thread, not a worker's: the collector reads the server's records
        # (peers, deliveries, transfers), which only that thread changes (a few ms at most).
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _health(self, request: web.Request) -> web.Response:
        failure = self.metrics.sender.failure
        body = {"healthy": failure is None, "error": None if failure is None else repr(failure)}
        return web.json_response(body, status=200 if failure is None else 503)


def _unauthorized() -> web.Response:
    return web.json_response({"error": "this metrics endpoint needs 'Authorization: Bearer <token>'"}, status=401)
