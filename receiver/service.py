"""The receiver daemon: follows one sender, applies its versions in the background.

Receiving, decoding and validating run off the event loop; a version is committed
under the write side of ``lock`` and only then published as ``version``. Each connection
to the upstream is a ``Session`` (``receiver/session.py``: its socket, inbox, heartbeats
and queries); lost ones (nothing heard within ``peer_timeout``: no message, and over TCP no
byte) are re-established with backoff, resuming from the applied version.

The control calls (``pause``, ``resume``, ``sleep``, ``wakeup``, ``update_weights``) are
methods of this class, carried out by the ``Controller`` it composes
(``receiver/controller.py``, where their concurrency is documented);
``receiver/http_api.py`` serves them over HTTP. While paused, versions keep arriving and
the connection and heartbeats stay up, but the next version waits, received and staged,
in front of the commit until ``resume`` or ``update_weights``.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from protocol.config import SyncConfig, load_config
from protocol.errors import (
    ConfigError,
    IntegrityError,
    LimitError,
    MetadataMismatchError,
    ProtocolError,
    ResyncLimitError,
    StaleVersionError,
    WeightSyncError,
    WeightSyncTimeout,
)
from protocol.net.context import shared_context
from protocol.net.security import CurveClient, CurveServer, check_transport
from protocol.progress import Progress
from protocol.state import StateLike, state_tensors
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, peek_type
from protocol.wire.limits import Limits
from protocol.wire.messages import Ack, Nack

from . import memory
from .controller import Controller
from .digest import digest_of
from .engine import AbortHook, EngineHooks, Hook
from .factory import make_receiver
from .hooks import StrategyHooks
from .incoming import WHOLE_MODEL, Incoming
from .lifecycle import ControlState
from .metrics import ReceiverMetrics, ReceiverState
from .naming import NameMapping, NameMappingSpec
from .pending import PendingVersion
from .relay import Relay
from .rwlock import ReadWriteLock
from .session import Leave, Reconnect, Session
from .stats import ApplyStats

if TYPE_CHECKING:
    from .http_api import ControlServer

log = logging.getLogger(__name__)

_REJECTED = (StaleVersionError, ProtocolError, IntegrityError)  # the sender can fix these with a resync
_FATAL = (MetadataMismatchError, ConfigError, ResyncLimitError)  # reconnecting would not help
HANDSHAKE_GRACE = 60.0  # seconds past peer_timeout for each message of a handshake (``_handshake``)
TRICKLE_BPS = 4096  # bytes a second that heartbeats alone never reach: more is a message in progress
Resolver = Callable[[], "str | Awaitable[str]"]  # asked for the sender's address before each session


class Receiver:
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
        wrap_write: Callable[[Callable[[], AbstractAsyncContextManager[Any]]], Callable[[], AbstractAsyncContextManager[Any]]] | None = None,
        curve: CurveClient | None = None,
        insecure_plaintext: bool = False,
        limits: Limits | None = None,
        control_token: str | None = None,
        relay_endpoint: str | None = None,
        relay_curve: CurveServer | None = None,
        hold: bool = False,
        hooks: StrategyHooks | None = None,
    ) -> None:
        """``control_address`` (``HOST:PORT``, port 0 for any) serves the control API over
        HTTP from ``start()``; ``name_mapping`` renames this model's names to the trainer's
        (see ``receiver/naming.py``), checked here and again by the sender at handshake.

        ``curve`` (``protocol.net.security.CurveClient``) encrypts the connection and accepts
        only the sender holding its ``server_key``; without it, connecting beyond loopback
        is a ``ConfigError`` unless ``insecure_plaintext``. ``limits`` bounds inbound
        messages (default: derived from this model). ``control_token`` is required by the
        control API (``Authorization: Bearer``) and must be set to serve it off localhost.

        ``endpoint`` may be a list of upstreams (the sender, or relays) tried in turn:
        whenever a session is lost, the next one is tried. Or a resolver: a callable
        (sync or async) asked for the address before each session, for a sender whose
        address changes when it restarts (a Ray actor, a Kubernetes pod). ``relay_endpoint`` makes this
        receiver a relay (``receiver/relay.py``): from ``start()`` it serves the versions it
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
        self._resolver = endpoint if callable(endpoint) else None
        self.endpoints = [] if callable(endpoint) else [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints and self._resolver is None:
            raise ConfigError("a receiver needs at least one upstream endpoint")
        for upstream in self.endpoints:
            check_transport(upstream, curve, insecure_plaintext, role="receiver")
        self._upstream = 0
        self._resolved: str | None = None
        self._insecure_plaintext = insecure_plaintext
        self.curve = curve
        self._control_token = control_token
        self.model = model
        self.config = load_config(config)
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.heartbeat_interval, self.peer_timeout = heartbeat_interval, peer_timeout
        self.reconnect_backoff = reconnect_backoff
        self._context = context or shared_context()
        self.lock = ReadWriteLock()
        caller = hooks or StrategyHooks()
        if caller.write_guard is not nullcontext or caller.commit_gate is not None:
            raise ConfigError("hooks: write_guard and commit_gate are the receiver's own (wrap_write wraps its writes, hold=True gates its commits)")
        if hold and relay_endpoint is not None:
            raise ConfigError("a held receiver (hold=True) cannot relay: it commits only when asked")
        # wrap_write: a sidecar wraps each version's write (receiver.attach.seqlock_writes: a shared-memory seqlock)
        write = self.lock.writing if wrap_write is None else wrap_write(self.lock.writing)
        own = replace(caller, write_guard=write, commit_gate=self._hold_bootstrap if hold else None)
        self.relay: Relay | None = None
        if relay_endpoint is not None:
            self.relay = Relay(
                relay_endpoint, lambda: self.strategy, self._state, self.lock, bucket_size=self.config.init_sync.bucket_size,
                heartbeat_interval=heartbeat_interval, peer_timeout=peer_timeout, context=self._context,
                curve=relay_curve, insecure_plaintext=insecure_plaintext,
            )
            own = self.relay.compose(own)
        self.strategy = make_receiver(self.config, own)
        self.stats: collections.OrderedDict[int, ApplyStats] = collections.OrderedDict()
        self._stats_history = stats_history
        self.pending_version: int | None = None  # being received or applied now
        self.connected = False
        self.reconnects = 0
        self._handshakes = 0
        self._hooks: list[Callable[[int | None], Any]] = []
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._started = False  # start() was called: a second call (also while the first compiles) is an error
        self._notifying: set[asyncio.Task[None]] = set()  # wake-ups after the task ended, kept until done
        self._ready = asyncio.Event()
        self._failure: BaseException | None = None
        self._link: Session | None = None  # the connection to the upstream, while there is one
        self._closed = False
        self._closing: asyncio.Task[None] | None = None  # ``close``, once called
        self._names = None if name_mapping is None else NameMapping(name_mapping, state_tensors(model))
        # -- control state (see pause / sleep / update_weights)
        self.hold = hold
        self._lifecycle = ControlState(hold=hold)  # paused, asleep, ...: what the session loop asks
        self._controller = Controller(self._lifecycle, _ControlledReceiver(self), identity=self.identity, writes_wrapped=wrap_write is not None)
        self._in_session = False
        self._handshaking = False
        self._last_bootstrap: ApplyStats | None = None
        self.metrics = ReceiverMetrics(self._metric_state)
        self._control_address = control_address
        self._control_server: ControlServer | None = None
        self.limits = limits or Limits.for_model(state_tensors(self._state()))

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

            self._control_server = ControlServer(self, self._control_address, token=self._control_token)
            await self._control_server.start()
        # Before the clock starts: on a fresh install this compiles the kernels (numba,
        # tens of seconds, cached on disk after), local work the timeout is not about.
        await self.strategy.prepare()
        if self._closing is not None:  # closed meanwhile: a session started now would outlive close
            raise WeightSyncError("receiver closed while it started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"weightsync-receiver-{self.identity}")
        self._task.add_done_callback(self._run_done)
        await self._wait(lambda: self._ready.is_set(), timeout, what="the first handshake")
        if self.relay is not None:
            self.relay.start()
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
        return self.endpoints[self._upstream] if self._resolver is None else self._resolved or ""

    @property
    def relay_endpoint(self) -> str | None:
        """Where this receiver relays, with the real port once started; None if it does not."""
        return None if self.relay is None else self.relay.server.endpoint

    def reading(self) -> AbstractAsyncContextManager[None]:
        """Hold the model still: no version is committed while inside."""
        return self.lock.reading()

    def on_update(self, hook: Callable[[int | None], Any]) -> None:
        """Call ``hook(version)`` after each version is committed (async hooks are awaited)."""
        self._hooks.append(hook)

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
            self._closed = True  # at once: from now on ``healthy`` is False and waits fail
            self._closing = asyncio.ensure_future(self._close())
        await asyncio.shield(self._closing)

    async def _close(self) -> None:
        await self._notify()  # control calls waiting on the receiver fail now
        if self._control_server is not None:
            await self._control_server.close()
        if self._link is not None:
            self._link.try_send(Message(MessageType.BYE, version=self.version))
        if self._task is not None:
            self._task.cancel()  # before the relay: no version commits into a closed relay
        await asyncio.gather(*(t for t in (self._task, *self._notifying) if t is not None), return_exceptions=True)
        if self.relay is not None:
            await self.relay.close()
        if self.strategy.torn:
            log.warning("receiver %s closes with a torn model (a version failed midway): readers are let in, "
                        "on no whole version", self.identity)
            await self.strategy.release_torn()
        self.strategy.staging.clear()  # its pinned host memory (a part or a bucket) is not kept past close
        log.info("receiver %s closed at v%s", self.identity, self.version)

    # -- control: carried out by self._controller (receiver/controller.py) ---------------
    @property
    def is_paused(self) -> bool:
        """True while no new version is applied (except through ``update_weights``)."""
        return self._lifecycle.paused

    @property
    def asleep(self) -> frozenset[str]:
        """The memory tags released by ``sleep`` and not yet woken (``weight``, ``kv_cache``)."""
        return frozenset(self._lifecycle.asleep)

    def register_engine(
        self,
        *,
        on_pause: Hook | None = None,
        on_resume: Hook | None = None,
        on_sleep_kv_cache: Hook | None = None,
        on_wakeup_kv_cache: Hook | None = None,
        on_abort_requests: AbortHook | None = None,
    ) -> None:
        """Connect the rollout engine: these hooks (sync or async) are called by the control
        calls, with no arguments except ``on_abort_requests(abort_all, req_ids)``, whose
        return value ``abort_requests`` returns. Replaces hooks registered before."""
        self._controller.engine = EngineHooks(on_pause, on_resume, on_sleep_kv_cache, on_wakeup_kv_cache, on_abort_requests)

    async def pause(self) -> None:
        """Stop generating (the engine's ``on_pause``) and stop applying new versions.

        Idempotent. Versions keep arriving: the next one is staged and waits, the rest
        stay queued. Returns once no version can be committed until ``resume`` or
        ``update_weights``; a handshake under way is abandoned (its bootstrap may commit
        first) and a new session starts only when one of those needs it.
        """
        await self._controller.pause()

    async def resume(self) -> None:
        """Generate again (``on_resume``) and apply versions as they come. Idempotent; an
        error while something is asleep (wake it up first)."""
        await self._controller.resume()

    async def sleep(self, tags: str | Sequence[str] | None = None) -> dict[str, Any]:
        """Pause, then release memory: ``kv_cache`` through the engine's hook, ``weight``
        by leaving the sender and resizing every synced tensor's storage to zero bytes
        (tensor objects, shapes and dtypes stay; non-persistent buffers are not touched).
        ``tags`` default to both. Returns the tags asleep and the weight bytes freed."""
        return await self._controller.sleep(tags)

    async def wakeup(
        self, tags: str | Sequence[str] | None = None, timeout: float | None = 60.0, *, require_resume: bool = False,
    ) -> dict[str, Any]:
        """Undo ``sleep`` for ``tags`` (default both), the KV cache first, then resume once
        nothing is asleep. Weights come back as the sender's *current* version: storages
        are reallocated and the receiver rejoins as a new one, so the sender bootstraps it.
        Waking the weights while the KV cache sleeps and stays asleep is a ``StateError``.

        ``require_resume`` (the HTTP API's: FastDeploy resumes after every wakeup) refuses,
        with a ``StateError`` and nothing changed, a wakeup that would leave a tag asleep:
        the engine cannot generate on freed memory, so it could not resume."""
        return await self._controller.wakeup(tags, timeout, require_resume=require_resume)

    async def update_weights(
        self, version: int | str | None = None, verify_checksum: bool = False, timeout: float | None = 60.0
    ) -> int | None:
        """While paused, apply the received versions up to ``version`` and stay paused.

        ``version`` None means the sender's current version, asked of the sender now; a
        string's trailing digits are the version (``"global_step_12"``). Versions apply
        in order until the applied one is at least ``version`` (a resync may land past
        it); a receiver already at or past it applies nothing (in a stream of versions,
        "at least this one" is what a caller needs). ``verify_checksum`` then compares
        the whole-state digest with the sender's, which it has for its current version
        only; a mismatch requests a resync and raises ``IntegrityError``. Not paused, or
        asleep: ``StateError``. Returns the version held, which may be past ``version``.
        """
        return await self._controller.update_weights(version, verify_checksum, timeout)

    async def abort_requests(self, abort_all: bool = False, req_ids: Sequence[str] | None = None) -> Any:
        """Abort the engine's requests, all of them or ``req_ids``, through its
        ``on_abort_requests`` hook; returns what the hook returned. Weights and the paused
        state are untouched, and the control lock is not taken: an abort does not wait
        behind a running update_weights. No hook registered: nothing is aborted, as
        FastDeploy answers, ``{"aborted": [], "not_found": req_ids}`` (``[]`` for all)."""
        return await self._controller.abort_requests(abort_all, req_ids)

    async def sender_version(self, timeout: float | None = 30.0) -> int | None:
        """The sender's current version (one round trip). Safe beside any other call; a
        held receiver can ask while a resync waits for ``update_weights``."""
        return await self._controller.sender_version(timeout)

    @property
    def control_url(self) -> str | None:
        """``http://host:port`` of the control API once started, else None."""
        return None if self._control_server is None else self._control_server.url

    @property
    def healthy(self) -> bool:
        """Started, not closed, and not stopped by an error (its relay's included)."""
        running = self._task is not None and not self._task.done() and self._failure is None and not self._closed
        return running and (self.relay is None or self.relay.server.failure is None)

    def status(self) -> dict[str, Any]:
        """Versions and state, as ``GET /v1/version`` reports them."""
        return {
            "identity": self.identity,
            "endpoint": self.endpoint,
            "relay_endpoint": self.relay_endpoint,
            "relay_receivers": None if self.relay is None else len(self.relay.server.receivers),
            "version": self.version,
            "pending_version": self.pending_version,
            "is_paused": self._lifecycle.paused,
            "asleep": sorted(self._lifecycle.asleep),
            "connected": self.connected,
            "reconnects": self.reconnects,
            "healthy": self.healthy,
            "error": _describe_error(self._failure or (None if self.relay is None else self.relay.server.failure)),
        }

    async def _leave_session(self) -> None:
        """End the current session at a point where no thread touches the model."""
        if not self._in_session:
            return
        self._lifecycle.leaving = True
        if self._link is not None:
            self._link.leave("asked to leave")
        await self._notify()
        try:
            await self._wait(lambda: not self._in_session, None)
        finally:
            self._lifecycle.leaving = False

    def _nack(self, reason: str, message: str) -> None:
        """Ask the sender for a resync of its current version."""
        self.metrics.nack(reason)
        if self._link is not None:
            self._link.try_send(Nack(reason, message).to_message(self.version))

    async def _ask_sender(self, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        """The sender's current version and, if asked, its state digest (one round trip)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        def linked() -> bool:
            return self._link is not None and self._link.is_open

        # A held receiver's resync waits for update_weights inside its handshake: the
        # sender has welcomed it and answers on that socket already.
        await self._wait(lambda: self.connected or (self.hold and self._handshaking and linked()), timeout,
                         what="a connection to the sender")
        link = self._link
        if link is None:
            raise WeightSyncError("not connected to the sender")
        left = None if deadline is None else max(0.0, deadline - loop.time())
        return await link.ask(self.version, digest, left)

    def _model_bytes(self) -> int | None:
        """What a bootstrap of the whole model about weighs: its tensors at their dtypes, each
        storage once (None where the model is not plain tensors): the progress lines' total."""
        try:
            once = {t.data_ptr(): t.numel() * t.element_size() for t in state_tensors(self._state()).values()}  # tied: once
            return sum(once.values())
        except Exception:
            return None

    def _state(self) -> StateLike:
        """What is synced: the model, or its tensors under the trainer's names."""
        if self._names is None:
            return self.model
        return self._names.rename(state_tensors(self.model))

    def _metric_state(self) -> ReceiverState:
        state = self._lifecycle
        sender_version = None if self._link is None else self._link.sender_version
        return ReceiverState(
            self.version, self.pending_version, state.paused, self.connected, frozenset(state.asleep), self.reconnects, sender_version
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
            if self._closed and fail:
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

    def _run_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._failure is None:
            self._failure = task.exception()
            log.error("receiver %s stopped: %r", self.identity, self._failure)
        if not self._closed:  # whoever waits on this receiver raises its failure now
            notify = asyncio.get_running_loop().create_task(self._notify())
            self._notifying.add(notify)
            notify.add_done_callback(self._notifying.discard)

    async def _run(self) -> None:
        delay = self.reconnect_backoff[0]
        while True:
            await self._wait(self._lifecycle.may_connect, None, fail=False)  # paused or asleep: no new session
            handshakes = self._handshakes
            try:
                await self._session()
            except Leave:
                self.connected = False
                log.info("receiver %s left the sender", self.identity)
                await self._notify()
                continue
            except Reconnect as e:
                log.warning("receiver %s: %s; reconnecting in %.2fs", self.identity, e, delay)
            except _FATAL as e:
                self._failure = e
                await self._notify()
                raise
            finally:
                self.connected = False
            await self._notify()
            self.reconnects += 1
            if self.endpoints:
                self._upstream = (self._upstream + 1) % len(self.endpoints)  # a lost parent: try the next
            if self._handshakes != handshakes:  # that session worked: start backing off afresh
                delay = self.reconnect_backoff[0]
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_backoff[1])

    async def _session(self) -> None:
        """One connection: HELLO (with the digest, computed first: HELLO must be the first
        message of a session, before any heartbeat), the handshake, then versions until
        the session ends (``Reconnect``, ``Leave``, or an error)."""
        self._in_session = self._handshaking = True
        # From here on, _leave_session can end this session.
        link = self._link = Session(
            self.identity, heartbeat=lambda: (self.version, self._below()),
            heartbeat_interval=self.heartbeat_interval, peer_timeout=self.peer_timeout,
        )
        goodbye: Message | None = None
        try:
            digest = await self._digest() if self.version is not None else None
            link.open(self._context, await self._find_upstream(), curve=self.curve, limits=self.limits)
            try:
                await self._handshake(link, digest)
            except LimitError:
                raise  # this receiver's limits refuse the sender's bootstrap: asking again would not help
            except _REJECTED as e:  # a bootstrap that arrived damaged: ask again, from HELLO
                raise Reconnect(f"the handshake failed: {type(e).__name__}: {e}") from e
            self._handshaking = False
            await self._notify()
            await self._follow(link)
        except Leave:
            goodbye = Message(MessageType.BYE, version=self.version)
            raise
        finally:
            try:
                await link.close(goodbye)
            finally:
                self._link = None
                self._in_session = self._handshaking = False

    async def _find_upstream(self) -> str:
        """The address for this session: the current list entry, or what the resolver says now."""
        if self._resolver is None:
            return self.endpoint
        try:
            found = self._resolver()
            if inspect.isawaitable(found):
                found = await asyncio.wait_for(found, self.peer_timeout)
        except Exception as e:  # the sender may be restarting: ask again after a backoff
            raise Reconnect(f"the endpoint resolver failed: {e!r}") from e
        if not isinstance(found, str) or not found:
            raise ConfigError(f"the endpoint resolver returned {found!r}, not an address")
        check_transport(found, self.curve, self._insecure_plaintext, role="receiver")
        self._resolved = found
        return found

    async def _digest(self) -> str | None:
        """The state digest, or None when this receiver holds only part of the model
        (an engine's tensor-parallel rank: ``protocol.state.Placed``)."""
        return await digest_of(state_tensors(self._state()), self.lock, self.strategy.metadata, self.strategy.aliases)

    async def _hold_bootstrap(self, pending: PendingVersion) -> None:
        """A resync of a held receiver waits, staged, for ``update_weights``."""
        if self.version is None:
            return  # the first bootstrap: the model holds no version to keep serving
        self.pending_version = pending.version
        await self._notify()
        try:
            await self._wait(lambda: self._lifecycle.may_commit(pending.version, self.version), None, fail=False)
        finally:
            self.pending_version = None
        if self._lifecycle.leaving:
            raise Leave("asked to leave")

    async def _handshake(self, link: Session, digest: str | None) -> None:
        # Each message of the handshake (WELCOME, then every bootstrap part) within the
        # bound, not the whole: a large model's bootstrap takes as long as its bytes take.
        # The sender heartbeats while it answers, so silence (peer_timeout) means it is
        # gone; this bounds one that is alive but sends nothing. A held resync waiting,
        # staged, for update_weights receives nothing meanwhile, and is not bounded.
        # A message still arriving at more than heartbeats' rate extends the bound: on a
        # slow link one bucket can take longer than it (counted over TCP on Linux only).
        bound = self.peer_timeout + HANDSHAKE_GRACE
        # A long bootstrap's progress: over TCP on Linux as its bytes arrive (a bucket can be
        # large), elsewhere message by message.
        incoming = Incoming(link, Progress(log, f"receiver {self.identity} bootstrap from {self.endpoint}", self._model_bytes(),
                                            peer=self.identity))
        welcomed = False

        async def recv() -> Sequence[Buffer]:
            nonlocal welcomed
            before = link.bytes_received()
            while True:
                try:
                    frames = await asyncio.wait_for(link.recv(), bound)
                    if welcomed:  # every message after WELCOME is a bootstrap part
                        nbytes = sum(len(f) for f in frames)
                        self.metrics.bootstrap_bytes.inc(nbytes)
                        incoming.message(nbytes)
                    else:  # what follows WELCOME is the bootstrap: counted as its bytes arrive
                        incoming.watch()
                    welcomed = True
                    return frames
                except TimeoutError:
                    after = link.bytes_received()
                    if before is None or after is None or after - before < TRICKLE_BPS * bound:
                        raise Reconnect(f"no handshake message from the sender within {bound:.3g}s") from None
                    before = after

        held = self.version
        try:
            version = await self.strategy.init_receiver(self._state(), recv, link.send, receiver_id=self.identity, digest=digest)
        except MetadataMismatchError as e:
            if self._names is None:
                raise
            raise MetadataMismatchError(self._names.explain(str(e))) from e
        finally:
            await incoming.close()
        self.connected = True
        self._handshakes += 1
        boot = self.strategy.last_stats
        self.strategy.last_stats = None
        self._last_bootstrap = boot if boot is not None and boot.kind == "bootstrap" else None
        if boot is not None and boot.kind == "bootstrap":
            self._record(boot)
        if (boot is not None and boot.kind == "bootstrap") or version != held:
            await self._publish(version, link)
        else:  # resumed where it was: nothing new to announce to hooks, only to the sender
            link.try_send(self._below().to_message(version))
        self._ready.set()
        log.info("receiver %s connected to %s at v%s", self.identity, self.endpoint, version,
                 extra={"receiver": self.identity, "endpoint": self.endpoint, "version": version})

    async def _follow(self, link: Session) -> None:
        awaiting_resync = False
        last_type: list[MessageType | None] = [None]
        incoming: list[Incoming] = []  # a whole model arriving (a resync, a bucket version): its progress

        async def seen(*_: Any) -> Sequence[Buffer]:  # remembers what kind of message was rejected
            frames = await link.recv()
            kind = last_type[0] = peek_type(frames)
            if kind in WHOLE_MODEL or incoming:
                if not incoming:
                    what = "resync" if kind is MessageType.BOOTSTRAP else "buckets"
                    progress = Progress(log, f"receiver {self.identity} {what} from {self.endpoint}", self._model_bytes(), peer=self.identity)
                    incoming.append(Incoming(link, progress))
                incoming[0].message(sum(len(f) for f in frames))
            return frames

        async def gate(pending: PendingVersion) -> None:
            self.pending_version = pending.version
            await self._notify()
            await self._wait(lambda: self._lifecycle.may_commit(pending.version, self.version), None, fail=False)  # paused: wait here, staged
            if self._lifecycle.leaving:
                raise Leave("asked to leave")

        while True:
            try:
                try:
                    # Written on arrival (bucket.load_instant), a version passes the gate before its first write.
                    pending = await self.strategy.receive(self._state(), seen, before_write=gate)
                finally:  # its transfer is over, whole or not: before the commit, so that nothing
                    if incoming:  # suspends between the commit and its record and publication
                        await incoming.pop().close()
                if not pending.written:
                    await gate(pending)
                await self.strategy.commit(self._state(), pending)
            except _REJECTED as e:
                if self.strategy.torn:  # failed midway: the model holds no version (``version`` is None)
                    await self._notify()
                if isinstance(e, StaleVersionError) and e.held:  # sent before a resync that overtook it, or a replay
                    log.debug("receiver %s dropped a version it holds: %s", self.identity, e)
                    continue
                # One NACK per incident: the sender resyncs once, and what it had in flight
                # is rejected meanwhile. A rejected resync itself is a new incident.
                if not awaiting_resync or last_type[0] is MessageType.BOOTSTRAP:
                    log.warning("receiver %s rejected an update at v%s: %s", self.identity, self.version, e)
                    self._nack(type(e).__name__, str(e))
                    awaiting_resync = True
                continue
            finally:
                self.pending_version = None
            awaiting_resync = False
            self._record(pending.stats)
            await self._publish(pending.version, link)
            # Published: its staged changes (an index and a value each, decoded here) go now,
            # after the ACK, not when the next version replaces ``pending``. Whole tensors stay
            # until then: most are views of the received frames, whose memory the next
            # receive reuses; freed now, it goes back to the OS and that receive faults it in
            # afresh (docs/performance.md, *The memory pass's next sync*).
            pending.updates = [u for u in pending.updates if u.flat is None]

    def _below(self) -> Ack:
        """A relay tells its parent about the receivers below it (see ``Sender.wait_acked(tree=True)``)."""
        return Ack(None if self.relay is None else self.relay.server.subtree())

    def _record(self, stats: ApplyStats) -> None:
        self.metrics.applied(stats)
        if stats.version is not None:
            self.stats[stats.version] = stats
            while len(self.stats) > self._stats_history:
                self.stats.popitem(last=False)

    async def _publish(self, version: int | None, link: Session) -> None:
        """``version`` is committed (the strategy holds it): tell the sender, the hooks and the waiters."""
        link.try_send(self._below().to_message(version))
        for hook in self._hooks:
            try:
                result = hook(version)
                if asyncio.iscoroutine(result):
                    await result
            except Exception:
                log.exception("on_update hook failed at v%s", version)
        await self._notify()


class _ControlledReceiver:
    """A ``Receiver``'s session machinery as its control calls drive it
    (``controller.ControlTarget``): its controller's view of its private state."""

    def __init__(self, receiver: Receiver) -> None:
        self._r = receiver

    @property
    def version(self) -> int | None:
        return self._r.version

    @property
    def healthy(self) -> bool:
        return self._r.healthy

    @property
    def handshaking(self) -> bool:
        return self._r._handshaking

    @property
    def handshakes(self) -> int:
        return self._r._handshakes

    def state(self) -> StateLike:
        return self._r._state()

    async def wait(self, predicate: Callable[[], bool], timeout: float | None, *, what: str = "") -> None:
        await self._r._wait(predicate, timeout, what=what)

    async def notify(self) -> None:
        await self._r._notify()

    async def leave_session(self) -> None:
        await self._r._leave_session()

    async def ask_sender(self, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        return await self._r._ask_sender(digest, timeout)

    async def digest(self) -> str | None:
        return await self._r._digest()

    def nack(self, reason: str, message: str) -> None:
        self._r._nack(reason, message)

    async def release_weights(self) -> memory.ReleasedWeights:
        r = self._r
        await r._leave_session()
        async with r.strategy.exclusive():  # a relay's too: it serves children nothing from released storage
            released = memory.release(r.model, state_tensors(r._state()))
            r.strategy.forget()  # the weights are gone: rejoin as a new receiver, so the sender bootstraps it
        r.pending_version = None
        return released

    async def restore_weights(self, released: memory.ReleasedWeights) -> None:
        async with self._r.lock.writing():
            released.restore()

    def bootstrap_coverage(self) -> tuple[int, int]:
        meta, boot = self._r.strategy.metadata, self._r._last_bootstrap
        assert meta is not None
        needed = len(meta.keys) - sum(len(a) for a in self._r.strategy.aliases.values())
        return (0 if boot is None else boot.tensors), needed


def _describe_error(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
