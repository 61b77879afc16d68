"""The receiver daemon: follows one sender, applies its versions in the background.

Receiving, decoding and validating run off the event loop; a version is committed
under the write side of ``lock`` and only then published as ``version``. The session
loop is a ``Follower`` (``receiver/session/follower.py``: one connection at a time, each a
``Session``, re-established with backoff at the next of the ``Upstreams``), run as this
receiver's task.

The control calls (``pause``, ``resume``, ``sleep``, ``wakeup``, ``update_weights``) are
methods of this class (``ControlCalls``), carried out by the ``Controller`` it composes
(both in ``receiver/control/controller.py``, where their concurrency is documented; it drives the
follower through ``receiver/control/controlled.py``); ``receiver/control/http_api.py`` serves them over
HTTP. While paused, versions keep arriving and the connection and heartbeats stay up, but
the next version waits, received and staged, in front of the commit until ``resume`` or
``update_weights``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq.asyncio

from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, WeightSyncError, WeightSyncTimeout
from protocol.net.context import shared_context
from protocol.net.security import CurveClient, CurveServer
from protocol.state import StateLike, state_tensors
from protocol.wire.limits import Limits

from ..lifecycle import ControlState
from ..metrics import ReceiverMetrics, ReceiverState
from ..naming import NameMapping, NameMappingSpec
from ..rwlock import ReadWriteLock
from ..session.follower import Follower, Owner, Settings
from ..session.relay import Relay
from ..session.updates import HookCounts
from ..session.upstreams import Resolver, Upstreams
from ..spans import Steps
from ..stats import ApplyStats, LagWaits
from ..strategy.factory import make_receiver
from ..strategy.hooks import StrategyHooks
from .controlled import ControlledFollower
from .controller import ControlCalls, Controller

if TYPE_CHECKING:
    from .http_api import ControlServer

log = logging.getLogger(__name__)

WrapWrite = Callable[[Callable[[], AbstractAsyncContextManager[Any]]], Callable[[], AbstractAsyncContextManager[Any]]]


class Receiver(ControlCalls):
    """The rollout-side daemon. An async context manager; see ``start`` and ``close``.

    Rollouts run inference under ``async with receiver.reading():`` (or
    ``receiver.lock.reading_sync()`` from a thread) and never see a half-applied version.
    """

    def __init__(
        self,
        model: StateLike,
        endpoint: str | Sequence[str] | Resolver,
        config: SyncConfig | Any = None,
        *,
        identity: str | None = None,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        reconnect_backoff: tuple[float, float] = (0.05, 2.0),
        context: zmq.asyncio.Context | None = None,
        stats_history: int = 1000,
        control_address: str | None = None,
        name_mapping: NameMappingSpec | None = None,
        wrap_write: WrapWrite | None = None,
        curve: CurveClient | None = None,
        insecure_plaintext: bool = False,
        limits: Limits | None = None,
        control_token: str | None = None,
        relay_endpoint: str | None = None,
        relay_curve: CurveServer | None = None,
        hold: bool = False,
        hooks: StrategyHooks | None = None,
        control_ignore_unknown: bool = False,
    ) -> None:
        """``control_address`` (``HOST:PORT``, port 0 for any) serves the control API over
        HTTP from ``start()``; ``name_mapping`` renames this model's names to the trainer's
        (see ``receiver/naming.py``), checked here and again by the sender at handshake.

        ``curve`` (``protocol.net.security.CurveClient``) encrypts the connection and accepts
        only the sender holding its ``server_key``; without it, connecting beyond loopback
        is a ``ConfigError`` unless ``insecure_plaintext``. ``limits`` bounds inbound
        messages (default: derived from this model). ``control_token`` is required by the
        control API (``Authorization: Bearer``) and must be set to serve it off localhost.
        ``control_ignore_unknown``: the control API ignores (and lists) parameters a changing
        call does not know, as FastDeploy does, instead of refusing the call (400).

        ``endpoint`` may be a list of upstreams (the sender, or relays) tried in turn:
        whenever a session is lost, the next one is tried. Or a resolver: a callable
        (sync or async) asked for the address before each session, for a sender whose
        address changes when it restarts (a Ray actor, a Kubernetes pod). ``relay_endpoint`` makes this
        receiver a relay (``receiver/session/relay.py``): from ``start()`` it serves the versions it
        has applied there, to receivers connecting as to a sender; ``relay_curve`` (a
        ``CurveServer``) secures that side.

        ``hold``: write only when asked. Versions (resyncs included) are received,
        validated and staged in the background, and committed only inside
        ``update_weights``; only the first bootstrap, into a model that holds no version
        yet, commits in ``start()``. For an engine that has its own weight-update window
        (vLLM: ``receiver.vllm``). A held receiver is paused for good: ``resume`` is a
        ``StateError``; unlike a paused one it stays connected.

        ``hooks`` (``receiver.StrategyHooks``): what the caller's engine adds around each
        version, fixed for the receiver's life: ``on_staged``, and ``on_commit`` (called
        in order inside the write, before a relay serves the version onwards). Its
        ``write_guard`` and ``commit_gate`` are the receiver's own (``wrap_write``, ``hold``)."""
        self._upstreams = Upstreams(endpoint, curve, insecure_plaintext)
        self.endpoints = self._upstreams.endpoints
        self.curve = curve
        self._control_token = control_token
        self._control_ignore_unknown = control_ignore_unknown
        self.model = model
        self.config = load_config(config)
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self.reconnect_backoff = reconnect_backoff
        context = context or shared_context()
        self.lock = ReadWriteLock()
        caller = hooks or StrategyHooks()
        if caller.write_guard is not nullcontext or caller.commit_gate is not None:
            raise ConfigError("hooks: write_guard and commit_gate are the receiver's own (wrap_write wraps its writes, hold=True gates its commits)")
        if hold and relay_endpoint is not None:
            raise ConfigError("a held receiver (hold=True) cannot relay: it commits only when asked")
        self.relay: Relay | None = None
        if relay_endpoint is not None:
            self.relay = Relay(
                relay_endpoint, lambda: self.strategy, self._state, self.lock, bucket_size=self.config.init_sync.bucket_size,
                heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout, context=context,
                curve=relay_curve, insecure_plaintext=insecure_plaintext,
            )
        self._task: asyncio.Task[None] | None = None
        self._started = False  # start() was called: a second call (also while the first compiles) is an error
        self._changed = asyncio.Condition()
        self._notifying: set[asyncio.Task[None]] = set()  # wake-ups after the task ended, kept until done
        self._failure: BaseException | None = None
        self._closing: asyncio.Task[None] | None = None  # ``close``, once called: from then on not healthy, waits fail
        self._asking: asyncio.Future[None] | None = None  # readers' question for the latest version, while one is out
        self.lag_waits = LagWaits()  # reading(max_lag=...)'s waits
        self._names = None if name_mapping is None else NameMapping(name_mapping, state_tensors(model))
        self.limits = limits or Limits.for_model(state_tensors(self._state()))
        # -- the session loop (receiver/session/follower.py) and the control state it asks (see pause / sleep / update_weights)
        self.hold = hold
        self._lifecycle = ControlState(hold=hold)  # paused, asleep, ...: what the session loop asks
        owner = Owner(
            lambda: self.strategy, self._state, self.lock, self._wait, self._notify, self._fail, lambda: self.metrics, self.relay, self._names,
        )
        self._follower = Follower(
            Settings(self.identity, heartbeat_interval, peer_timeout, reconnect_backoff, context, curve, self.limits, hold, stats_history),
            self._upstreams, self._lifecycle, owner,
        )
        self.strategy = make_receiver(self.config, self._strategy_hooks(caller, wrap_write))
        if self.relay is not None:  # its receivers hear the trainer's latest, not only the relay's own version, and at once
            relayed = self.relay.server
            relayed.upstream_latest = lambda: self._follower.latest.version
            self._follower.latest.listen(lambda _: relayed.announce())
        controlled = ControlledFollower(self._follower, owner, model, lambda: self.healthy)
        self._controller = Controller(self._lifecycle, controlled, identity=self.identity, writes_wrapped=wrap_write is not None)
        self.metrics = ReceiverMetrics(self._metric_state)  # after both: registering it reads their state
        self._control_address = control_address
        self._control_server: ControlServer | None = None

    def _strategy_hooks(self, caller: StrategyHooks, wrap_write: WrapWrite | None) -> StrategyHooks:
        """The caller's hooks with the receiver's own: its writes under ``lock`` (wrapped by
        ``wrap_write``), a held receiver's commit gate, then its relay's."""
        # wrap_write: a sidecar wraps each version's write (receiver.control.attach.seqlock_writes: a shared-memory seqlock)
        write = self.lock.writing if wrap_write is None else wrap_write(self.lock.writing)
        own = replace(caller, write_guard=write, commit_gate=self._follower.hold_bootstrap if self.hold else None)
        return own if self.relay is None else self.relay.compose(own)

    # -- public API -----------------------------------------------------------------
    async def start(self, timeout: float | None = 30.0) -> Receiver:
        """Connect, say HELLO with this model's metadata, and apply the bootstrap if one
        is needed. Returns once the first handshake is done; raises if it fails, or
        ``WeightSyncTimeout`` after ``timeout`` seconds of it (not counting compiling the
        kernels first, on a fresh install: ``python -m receiver compile`` does that ahead).
        A second call, also while the first is still under way, is a ``WeightSyncError``; so
        is a call after ``close``, or a ``close`` while it compiles (no session starts then)."""
        if self._closing is not None:
            raise WeightSyncError("receiver is closed")
        if self._started:
            raise WeightSyncError("receiver already started")
        self._started = True
        if self._control_address is not None:
            from .http_api import ControlServer  # aiohttp only when the control API is wanted

            self._control_server = ControlServer(self, self._control_address, token=self._control_token, ignore_unknown=self._control_ignore_unknown)
            await self._control_server.start()
        # Before the clock starts: on a fresh install this compiles the kernels (numba,
        # tens of seconds, cached on disk after), local work the timeout is not about.
        await self.strategy.prepare()
        if self._closing is not None:  # closed meanwhile: a session started now would outlive close
            raise WeightSyncError("receiver closed while it started")
        self._task = asyncio.get_running_loop().create_task(self._follower.run(), name=f"weightsync-receiver-{self.identity}")
        self._task.add_done_callback(self._run_done)
        await self._wait(lambda: self._follower.ready.is_set(), timeout, what="the first handshake")
        if self.relay is not None:
            link = self._follower.link
            self.relay.start(together=link is not None and link.together)
            log.info("receiver %s relays at %s", self.identity, self.relay.server.endpoint)
        return self

    @property
    def version(self) -> int | None:
        """The version the model holds (the strategy's: set by each commit), None while it
        holds none (before the first, after a version failed midway, while the weights sleep)."""
        return self.strategy.version

    @property
    def endpoint(self) -> str:
        """The upstream this receiver follows (or will try next; with a resolver, the
        address it last returned, empty before the first)."""
        return self._upstreams.endpoint

    @property
    def relay_endpoint(self) -> str | None:
        """Where this receiver relays, with the real port once started; None if it does not."""
        return None if self.relay is None else self.relay.server.endpoint

    @property
    def pending_version(self) -> int | None:
        """The version being received or applied now (staged while paused), else None."""
        return self._follower.pending_version

    @property
    def connected(self) -> bool:
        """A session with the upstream has completed its handshake and is up."""
        return self._follower.connected

    @property
    def reconnects(self) -> int:
        """Sessions with the upstream that ended and were restarted."""
        return self._follower.reconnects

    @property
    def stats(self) -> collections.OrderedDict[int, ApplyStats]:
        """The last ``stats_history`` versions' ``ApplyStats``, by version, oldest first."""
        return self._follower.stats

    def reading(
        self, max_lag: int | None = None, *, timeout: float | None = 60.0, max_age: float | None = None,
    ) -> AbstractAsyncContextManager[int | None]:
        """Hold the model still: no version is committed while inside. Yields the version
        held (None while it holds none): the tag of whatever is generated inside.

        ``max_lag=k`` bounds staleness: the weights held are at most ``k`` versions behind
        the trainer's latest (``latest_version``; through relays, the trainer's, not the
        relay's). Further behind, it waits, outside the lock so that commits go on, until
        they are not, for at most ``timeout`` seconds (``WeightSyncTimeout``). The latest is
        what the upstream last said (its heartbeats, each version received); knowledge older
        than ``max_age`` seconds (default: two heartbeat intervals; older after this process
        was stopped or its event loop blocked) is asked for afresh first, one question for
        all readers asking at once; while disconnected, it waits for the session to return.

        Concurrency: any number of readers at once, each its own bound; a commit waits for
        the readers inside, and readers arriving meanwhile wait for it (``ReadWriteLock``).
        """
        if max_lag is None:
            return self._reading()
        if type(max_lag) is not int or max_lag < 0:
            raise ConfigError(f"max_lag must be an int >= 0 (versions), got {max_lag!r}")
        return self._reading_bounded(max_lag, timeout, 2 * self.heartbeat_interval if max_age is None else max_age)

    def steps(self) -> Steps:
        """A generation that lets versions in between its steps (in-flight updates) instead
        of holding one for its whole length (``reading``): each ``step()`` (``step_sync()``
        from a thread, or every forward inside ``each_forward(model)``) runs on one whole
        version, and ``span`` says which versions the generation saw (``receiver/spans.py``)."""
        return Steps(self.lock, lambda: self.version)

    @property
    def latest_version(self) -> int | None:
        """The trainer's newest version as last heard (None: none heard yet); see ``reading``."""
        return self._follower.latest.version

    @property
    def latest_age(self) -> float:
        """Seconds since ``latest_version`` was last known to be the trainer's latest (inf:
        never); ``reading(max_lag=...)`` treats it as current up to its ``max_age``."""
        return self._follower.latest.age()

    async def refresh_latest(self, timeout: float | None) -> None:
        """Ask the upstream for the trainer's latest version now, as ``reading(max_lag=...)``
        does when what it heard is older than its ``max_age``: it waits, within ``timeout``,
        for a session and the answer. One question at a time for all callers and readers; a
        question that fails or runs out of time leaves the latest as it was (see
        ``latest_age``). For a sidecar publishing the latest to engines that cannot ask."""
        await self._ask_latest(timeout, 0.0)

    async def latest_news(self, seen: int | None, timeout: float | None) -> int | None:
        """Wait, for at most ``timeout`` seconds, until ``latest_version`` is other than
        ``seen``; returns it (unchanged, at the timeout). Any number of callers at once."""
        with contextlib.suppress(WeightSyncTimeout):
            await self._wait(lambda: self.latest_version != seen, timeout, fail=False, what="news of the latest version")
        return self.latest_version

    @contextlib.asynccontextmanager
    async def _reading(self) -> AsyncIterator[int | None]:
        async with self.lock.reading():
            yield self.version

    @contextlib.asynccontextmanager
    async def _reading_bounded(self, max_lag: int, timeout: float | None, max_age: float) -> AsyncIterator[int | None]:
        latest = self._follower.latest
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        def fresh_enough() -> bool:
            current, held = latest.version, self.version
            return held is not None and latest.age() <= max_age and (current is None or held >= current - max_lag)

        began: tuple[float, int | None, int | None] | None = None  # a wait's start: when, the version held, the latest
        while True:
            if latest.age() > max_age:
                await self._ask_latest(left(), max_age)
            async with self.lock.reading():
                if fresh_enough():
                    if began is not None:
                        self.lag_waits.waited(began[1], began[2], loop.time() - began[0])
                    yield self.version
                    return
                if began is None:
                    began = loop.time(), self.version, latest.version
            if deadline is not None and loop.time() >= deadline:
                self.lag_waits.waited(began[1], began[2], loop.time() - began[0], timed_out=True)
                raise WeightSyncTimeout(
                    f"receiver {self.identity} holds v{self.version}, more than max_lag={max_lag} versions behind the trainer's "
                    f"v{latest.version} (heard {latest.age():.3g}s ago), after {timeout:.3g}s"
                )
            # outside the lock: a commit may bring it within the bound; the latest is re-checked as it ages
            with contextlib.suppress(WeightSyncTimeout):
                step = max_age if deadline is None else min(max_age, left() or 0.0)
                await self._wait(lambda: fresh_enough() or latest.age() > max_age, step, what="weights within max_lag")

    async def _ask_latest(self, timeout: float | None, max_age: float) -> None:
        """Ask the upstream for the latest version (one question at a time for all readers),
        after waiting, within ``timeout``, for a session; a question that fails leaves the
        latest as it was (the caller's bound decides)."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self._ask_once(timeout if timeout is None else min(timeout, self.peer_timeout)))
            self._asking.add_done_callback(lambda f: f.cancelled() or f.exception())  # each reader raises what it sees
        # the caller's deadline ending this wait is a TimeoutError of asyncio's, not the question's:
        # the caller raises its own (WeightSyncTimeout), as when the question fails
        with contextlib.suppress(WeightSyncError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._asking), timeout)

    async def _ask_once(self, timeout: float | None) -> None:
        await self._wait(lambda: self.connected and self._follower.link is not None, timeout, what="a session with the upstream")
        link = self._follower.link
        if link is not None:
            await link.ask(self.version, False, timeout)

    def on_update(self, hook: Callable[[int | None], Any], *, timeout: float | None = None) -> None:
        """Call ``hook(version)`` after each version is committed and published, in order, one
        version at a time, in a task of the receiver's own (``receiver/session/updates.py``):
        the session goes on receiving and committing meanwhile, so ``version`` may already
        be newer when the hook runs (read the weights under ``reading()``). Async hooks are
        awaited and cancelled after ``timeout`` seconds (default 60); a sync hook runs on
        the event loop (keep it short). A hook that fails or times out is logged and counted
        (``hook_counts``); the others and the next versions go on. May be called at any
        time, also while hooks run: the new hook is told of the versions from then on."""
        self._follower.updates.add(hook, timeout)

    @property
    def hook_counts(self) -> HookCounts:
        """What the ``on_update`` hooks did: calls, failures, timeouts, versions skipped."""
        return self._follower.updates.counts

    async def hooks_idle(self, timeout: float | None = None) -> None:
        """Wait until every version published so far has been told to every ``on_update``
        hook (``asyncio.TimeoutError`` after ``timeout``)."""
        await self._follower.updates.idle(timeout)

    async def wait_for_version(self, version: int, timeout: float | None = None) -> int:
        """Wait until ``version`` (or a later one) is applied; returns the applied version."""
        await self._wait(lambda: self.version is not None and self.version >= version, timeout, what=f"v{version}")
        assert self.version is not None
        return self.version

    async def close(self) -> None:
        """Stop everything this receiver started, then close its sockets: the control API;
        the session loop, cancelled (a thread it runs is waited for: ``receiver/threads.py``),
        whose session stops its tasks and fails its queries before closing its socket; then
        the relay's server, likewise. Nothing it started runs once this returns (the loop's
        default executor and the codec pool, ``protocol/codec/parallel.py``, are shared, not
        its own). A second call, or one while the first runs, waits for the first; a caller
        cancelled meanwhile does not stop the close."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        await self._notify()  # control calls waiting on the receiver fail now
        if self._control_server is not None:
            await self._control_server.close()
        self._follower.say_goodbye()
        if self._task is not None:
            self._task.cancel()  # before the relay: no version commits into a closed relay
        await asyncio.gather(*(t for t in (self._task, *self._notifying) if t is not None), return_exceptions=True)
        await self._follower.updates.close()  # the hook running is cancelled; versions not yet told are dropped
        if self.relay is not None:
            await self.relay.close()
        if self.strategy.torn:
            log.warning("receiver %s closes with a torn model (a version failed midway): readers are let in, "
                        "on no whole version", self.identity)
            await self.strategy.release_torn()
        self.strategy.staging.clear()  # its pinned host memory (a part or a bucket) is not kept past close
        log.info("receiver %s closed at v%s", self.identity, self.version)

    @property
    def control_url(self) -> str | None:
        """``http://host:port`` of the control API once started, else None."""
        return None if self._control_server is None else self._control_server.url

    @property
    def healthy(self) -> bool:
        """Started, not closed, and not stopped by an error (its relay's included)."""
        running = self._task is not None and not self._task.done() and self._failure is None and self._closing is None
        return running and (self.relay is None or self.relay.server.failure is None)

    def status(self) -> dict[str, Any]:
        """Versions and state, as ``GET /v1/version`` reports them."""
        return {
            "identity": self.identity,
            "endpoint": self.endpoint,
            "relay_endpoint": self.relay_endpoint,
            "relay_receivers": None if self.relay is None else len(self.relay.server.receivers),
            "version": self.version,
            "latest_version": self.latest_version,
            "lag_waits": self.lag_waits.count,
            "hooks": self.hook_counts.as_dict() | {"waiting": self._follower.updates.waiting},
            "pending_version": self.pending_version,
            "is_paused": self._lifecycle.paused,
            "asleep": sorted(self._lifecycle.asleep),
            "connected": self.connected,
            "reconnects": self.reconnects,
            "healthy": self.healthy,
            "error": _describe_error(self._failure or (None if self.relay is None else self.relay.server.failure)),
        }

    def _state(self) -> StateLike:
        """What is synced: the model, or its tensors under the trainer's names."""
        if self._names is None:
            return self.model
        return self._names.rename(state_tensors(self.model))

    def _metric_state(self) -> ReceiverState:
        state, hooks = self._lifecycle, self._follower.updates
        return ReceiverState(
            self.version, self.pending_version, state.paused, self.connected, frozenset(state.asleep), self.reconnects, self.latest_version,
            hooks.counts.failures, hooks.counts.timeouts, hooks.counts.skipped, hooks.waiting,
        )

    async def __aenter__(self) -> Receiver:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- internals ----------------------------------------------------------------------
    async def _wait(self, predicate: Callable[[], bool], timeout: float | None, *, fail: bool = True, what: str = "") -> None:
        """Wait until ``predicate()`` holds; ``fail``: raise once the receiver failed or closed."""

        def check() -> bool:
            if self._failure is not None and fail:
                raise WeightSyncError(f"receiver {self.identity} failed: {self._failure}") from self._failure
            if self._closing is not None and fail:
                raise WeightSyncError(f"receiver {self.identity} is closed")
            return predicate()

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(check), timeout)
            except asyncio.TimeoutError:
                raise WeightSyncTimeout(f"timed out after {timeout:.3g}s waiting for {what or 'the receiver'} (at v{self.version})") from None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _fail(self, error: BaseException) -> None:
        self._failure = error

    def _run_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("receiver %s stopped: %r", self.identity, self._failure)
        if self._closing is None:  # whoever waits on this receiver raises its failure now
            notify = asyncio.get_running_loop().create_task(self._notify())
            self._notifying.add(notify)
            notify.add_done_callback(self._notifying.discard)


def _describe_error(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
