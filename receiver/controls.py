"""The rollout control calls: pause, resume, sleep, wakeup and update_weights.

Semantics as the seed's rollout server: pause stops applying (the next version waits,
received and staged, in front of the commit) and tells the engine to stop generating;
update_weights applies received versions while paused and never resumes by itself;
sleep pauses, then releases the KV cache (the engine's hook) and the weights' memory;
wakeup brings the KV cache back first, then the weights as the sender's *current*
version, then resumes. abort_requests only forwards to the engine's hook.
``receiver/control.py`` serves these over HTTP.

Concurrency: pause, resume, sleep, wakeup and update_weights are serialised by one lock
(a second call waits for the first, then sees its result: each is idempotent);
abort_requests, is_paused and sender_version do not take it.

A mixin of ``Receiver``: the state it reads and the session machinery it drives (leave
the session, wait, ask the sender) are the daemon's, declared below for type checking.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from protocol.buffers import Buffer
from protocol.errors import ConfigError, IntegrityError, StateError, WeightSyncError
from protocol.framing import Message, MessageType, decode_message, encode_message
from protocol.state import Placed, StateLike, resolve_state

from . import memory
from .engine import KV_CACHE, WEIGHT, AbortHook, EngineHooks, Hook, call_hook, parse_tags, parse_version

if TYPE_CHECKING:
    from .base import ReceiverBase
    from .lifecycle import ControlState
    from .rwlock import ReadWriteLock
    from .socket import DealerSocket
    from .stats import ApplyStats

log = logging.getLogger(__name__)


class Controls:
    """Pause / resume / sleep / wakeup / update_weights of a ``Receiver``."""

    if TYPE_CHECKING:  # the Receiver's, set in its __init__
        model: StateLike
        identity: str
        lock: ReadWriteLock
        strategy: ReceiverBase
        version: int | None
        pending_version: int | None
        connected: bool
        _control: asyncio.Lock
        _engine: EngineHooks
        hold: bool
        _lifecycle: ControlState
        _released: memory.ReleasedWeights | None
        _handshaking: bool
        _handshakes: int
        _last_bootstrap: ApplyStats | None
        _writes_wrapped: bool
        _socket: DealerSocket | None
        _queries: dict[str, asyncio.Future[tuple[int | None, str | None]]]

        @property
        def endpoint(self) -> str: ...
        @property
        def healthy(self) -> bool: ...
        async def _wait(self, predicate: Callable[[], bool], timeout: float | None, *, fail: bool = True, what: str = "") -> None: ...
        async def _notify(self) -> None: ...
        async def _leave_session(self) -> None: ...
        async def _digest(self) -> str | None: ...
        def _nack(self, reason: str, message: str) -> None: ...
        def _state(self) -> StateLike: ...

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
        self._engine = EngineHooks(on_pause, on_resume, on_sleep_kv_cache, on_wakeup_kv_cache, on_abort_requests)

    async def pause(self) -> None:
        """Stop generating (the engine's ``on_pause``) and stop applying new versions.

        Idempotent. Versions keep arriving: the next one is staged and waits, the rest
        stay queued. Returns once no version can be committed until ``resume`` or
        ``update_weights``; a handshake under way is abandoned (its bootstrap may commit
        first) and a new session starts only when one of those needs it.
        """
        async with self._control:
            await self._pause()

    async def resume(self) -> None:
        """Generate again (``on_resume``) and apply versions as they come. Idempotent; an
        error while something is asleep (wake it up first)."""
        async with self._control:
            await self._resume()

    async def sleep(self, tags: str | Sequence[str] | None = None) -> dict[str, Any]:
        """Pause, then release memory: ``kv_cache`` through the engine's hook, ``weight``
        by leaving the sender and resizing every synced tensor's storage to zero bytes
        (tensor objects, shapes and dtypes stay; non-persistent buffers are not touched).
        ``tags`` default to both. Returns the tags asleep and the weight bytes freed."""
        wanted = parse_tags(tags)
        if WEIGHT in wanted and any(isinstance(t, Placed) for t in resolve_state(self._state()).tensors.values()):
            raise ConfigError("sleep cannot release weights an engine holds in its own layout; use the engine's own sleep mode")
        if WEIGHT in wanted and self._writes_wrapped:  # wrap_write: shared with an engine
            raise ConfigError("sleep cannot release weights whose writes are wrapped (shared memory an engine maps); use tags=kv_cache")
        async with self._control:
            await self._pause()
            freed = 0
            if KV_CACHE in wanted and KV_CACHE not in self._lifecycle.asleep:
                await call_hook(self._engine.on_sleep_kv_cache)
                self._lifecycle.asleep.add(KV_CACHE)
            if WEIGHT in wanted and WEIGHT not in self._lifecycle.asleep:
                freed = await self._release_weights()
            await self._notify()
            return {"asleep": sorted(self._lifecycle.asleep), "freed_bytes": freed}

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
        wanted = parse_tags(tags)
        async with self._control:
            left = sorted(self._lifecycle.asleep - wanted)
            if require_resume and left:
                raise StateError(f"wakeup of {sorted(wanted)} would leave {left} asleep, and generating on freed memory is unsafe, "
                                 f"so the engine would stay paused: wake {sorted(self._lifecycle.asleep)} together (or give no tags)")
            if WEIGHT in wanted and KV_CACHE not in wanted and KV_CACHE in self._lifecycle.asleep:
                raise StateError("the KV cache is asleep: wake it before or with the weights (tags=kv_cache,weight)")
            if KV_CACHE in wanted and KV_CACHE in self._lifecycle.asleep:
                await call_hook(self._engine.on_wakeup_kv_cache)
                self._lifecycle.asleep.discard(KV_CACHE)
            if WEIGHT in wanted and WEIGHT in self._lifecycle.asleep:
                await self._restore_weights(timeout)
            if not self._lifecycle.asleep:
                await self._resume()
            await self._notify()
            return {"asleep": sorted(self._lifecycle.asleep), "version": self.version, "is_paused": self._lifecycle.paused}

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
        target = parse_version(version)
        if type(verify_checksum) is not bool:
            raise ConfigError(f"verify_checksum must be true or false, got {verify_checksum!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        async with self._control:
            if not self._lifecycle.paused:
                raise StateError("Pause LLM Engine first: update_weights needs a paused receiver (it never resumes by itself)")
            if self._lifecycle.asleep:
                raise StateError(f"{sorted(self._lifecycle.asleep)} asleep: wakeup first")
            self._lifecycle.rejoin = True  # if the connection is down, reconnect even though paused
            await self._notify()
            try:
                latest, digest = None, None
                if target is None or verify_checksum:
                    latest, digest = await self._ask_sender(verify_checksum, left())
                target = latest if target is None else target
                if target is not None:  # already at or past it: the wait below returns at once
                    self._lifecycle.apply_until = target
                    await self._notify()
                    await self._wait(lambda: self.version is not None and self.version >= target, left(), what=f"v{target}")
            finally:
                self._lifecycle.apply_until = None
                self._lifecycle.rejoin = False
            if verify_checksum:  # under the control lock: no new version commits meanwhile
                await self._verify(latest, digest, left())
            return self.version

    async def abort_requests(self, abort_all: bool = False, req_ids: Sequence[str] | None = None) -> Any:
        """Abort the engine's requests, all of them or ``req_ids``, through its
        ``on_abort_requests`` hook; returns what the hook returned. Weights and the paused
        state are untouched, and the control lock is not taken: an abort does not wait
        behind a running update_weights. No hook registered: ``StateError``."""
        if type(abort_all) is not bool:
            raise ConfigError(f"abort_all must be true or false, got {abort_all!r}")
        ids = [] if req_ids is None else req_ids
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not all(isinstance(i, str) and i for i in ids):
            raise ConfigError(f"req_ids must be a list of request id strings, got {req_ids!r}")
        if not abort_all and not ids:
            raise ConfigError("must provide abort_all=true or req_ids")
        hook = self._engine.on_abort_requests
        if hook is None:
            raise StateError("no engine hook aborts requests: Receiver.register_engine(on_abort_requests=...)")
        return await call_hook(hook, abort_all, list(ids))

    async def sender_version(self, timeout: float | None = 30.0) -> int | None:
        """The sender's current version (one round trip). Safe beside any other call; a
        held receiver can ask while a resync waits for ``update_weights``."""
        version, _ = await self._ask_sender(False, timeout)
        return version

    async def _pause(self) -> None:
        if self._lifecycle.paused:
            return
        await call_hook(self._engine.on_pause)
        self._lifecycle.paused = True
        await self._notify()
        if self._handshaking:  # a handshake commits its bootstrap ungated: abandon it, rejoin when needed
            await self._leave_session()
        log.info("receiver %s paused at v%s", self.identity, self.version)

    async def _resume(self) -> None:
        if self.hold:
            raise StateError("a held receiver (hold=True) commits only in update_weights; it cannot resume")
        if self._lifecycle.asleep:
            raise StateError(f"{sorted(self._lifecycle.asleep)} asleep: wakeup first")
        if not self._lifecycle.paused:
            return
        await call_hook(self._engine.on_resume)
        self._lifecycle.paused = False
        await self._notify()
        log.info("receiver %s resumed at v%s", self.identity, self.version)

    async def _release_weights(self) -> int:
        self._lifecycle.asleep.add(WEIGHT)  # no new session from here on
        try:
            await self._leave_session()
            async with self.strategy.exclusive():  # a relay's too: it serves children nothing from released storage
                self._released = memory.release(self.model, resolve_state(self._state()).tensors)
                # The weights are gone: rejoin as a new receiver, so the sender bootstraps it.
                self.version = self.strategy.version = self.strategy.session = None
        except BaseException:
            self._lifecycle.asleep.discard(WEIGHT)
            await self._notify()
            raise
        self.pending_version = None
        log.info("receiver %s released %d bytes of weights", self.identity, self._released.nbytes)
        return self._released.nbytes

    async def _restore_weights(self, timeout: float | None) -> None:
        released = self._released
        assert released is not None
        if not self.healthy:
            raise WeightSyncError("the receiver is not running (not started, failed or closed): it cannot fetch the weights")
        async with self.lock.writing():
            released.restore()
        self._lifecycle.asleep.discard(WEIGHT)
        self._lifecycle.rejoin = True
        handshakes = self._handshakes
        await self._notify()
        try:
            await self._wait(lambda: self._handshakes > handshakes, timeout, what="the sender's bootstrap")
            self._check_bootstrap_complete()
        except BaseException:  # the storages hold garbage: release them again, stay asleep
            self._lifecycle.rejoin = False
            self._lifecycle.asleep.add(WEIGHT)
            await self._leave_session()
            async with self.strategy.exclusive():
                self._released = memory.release(self.model, resolve_state(self._state()).tensors)
                self.version = self.strategy.version = self.strategy.session = None
            raise
        finally:
            self._lifecycle.rejoin = False
        self._released = None
        log.info("receiver %s woke up at v%s", self.identity, self.version)

    def _check_bootstrap_complete(self) -> None:
        meta, boot = self.strategy.metadata, self._last_bootstrap
        assert meta is not None
        needed = len(meta.keys) - sum(len(a) for a in self.strategy.aliases.values())
        got = 0 if boot is None else boot.tensors
        if got < needed:
            raise ConfigError(
                f"the sender's bootstrap restored {got} of {needed} tensors; the rest would be garbage. "
                "Sleeping the weights needs init_sync enabled for every key on the sender"
            )

    async def _ask_sender(self, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        """The sender's current version and, if asked, its state digest (one round trip)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        # A held receiver's resync waits for update_weights inside its handshake: the
        # sender has welcomed it and answers on that socket already.
        await self._wait(lambda: self.connected or (self.hold and self._handshaking and self._socket is not None), timeout,
                         what="a connection to the sender")
        sock = self._socket
        if sock is None:
            raise WeightSyncError("not connected to the sender")
        nonce = uuid.uuid4().hex
        reply: asyncio.Future[tuple[int | None, str | None]] = loop.create_future()
        self._queries[nonce] = reply
        try:
            sock.try_send(encode_message(Message(MessageType.DIGEST_REQUEST, version=self.version, body={"nonce": nonce, "digest": digest})))
            left = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                return await asyncio.wait_for(reply, left)
            except asyncio.TimeoutError:
                raise asyncio.TimeoutError(f"the sender at {self.endpoint} did not answer within {timeout}s") from None
        finally:
            self._queries.pop(nonce, None)

    def _answer(self, frames: Sequence[Buffer]) -> None:
        try:
            msg = decode_message(frames)
        except WeightSyncError as e:
            log.warning("receiver %s: dropping a bad DIGEST reply: %s", self.identity, e)
            return
        reply = self._queries.get(str(msg.body.get("nonce")))
        digest = msg.body.get("digest")
        if reply is not None and not reply.done():
            reply.set_result((msg.version, digest if isinstance(digest, str) else None))

    async def _verify(self, latest: int | None, digest: str | None, timeout: float | None) -> None:
        if digest is None or latest != self.version:
            latest, digest = await self._ask_sender(True, timeout)
        if latest != self.version or digest is None:
            raise StateError(f"cannot verify v{self.version}: the sender is at v{latest} and has only its current version's digest")
        ours = await self._digest()
        if ours is None:
            raise StateError("this receiver holds only part of the model (tensor parallel): its digest cannot be compared with the sender's")
        if ours != digest:
            message = f"state digest of v{self.version} differs from the sender's (receiver {ours[:16]}, sender {digest[:16]}); resync requested"
            log.error("receiver %s: %s", self.identity, message)
            self._nack(IntegrityError.__name__, message)
            raise IntegrityError(message)
