"""The sender daemon: one trainer, many receivers, over a ZeroMQ ROUTER socket.

``sync()`` builds a version once (a patch, or the buckets) and returns; serving it is
the job of the ``protocol.net.server.VersionServer`` it composes, with the trainer's model
as its source (``sender/serve/source.py``): each receiver's pump task sends it what it is
missing, bounded by credits (versions in flight), so a slow or dead receiver never
blocks the trainer. Receivers behind the ring of recent patches, or that reject a
message, are resynced with a bootstrap of the current version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import Any

import zmq
import zmq.asyncio

from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, WeightSyncError
from protocol.net.flips import Flip, Flips
from protocol.net.peers import Peer
from protocol.net.security import CurveServer
from protocol.net.server import VersionServer
from protocol.state import StateLike, resolve_state, state_tensors
from protocol.wire.framing import Message, MessageType
from protocol.wire.limits import Limits

from ..base import check_next_version
from ..plan import SyncPlan
from ..stats import SyncStats
from ..streams import Mark
from .feed import VersionFeed
from .lag import LagBound
from .metrics import MetricsServer, SenderMetrics
from .shard_source import ShardedSource
from .source import TrainerSource

log = logging.getLogger(__name__)


class Sender:
    """The trainer-side daemon. An async context manager; see ``start``, ``sync``, ``close``.

    ``config`` is RLinf's weight-syncer YAML shape (a path, mapping or ``SyncConfig``). The first
    receiver's metadata fixes the receivers' dtypes: every later receiver must match it.

    ``curve`` (``protocol.net.security.CurveServer``) encrypts the connection and admits only
    receivers whose public key it allows; a refused key is logged and counted in
    ``rejected_handshakes``. Without it, binding beyond loopback is a ``ConfigError``
    unless ``insecure_plaintext``. ``limits`` bounds what receivers may send (default:
    derived from the model at ``start``).

    ``max_lag`` and ``lag_policy`` bound staleness from the trainer's side
    (``sender/serve/lag.py``): before version ``v`` is built, ``"wait"`` waits up to
    ``lag_timeout`` seconds for every connected receiver (and every one below a relay) to
    have applied ``v - max_lag``, then raises a ``LagTimeoutError`` naming those still behind;
    ``"drop"`` goes on and resyncs them to the newest version when they have room; ``"off"``
    (the default) only counts them. ``SyncStats.lag_wait_seconds`` and ``lag_dropped``, the
    metrics and ``python -m sender status`` report it.

    ``commit="together"`` flips the fleet at once (``protocol/net/flips.py``): every
    receiver stages each version and reports it; when all the receivers connected at its
    publication have staged it (or ``quorum`` of them, or ``stage_timeout`` passed: the
    others are resynced and named in ``SyncStats.flip_missing``), every receiver is told to
    commit it from its staged copy. ``wait_flipped`` waits for that. A receiver that cannot
    (of an older protocol) is refused at HELLO. Through relays, a relay counts as staged
    once its whole subtree has staged (or its deadline, half of ``stage_timeout`` a level,
    named the late ones: ``"relay/leaf"``), and the flip goes down at once.

    A receiver that NACKs its resyncs one after another is resynced later each time
    (``resync_backoff``: first and largest delay, doubling) and, after ``max_resyncs`` in a
    row with no ACK between, dropped with a ``ResyncLimitError`` sent to it and logged.

    Up to ``ring_size`` recent patches are kept to catch up a receiver that fell behind,
    and of those, newest first, no more bytes than ``ring_bytes`` (None: a whole copy of
    the state, taken at ``start``): further behind, a resync sends fewer bytes than the
    patches would, and the sender does not hold several whole copies of a model whose
    patches go dense.

    ``server`` (the ``VersionServer``) serves the receivers; the properties below are its.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        config: SyncConfig | Any = None,
        *,
        trainable_keys: Iterable[str] | None = None,
        ring_size: int = 8,
        ring_bytes: int | None = None,
        max_inflight: int = 2,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        context: zmq.asyncio.Context | None = None,
        stats_history: int = 1000,
        curve: CurveServer | None = None,
        insecure_plaintext: bool = False,
        limits: Limits | None = None,
        resync_backoff: tuple[float, float] = (0.05, 2.0),
        max_resyncs: int = 8,
        metrics_address: str | None = None,
        metrics_token: str | None = None,
        max_lag: int | None = None,
        lag_policy: str = "off",
        lag_timeout: float = 60.0,
        commit: str = "independent",
        quorum: int | None = None,
        stage_timeout: float = 30.0,
    ) -> None:
        if commit not in ("independent", "together"):
            raise ConfigError(f"commit must be 'independent' or 'together', got {commit!r}")
        self.commit = commit
        self.server = VersionServer(
            endpoint, ring_size=ring_size, ring_bytes=ring_bytes, max_inflight=max_inflight, heartbeat_interval=heartbeat_interval,
            peer_timeout=peer_timeout, context=context, curve=curve, insecure_plaintext=insecure_plaintext,
            resync_backoff=resync_backoff, max_resyncs=max_resyncs, flips=Flips(quorum, stage_timeout) if commit == "together" else None,
        )
        self.server.on_flip = self._flipped
        self._limits = limits
        self.lag = LagBound(max_lag, lag_policy, lag_timeout)  # checked before anything starts
        self.config = load_config(config)
        self.strategy = self.config.type
        self._trainable_keys = None if trainable_keys is None else list(trainable_keys)
        self.stats: collections.OrderedDict[int, SyncStats] = collections.OrderedDict()
        self._stats_history = stats_history
        self._source: TrainerSource | ShardedSource | None = None  # what the server serves: one of these two
        self._trainer: TrainerSource | None = None  # the trainer's model, built here (``sync``)
        self._sharded: ShardedSource | None = None  # or a sharded trainer's, built by its ranks (``publish``)
        self._closing: asyncio.Task[None] | None = None  # ``close``, once called
        self.metrics = SenderMetrics(self)
        self.server.deliveries.on_delivered = self.metrics.delivered
        # opt-in, checked now (a token off loopback), served from start() to close()
        self._metrics_server = None if metrics_address is None else MetricsServer(self.metrics, metrics_address, metrics_token)
        self.metrics_url: str | None = None
        self._feed = VersionFeed(self.server, self.strategy, self._synced)

    # -- public API -----------------------------------------------------------------
    async def start(self, model: StateLike, *, version: int | None = None, sharded: bool = False) -> Sender:
        """Bind the socket and serve receivers with ``model``'s weights.

        ``version`` is the version ``model`` already holds (e.g. a resumed checkpoint).
        ``sharded``: the versions are built by a sharded trainer's ranks and handed to
        ``publish`` (``ShardedSync`` starts its Sender so), not by ``sync``.
        """
        if self._closing is not None:
            raise WeightSyncError("sender is closed")
        if self._source is not None:
            raise WeightSyncError("sender already started")
        state = resolve_state(model, self._trainable_keys)
        if sharded:
            self._source = self._sharded = ShardedSource(state, self.config)
        else:
            self._source = self._trainer = TrainerSource(state, model, self.config)
        if self.server.ring_bytes is None:
            self.server.ring_bytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
        self.server.moved(version)
        if self._metrics_server is not None:
            self.metrics_url = await self._metrics_server.start()
            log.info("sender metrics at %s/metrics", self.metrics_url)
        try:
            self.server.start(self._source, self._limits or Limits.for_control(state.tensors))
        except BaseException:
            if self._metrics_server is not None:
                await self._metrics_server.close()
            raise
        log.info("sender %s serving %s (%s, version %s)", self.session[:8], self.endpoint, self.strategy, version,
                 extra={"session": self.session, "endpoint": self.endpoint, "strategy": self.strategy, "version": version})
        return self

    async def sync(self, model: StateLike, version: int) -> SyncStats:
        """Capture ``version`` from ``model`` once for every receiver and return its stats.

        Returns as soon as the changes are collected and the snapshot has moved (patch),
        or the buckets are built (bucket): the model may change again. A patch's first
        parts are encoded and sent while its later tensors are still compared; the rest
        goes on in the background; ``stats.wire_bytes`` and ``encode_seconds`` are
        filled in once the patch is encoded (``await sender.flush()`` waits for that).

        Versions must increase: a version not above the current one (also when another
        ``sync`` of a later version got there first) is a ``StaleVersionError`` and
        changes nothing. So is a model missing a tracked key or with one reshaped
        (``MetadataMismatchError``). A patch sync whose compare fails or is cancelled
        midway leaves the version where it was, but its snapshot ahead of the receivers
        on what it compared: the next sync waits for that compare to end, then resyncs
        every receiver to its version by bootstrap, and patches resume after it.
        """
        self._check_open()
        source = self._trainer
        if source is None:
            raise ConfigError("this sender was started for a sharded build: its versions come from ShardedSync.sync (publish)")
        tensors = state_tensors(model)
        # The trainer's step is queued on this thread's current streams (a side stream, maybe):
        # the model is read after it, on whatever thread and stream the build reads it.
        after = Mark.now(tensors.values())
        waited, late = await self._bound_lag(version)
        async with self.server.lock:
            # Checked under the lock: of two syncs racing, the one that waited for the other
            # sees its version, and a stale one (sync(5) after sync(6)) is refused here; so
            # is one that waited for close().
            self._check_open()
            check_next_version(self.version, version)
            source.model = model
            try:
                stats = await self._feed.build(source, tensors, version, after)
            except BaseException:
                self._feed.settle(False)
                raise
            self.server.moved(version)
            self._feed.settle(True)
            stats.lag_wait_seconds, stats.lag_dropped = waited, self.lag.leave(self.server, version, late)
        if not self._feed.reports(version):
            self._synced(stats)
        self.stats[version] = stats
        while len(self.stats) > self._stats_history:
            self.stats.popitem(last=False)
        if self.server.flips is not None and (flip := self.server.flips.record(version)) is not None and flip.decided_at is not None:
            self._flipped(flip)  # decided at publication (no receiver to wait for)
        return stats

    async def publish(
        self,
        version: int,
        parts: AsyncIterable[Message] | None,
        *,
        bootstrap: Callable[[SyncPlan], Awaitable[list[Message]]] | None = None,
        stats: SyncStats | None = None,
    ) -> SyncStats:
        """Publish ``version``, built elsewhere (a sharded trainer's ranks, ``ShardedSync``),
        on a sender started with ``sharded=True``.

        ``parts``: the patch from the current version to ``version``, PATCH messages in order
        (numbered, versioned and the final one marked ``last`` here; none at all: an empty
        patch), each served to the receivers as soon as the next one comes; None: there is
        no patch (no receiver holds a version yet, or after a failed version), and every
        receiver behind is resynced by bootstrap. ``bootstrap`` (called with the receivers'
        plan after the parts, while the version is still the old one): the bootstrap of
        ``version``, for the receivers waiting for one (``ShardedSource``). The version moves
        once both are done; if either fails, it does not (the parts already out are
        abandoned) and the error is raised. Serialised with everything else that moves the
        version; a version not above the current one is a ``StaleVersionError``.
        """
        self._check_open()
        source = self._sharded
        if source is None:
            raise ConfigError("publish() is for a sender started with sharded=True (ShardedSync); call sync()")
        stats = SyncStats(version, self.strategy) if stats is None else stats
        stats.lag_wait_seconds, late = await self._bound_lag(version)
        async with self.server.lock:
            self._check_open()
            check_next_version(self.version, version)
            base = self.version
            started = time.perf_counter()
            held: Message | None = None  # the newest part, published once the next comes (or the version moves)
            try:
                if parts is not None:
                    self.server.expect_patch(base)
                    count = 0
                    async for msg in parts:
                        if held is not None:
                            self._feed.publish_part(held, base, version, stats)
                        msg.version, msg.base_version, msg.part, msg.last = version, base, count, False
                        held, count = msg, count + 1
                    if held is None:  # no change on any rank: one empty part says so
                        held = Message(MessageType.PATCH, version=version, base_version=base)
                    held.last = True  # published once the version moves: no receiver acks it before
                stats.send_seconds += time.perf_counter() - started
                source.drop_offer()
                if bootstrap is not None:
                    if source.plan is None:
                        raise WeightSyncError("a bootstrap is built for the receivers' plan: no receiver has joined")
                    source.offer(version, await bootstrap(source.plan))
            except BaseException:
                if parts is not None:
                    self.server.abandon_patch(base, version)
                raise
            if held is not None:
                self._feed.publish_part(held, base, version, stats)
            else:
                self.server.forget()  # no patch: every receiver behind is resynced
            self.server.moved(version)
            stats.lag_dropped = self.lag.leave(self.server, version, late)
        self._synced(stats)
        self.stats[version] = stats
        while len(self.stats) > self._stats_history:
            self.stats.popitem(last=False)
        if self.server.flips is not None and (flip := self.server.flips.record(version)) is not None and flip.decided_at is not None:
            self._flipped(flip)  # decided at publication (no receiver to wait for)
        return stats

    def _flipped(self, flip: Flip) -> None:
        stats = self.stats.get(flip.version)
        if stats is not None:
            stats.flip_seconds, stats.flip_missing = flip.seconds, flip.missing

    async def wait_flipped(self, version: int, timeout: float | None = None) -> Flip:
        """Under ``commit="together"``: wait until ``version`` has flipped (every receiver
        connected at its publication staged it, or ``quorum`` did, or ``stage_timeout``
        passed); its record (``missing``: the receivers it went without, resynced)."""
        return await self.server.wait_flipped(version, timeout)

    async def _bound_lag(self, version: int) -> tuple[float, list[Peer]]:
        """The staleness bound ahead of ``version`` (``sender/serve/lag.py``), outside the
        server's lock (receivers joining meanwhile are admitted): the seconds it waited, and
        the receivers to leave behind once ``version`` is published (``LagBound.leave``)."""
        check_next_version(self.version, version)  # a stale version fails before it waits
        started = time.perf_counter()
        late = await self.lag.before(self.server, version)
        return time.perf_counter() - started, late

    def _synced(self, stats: SyncStats) -> None:
        """A version is built and published: counted in the metrics, and logged with its figures."""
        self.metrics.synced(stats)
        log.info(
            "sender %s v%s: %s, %d bytes on the wire (a full copy: %d), %d changed, build %.3fs, encode %.3fs",
            self.session[:8], stats.version, stats.strategy, stats.wire_bytes, stats.dense_bytes, stats.changed_elements,
            stats.build_seconds, stats.encode_seconds,
            extra={"version": stats.version, "strategy": stats.strategy, "wire_bytes": stats.wire_bytes, "dense_bytes": stats.dense_bytes,
                   "changed_elements": stats.changed_elements, "build_s": stats.build_seconds, "encode_s": stats.encode_seconds},
        )

    def _check_open(self) -> None:
        """Raise why no version can be built now: the server is not running, or ``close`` began."""
        if self._closing is not None:
            raise WeightSyncError("sender is closed")
        self.server.check_running()

    @property
    def plan(self) -> SyncPlan | None:
        """The receivers' plan (their ordinals and dtypes), fixed by the first receiver's HELLO."""
        return None if self._source is None else self._source.plan

    @property
    def encode_backlog_bytes(self) -> int:
        """Collected bytes waiting for the encoder threads now (patch strategy; else 0)."""
        return 0 if self._trainer is None else self._trainer.backlog_bytes

    @property
    def bootstrap_wanted(self) -> bool:
        """A sharded build's receivers wait for a bootstrap (``ShardedSource``)."""
        return self._sharded is not None and self._sharded.wanted

    async def flush(self) -> None:
        """Wait until every synced version is encoded and queued for the receivers."""
        await self._feed.flush()

    async def close(self) -> None:
        """Stop everything the sender started: say goodbye to the receivers, cancel and await
        every task (the pumps, the patch being encoded: its parts not yet served are
        dropped) before the socket closes, then stop the builder's compare and encoder
        threads and the metrics endpoint.

        A ``sync`` or ``publish`` under way is finished first (close waits for the version
        lock: a model read midway cannot be interrupted, and its version moves); one called
        after close began raises ``WeightSyncError``. Called again, or while it runs, close
        waits for the first call to end (and raises what it raised); a caller cancelled while
        waiting does not stop it."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        async with self.server.lock:  # after a sync or publish under way
            self._feed.settle(False)
            try:
                await self.server.close()
            finally:
                try:
                    if self._trainer is not None:
                        await self._trainer.close()
                finally:
                    if self._metrics_server is not None:
                        await self._metrics_server.close()

    async def __aenter__(self) -> Sender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the server's, for the trainer --------------------------------------------------
    @property
    def endpoint(self) -> str:
        """The bound address, with the real port once started."""
        return self.server.endpoint

    @property
    def session(self) -> str:
        """This sender's session id: versions under one id form one lineage."""
        return self.server.session

    @property
    def version(self) -> int | None:
        """The current version: the last one synced (or given to ``start``)."""
        return self.server.version

    @property
    def failure(self) -> BaseException | None:
        return self.server.failure

    @property
    def receivers(self) -> dict[str, dict[str, object]]:
        return self.server.receivers

    @property
    def bytes_sent(self) -> int:
        return self.server.bytes_sent

    @property
    def rejected_handshakes(self) -> int:
        return self.server.rejected_handshakes

    @property
    def rejected_keys(self) -> set[str]:
        return self.server.rejected_keys

    def subtree(self) -> tuple[int, int | None]:
        return self.server.subtree()

    async def wait_acked(self, version: int, timeout: float | None = None, *, tree: bool = False) -> None:
        await self.server.wait_acked(version, timeout, tree=tree)

    async def wait_for_receivers(self, count: int, timeout: float | None = None) -> None:
        await self.server.wait_for_receivers(count, timeout)
