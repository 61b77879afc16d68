"""The sender daemon: one trainer, many receivers, over a ZeroMQ ROUTER socket.

``sync()`` builds a version once (a patch, or the buckets) and returns; serving it is
``protocol.net.server.VersionServer``'s: each receiver's pump task sends it what it is
missing, bounded by credits (versions in flight), so a slow or dead receiver never
blocks the trainer. Receivers behind the ring of recent patches, or that reject a
message, are resynced with a bootstrap of the current version.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
import zmq
import zmq.asyncio

from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, WeightSyncError
from protocol.net.security import CurveServer
from protocol.net.server import VersionServer
from protocol.state import ModelState, StateLike, materialize, resolve_state, sync_keys
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message
from protocol.wire.limits import Limits
from protocol.wire.messages import Hello
from protocol.wire.metadata import ModelMetadata

from .base import check_next_version, plan_for
from .bucket import BucketBuilder
from .patch import Changes, PatchBuilder
from .plan import Source, SyncPlan
from .stats import SyncStats

log = logging.getLogger(__name__)


class Sender(VersionServer):
    """The trainer-side daemon. An async context manager; see ``start``, ``sync``, ``close``.

    ``config`` is the seed's YAML shape (a path, mapping or ``SyncConfig``). The first
    receiver's metadata fixes the receivers' dtypes: every later receiver must match it.

    ``curve`` (``protocol.net.security.CurveServer``) encrypts the connection and admits only
    receivers whose public key it allows; a refused key is logged and counted in
    ``rejected_handshakes``. Without it, binding beyond loopback is a ``ConfigError``
    unless ``insecure_plaintext``. ``limits`` bounds what receivers may send (default:
    derived from the model at ``start``).

    A receiver that NACKs its resyncs one after another is resynced later each time
    (``resync_backoff``: first and largest delay, doubling) and, after ``max_resyncs`` in a
    row with no ACK between, dropped with a ``ResyncLimitError`` sent to it and logged.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        config: SyncConfig | Any = None,
        *,
        trainable_keys: Iterable[str] | None = None,
        ring_size: int = 8,
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
    ) -> None:
        super().__init__(
            endpoint, ring_size=ring_size, max_inflight=max_inflight, heartbeat_interval=heartbeat_interval,
            peer_timeout=peer_timeout, context=context, curve=curve, insecure_plaintext=insecure_plaintext,
            resync_backoff=resync_backoff, max_resyncs=max_resyncs,
        )
        self._limits = limits
        self.config = load_config(config)
        self.strategy = self.config.type
        self._trainable_keys = None if trainable_keys is None else list(trainable_keys)
        self.stats: collections.OrderedDict[int, SyncStats] = collections.OrderedDict()
        self._stats_history = stats_history
        self._model: StateLike | None = None
        self._state: ModelState | None = None
        self._plan: SyncPlan | None = None
        self._builder: PatchBuilder | BucketBuilder | None = None
        self._held: dict[str, torch.Tensor] | None = None  # the current version, before any receiver
        self._encoding: asyncio.Task[None] | None = None  # the newest patch being encoded

    # -- public API -----------------------------------------------------------------
    async def start(self, model: StateLike, *, version: int | None = None) -> Sender:
        """Bind the socket and serve receivers with ``model``'s weights.

        ``version`` is the version ``model`` already holds (e.g. a resumed checkpoint).
        """
        if self._socket is not None:
            raise WeightSyncError("sender already started")
        self._model, self.version = model, version
        self._state = resolve_state(model, self._trainable_keys)
        self._hold(self._state.tensors)
        self._open(self._limits or Limits.for_control(self._state.tensors))
        log.info("sender %s serving %s (%s, version %s)", self.session[:8], self.endpoint, self.strategy, version)
        return self

    async def sync(self, model: StateLike, version: int) -> SyncStats:
        """Capture ``version`` from ``model`` once for every receiver and return its stats.

        Returns as soon as the changes are collected and the snapshot has moved (patch),
        or the buckets are built (bucket): the model may change again. Encoding and
        sending go on in the background; ``stats.wire_bytes`` and ``encode_seconds`` are
        filled in once the patch is encoded (``await sender.flush()`` waits for that).

        Versions must increase: a version not above the current one (also when another
        ``sync`` of a later version got there first) is a ``StaleVersionError`` and
        changes nothing.
        """
        self._check_running()
        tensors = resolve_state(model).tensors
        async with self._lock:
            # Checked under the lock: of two syncs racing, the one that waited for the other
            # sees its version, and a stale one (sync(5) after sync(6)) is refused here.
            check_next_version(self.version, version)
            self._model = model
            stats = await self._build(tensors, version)
            self._moved(version)
        self.stats[version] = stats
        while len(self.stats) > self._stats_history:
            self.stats.popitem(last=False)
        self._wake_all()
        return stats

    # -- building ---------------------------------------------------------------------
    async def _build(self, tensors: dict[str, torch.Tensor], version: int) -> SyncStats:
        builder = self._builder
        if builder is None:  # no receiver yet: nothing to diff against, only the version moves
            self._hold(tensors)
            return SyncStats(version, self.strategy)
        if isinstance(builder, PatchBuilder):  # encoded in the background, in version order
            changes, stats = await builder.collect(tensors, version)
            base, previous = self.version, self._encoding
            self._pending_bases.add(base)
            self._encoding = self._spawn(self._encode(builder, previous, changes, version, base, stats), f"encode-v{version}")
            return stats
        started = time.perf_counter()
        await builder.hold(tensors)
        messages, stats = builder.build(builder.held(), version, copy=False)
        frames_list = [self.stamp(m) for m in await asyncio.to_thread(list, messages)]
        self._set_bucket(version, frames_list)
        stats.messages, stats.wire_bytes = len(frames_list), sum(len(f) for fr in frames_list for f in fr)
        stats.build_seconds = time.perf_counter() - started
        return stats

    async def _encode(
        self, builder: PatchBuilder, previous: asyncio.Task[None] | None, changes: list[Changes], version: int, base: int | None,
        stats: SyncStats,
    ) -> None:
        """Encode a collected version into the ring, after the versions before it."""
        if previous is not None:
            await previous
        msg = await builder.encode(changes, version, base, stats)
        frames = self.stamp(msg)
        stats.messages, stats.wire_bytes = 1, sum(len(f) for f in frames)
        self._add_patch(base, version, frames)

    async def flush(self) -> None:
        """Wait until every synced version is encoded and queued for the receivers."""
        if self._encoding is not None:
            await asyncio.shield(self._encoding)

    def _hold(self, tensors: dict[str, torch.Tensor]) -> None:
        """Keep a copy of the current version until the first receiver says which dtypes
        it wants: the weights may move on before it joins, and it must get this version."""
        # Only what the first receiver's snapshot (or retained copy) takes: each tracked storage
        # once. Frozen keys come from the model, as in every bootstrap.
        assert self._state is not None
        keys, held = sync_keys(self._state), self._held
        missing = [k for k in keys if k not in tensors]
        if missing:
            raise ConfigError(f"this model has no {missing[0]!r}, which the model given to start() has")
        if held is None:
            self._held = {k: materialize(tensors[k]).detach().clone() for k in keys}
            return
        for key in keys:
            held[key].copy_(materialize(tensors[key]).detach())

    def _source(self) -> Source:
        """Tensors of the current version at rest: the snapshot or retained copy for
        tracked keys, the model for frozen ones (which training does not change)."""
        assert self._state is not None and self._builder is not None
        model = resolve_state(self._model).tensors if self._model is not None else self._state.tensors
        held = self._builder.held()
        return lambda key: held[key] if key in held else model[key]

    # -- what the server asks ---------------------------------------------------------
    async def _bootstrap(self) -> list[Message]:
        """The init-sync keys, plus every tracked key once the trainer has moved past its
        initial weights."""
        plan, builder = self._plan, self._builder
        assert plan is not None and builder is not None
        await builder.settled()
        keys = plan.bootstrap_keys() if plan.init_sync.enabled else []
        if self.version is not None:
            keys = [k for k in plan.state.tensors if k in set(keys) | set(plan.tracked)]
        _, messages = plan.bootstrap(self.version, self._source(), keys)
        return await asyncio.to_thread(list, messages)

    async def _compute_digest(self) -> str:
        plan, builder = self._plan, self._builder
        assert plan is not None and builder is not None
        await builder.settled()
        source, aliases = self._source(), plan.state.aliases

        def compute() -> str:
            view = {k: source(aliases.get(k, k)).to(plan.receiver_dtype(k)) for k in plan.metadata.keys}
            return state_digest(view, list(plan.metadata.keys))

        return await asyncio.to_thread(compute)

    def _welcome(self, version: int | None, bootstrap_parts: int) -> Message:
        assert self._plan is not None
        return self._plan.welcome(self.strategy, version, bootstrap_parts)

    def _describe(self) -> ModelMetadata | None:
        if self._plan is not None:
            return self._plan.metadata
        return None if self._state is None else ModelMetadata.of(self._state.tensors)

    async def _admit(self, hello: Message) -> None:
        """The first receiver fixes the plan; later ones must match it exactly."""
        assert self._state is not None
        if self._plan is None:
            plan = plan_for(self._state, hello, self.config)
            builder: PatchBuilder | BucketBuilder
            held = self._held
            assert held is not None
            builder = PatchBuilder(plan, self.config.patch) if self.strategy == "patch" else BucketBuilder(plan, self.config.bucket)
            await builder.hold(held)
            self._plan, self._builder = plan, builder
            self._held = None  # the snapshot (or retained copy) holds the version from now on
            return
        self._plan.metadata.require_same(Hello.from_body(hello.body).metadata, "the other receivers")
