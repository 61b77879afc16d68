"""Prometheus metrics of one receiver, in its own registry (many receivers per process
must not collide in the global one). Served as text by the control API's ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .stats import ApplyStats

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass
class ReceiverState:
    """What the receiver is doing now, read at scrape time."""

    version: int | None
    pending_version: int | None
    paused: bool
    connected: bool
    asleep: frozenset[str]
    reconnects: int
    sender_version: int | None = None  # the trainer's latest, as last heard (``Receiver.latest_version``)
    hook_failures: int = 0  # on_update hooks that raised
    hook_timeouts: int = 0  # ... that ran past their timeout
    hook_skipped: int = 0  # versions dropped from the hooks' full backlog
    hooks_waiting: int = 0  # versions published and not yet told to every hook


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], ReceiverState], last: Callable[[], ApplyStats | None]) -> None:
        self._read, self._last = read, last

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._read()
        yield GaugeMetricFamily("weightsync_receiver_version", "Last fully applied weight version (-1: none)", -1 if s.version is None else s.version)
        yield GaugeMetricFamily(
            "weightsync_receiver_pending_version", "Version received and staged, not yet applied (-1: none)",
            -1 if s.pending_version is None else s.pending_version,
        )
        yield GaugeMetricFamily("weightsync_receiver_paused", "1 while paused: no new version is applied", int(s.paused))
        yield GaugeMetricFamily("weightsync_receiver_connected", "1 while a session with the sender is established", int(s.connected))
        asleep = GaugeMetricFamily("weightsync_receiver_asleep", "1 while this memory is released by sleep", labels=["tag"])
        for tag in ("weight", "kv_cache"):
            asleep.add_metric([tag], int(tag in s.asleep))
        yield asleep
        yield CounterMetricFamily("weightsync_receiver_reconnects", "Sessions with the sender that ended and were restarted", s.reconnects)
        yield GaugeMetricFamily(
            "weightsync_receiver_sender_version", "The trainer's latest version, as last heard (through relays too) (-1: none heard)",
            -1 if s.sender_version is None else s.sender_version,
        )
        hooks = CounterMetricFamily("weightsync_receiver_hook_failures", "on_update hook calls that failed", labels=["reason"])
        hooks.add_metric(["error"], s.hook_failures)
        hooks.add_metric(["timeout"], s.hook_timeouts)
        yield hooks
        yield CounterMetricFamily("weightsync_receiver_hook_skipped", "Versions never told to the on_update hooks (a full backlog)", s.hook_skipped)
        yield GaugeMetricFamily("weightsync_receiver_hooks_waiting", "Versions published and not yet told to every on_update hook", s.hooks_waiting)
        behind = 0 if s.sender_version is None else s.sender_version - (-1 if s.version is None else s.version)
        yield GaugeMetricFamily("weightsync_receiver_lag_versions", "The trainer's latest version less the applied one (0: current)", max(0, behind))
        phases = GaugeMetricFamily("weightsync_receiver_last_phase_seconds", "The last applied version's phase times", labels=["phase"])
        last = self._last()
        if last is not None:
            for phase in ("receive", "decode", "h2d", "apply", "apply_device"):
                phases.add_metric([phase], getattr(last, f"{phase}_seconds"))
        yield phases


class ReceiverMetrics:
    """Counters the receiver updates as it works, plus its state read at scrape time."""

    def __init__(self, read_state: Callable[[], ReceiverState]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.versions = Counter("weightsync_receiver_versions_applied", "Versions applied (patches, buckets, bootstraps)", ["kind"], registry=r)
        self.wire_bytes = Counter("weightsync_receiver_received_bytes", "Payload bytes of applied versions", registry=r)
        self.bootstrap_bytes = Counter(
            "weightsync_receiver_bootstrap_bytes", "Bytes of bootstrap messages received in handshakes, counted as they arrive", registry=r
        )
        self.nacks = Counter("weightsync_receiver_nacks", "Updates rejected and resyncs requested (NACKs sent)", ["reason"], registry=r)
        self.recoveries = Counter(
            "weightsync_receiver_recoveries", "Versions asked for once lost on the way (NACK Behind or Lost), then applied: "
            "sent again (by=resend: a patch from the ring, a bucket version as it was) or by a resync (by=resync)", ["by"], registry=r,
        )
        self.apply_seconds = Histogram(
            "weightsync_receiver_apply_seconds", "Commit time of a version (write lock held)", buckets=_SECONDS, registry=r
        )
        self.decode_seconds = Histogram(
            "weightsync_receiver_decode_seconds", "Decode and validate time of a version", buckets=_SECONDS, registry=r
        )
        self.last: ApplyStats | None = None
        r.register(_StateCollector(read_state, lambda: self.last))

    def applied(self, stats: ApplyStats) -> None:
        self.last = stats
        self.versions.labels(stats.kind).inc()
        self.wire_bytes.inc(stats.wire_bytes)
        self.apply_seconds.observe(stats.apply_seconds)
        self.decode_seconds.observe(stats.decode_seconds)

    def nack(self, reason: str) -> None:
        self.nacks.labels(reason).inc()

    def recovered(self, by: str) -> None:
        """A version this receiver asked for came (``LagWatch.applied``: resend or resync)."""
        self.recoveries.labels(by).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
