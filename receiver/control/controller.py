"""The rollout control calls: pause, resume, sleep, wakeup and update_weights.

Semantics as FastDeploy's rollout server: pause stops applying (the next version waits,
received and staged, in front of the commit) and tells the engine to stop generating;
update_weights applies received versions while paused and never resumes by itself;
sleep pauses, then releases the KV cache (the engine's hook) and the weights' memory;
wakeup brings the KV cache back first, then the weights as the sender's *current*
version, then resumes. abort_requests only forwards to the engine's hook; without one it
aborts nothing and reports the requested ids not found (FastDeploy's answer's shape).
``receiver/control/http_api.py`` serves these over HTTP.

Concurrency: pause, resume, sleep, wakeup and update_weights are serialised by one lock
(a second call waits for the first, then sees its result: each is idempotent);
abort_requests, is_paused and sender_version do not take it.

``Receiver`` composes a ``Controller``; its public methods of the same names are the
``ControlCalls`` below (their docstrings are the API's), each handing the call to it. The
controller writes the ``ControlState`` the session loop reads, and drives that loop through
``ControlTarget``: the few calls it needs of the receiver's session machinery
(``receiver/control/controlled.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from protocol.errors import ConfigError, IntegrityError, StateError, WeightSyncError
from protocol.state import Placed, StateLike, state_tensors

from .. import memory
from ..engine import KV_CACHE, WEIGHT, AbortHook, EngineHooks, Hook, call_hook, parse_tags, parse_version
from ..lifecycle import ControlState

log = logging.getLogger(__name__)


class ControlTarget(Protocol):
    """The receiver's session machinery, as the control calls drive it."""

    @property
    def version(self) -> int | None:
        """The applied version, None while it holds none."""
    @property
    def healthy(self) -> bool: ...
    @property
    def handshaking(self) -> bool:
        """A handshake is under way: its bootstrap commits ungated."""
    @property
    def handshakes(self) -> int:
        """How many sessions have completed their handshake so far."""

    def state(self) -> StateLike:
        """What is synced (the model, under the trainer's names)."""

    async def wait(self, predicate: Callable[[], bool], timeout: float | None, *, what: str = "") -> None:
        """Until ``predicate()`` holds, re-checked on each ``notify``; raises once the receiver failed or closed."""

    async def notify(self) -> None:
        """Wake every waiter (the session loop included) to look at the state again."""

    async def leave_session(self) -> None:
        """End the current session where no thread touches the model (``ControlState.leaving``)."""

    async def ask_sender(self, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        """The sender's current version and, if asked, its state digest (one round trip)."""

    async def digest(self) -> str | None:
        """This receiver's state digest; None when it holds only part of the model."""

    def nack(self, reason: str, message: str) -> None:
        """Ask the sender for a resync of its current version."""

    async def release_weights(self) -> memory.ReleasedWeights:
        """End the session, free every synced tensor's storage and forget the version, so
        the next session joins as a new receiver and is bootstrapped."""

    async def restore_weights(self, released: memory.ReleasedWeights) -> None:
        """Reallocate what ``release_weights`` freed, under the model's write side."""

    def bootstrap_coverage(self) -> tuple[int, int]:
        """(tensors the last handshake's bootstrap wrote, tensors a whole one writes)."""


class Controller:
    """The control calls' bodies; ``ControlCalls``' methods of the same names document them."""

    def __init__(self, state: ControlState, receiver: ControlTarget, *, identity: str, writes_wrapped: bool = False) -> None:
        """``identity``: the receiver's, for the log; ``writes_wrapped``: an engine maps the
        weights (wrap_write), so sleep cannot free them."""
        self.state = state
        self.receiver = receiver
        self._identity = identity
        self.engine = EngineHooks()
        self.lock = asyncio.Lock()  # one control call at a time
        self.released: memory.ReleasedWeights | None = None  # while the weights sleep
        self._writes_wrapped = writes_wrapped

    async def pause(self) -> None:
        async with self.lock:
            await self._pause()

    async def resume(self) -> None:
        async with self.lock:
            await self._resume()

    async def sleep(self, tags: str | Sequence[str] | None = None) -> dict[str, Any]:
        wanted = parse_tags(tags)
        if WEIGHT in wanted and any(isinstance(t, Placed) for t in state_tensors(self.receiver.state()).values()):
            raise ConfigError("sleep cannot release weights an engine holds in its own layout; use the engine's own sleep mode")
        if WEIGHT in wanted and self._writes_wrapped:  # wrap_write: shared with an engine
            raise ConfigError("sleep cannot release weights whose writes are wrapped (shared memory an engine maps); use tags=kv_cache")
        state = self.state
        async with self.lock:
            await self._pause()
            freed = 0
            if KV_CACHE in wanted and KV_CACHE not in state.asleep:
                await call_hook(self.engine.on_sleep_kv_cache)
                state.asleep.add(KV_CACHE)
            if WEIGHT in wanted and WEIGHT not in state.asleep:
                freed = await self._release_weights()
            await self.receiver.notify()
            return {"asleep": sorted(state.asleep), "freed_bytes": freed}

    async def wakeup(self, tags: str | Sequence[str] | None, timeout: float | None, *, require_resume: bool) -> dict[str, Any]:
        wanted = parse_tags(tags)
        state = self.state
        async with self.lock:
            state.check_wakeup(wanted, require_resume)
            if KV_CACHE in wanted and KV_CACHE in state.asleep:
                await call_hook(self.engine.on_wakeup_kv_cache)
                state.asleep.discard(KV_CACHE)
            if WEIGHT in wanted and WEIGHT in state.asleep:
                await self._restore_weights(timeout)
            if not state.asleep:
                await self._resume()
            await self.receiver.notify()
            return {"asleep": sorted(state.asleep), "version": self.receiver.version, "is_paused": state.paused}

    async def update_weights(self, version: int | str | None, verify_checksum: bool, timeout: float | None) -> int | None:
        target = parse_version(version)
        if type(verify_checksum) is not bool:
            raise ConfigError(f"verify_checksum must be true or false, got {verify_checksum!r}")
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        receiver, state = self.receiver, self.state
        async with self.lock:
            state.check_update()
            state.rejoin = True  # if the connection is down, reconnect even though paused
            await receiver.notify()
            try:
                latest, digest = None, None
                if target is None or verify_checksum:
                    latest, digest = await receiver.ask_sender(verify_checksum, left())
                target = latest if target is None else target
                if target is not None:  # already at or past it: the wait below returns at once
                    state.apply_until = target
                    await receiver.notify()
                    reached = target
                    await receiver.wait(lambda: receiver.version is not None and receiver.version >= reached, left(), what=f"v{target}")
            finally:
                state.apply_until = None
                state.rejoin = False
            if verify_checksum:  # under the control lock: no new version commits meanwhile
                await self._verify(latest, digest, left())
            return receiver.version

    async def abort_requests(self, abort_all: bool = False, req_ids: Sequence[str] | None = None) -> Any:
        if type(abort_all) is not bool:
            raise ConfigError(f"abort_all must be true or false, got {abort_all!r}")
        ids = [] if req_ids is None else req_ids
        if isinstance(ids, str) or not isinstance(ids, Sequence) or not all(isinstance(i, str) and i for i in ids):
            raise ConfigError(f"req_ids must be a list of request id strings, got {req_ids!r}")
        if not abort_all and not ids:
            raise ConfigError("must provide abort_all=true or req_ids")
        hook = self.engine.on_abort_requests
        if hook is None:  # no engine to abort in: nothing aborted, in FastDeploy's result shape
            return {"aborted": [], "not_found": [] if abort_all else list(ids)}
        return await call_hook(hook, abort_all, list(ids))

    async def sender_version(self, timeout: float | None) -> int | None:
        version, _ = await self.receiver.ask_sender(False, timeout)
        return version

    async def _pause(self) -> None:
        if self.state.paused:
            return
        await call_hook(self.engine.on_pause)
        self.state.paused = True
        await self.receiver.notify()
        if self.receiver.handshaking:  # a handshake commits its bootstrap ungated: abandon it, rejoin when needed
            await self.receiver.leave_session()
        log.info("receiver %s paused at v%s", self._identity, self.receiver.version)

    async def _resume(self) -> None:
        self.state.check_resume()
        if not self.state.paused:
            return
        await call_hook(self.engine.on_resume)
        self.state.paused = False
        await self.receiver.notify()
        log.info("receiver %s resumed at v%s", self._identity, self.receiver.version)

    async def _release_weights(self) -> int:
        self.state.asleep.add(WEIGHT)  # no new session from here on
        try:
            released = self.released = await self.receiver.release_weights()
        except BaseException:
            self.state.asleep.discard(WEIGHT)
            await self.receiver.notify()
            raise
        log.info("receiver %s released %d bytes of weights", self._identity, released.nbytes)
        return released.nbytes

    async def _restore_weights(self, timeout: float | None) -> None:
        receiver, state, released = self.receiver, self.state, self.released
        assert released is not None
        if not receiver.healthy:
            raise WeightSyncError("the receiver is not running (not started, failed or closed): it cannot fetch the weights")
        await receiver.restore_weights(released)
        state.asleep.discard(WEIGHT)
        state.rejoin = True
        handshakes = receiver.handshakes
        await receiver.notify()
        try:
            await receiver.wait(lambda: receiver.handshakes > handshakes, timeout, what="the sender's bootstrap")
            got, needed = receiver.bootstrap_coverage()
            if got < needed:
                raise ConfigError(
                    f"the sender's bootstrap restored {got} of {needed} tensors; the rest would be garbage. "
                    "Sleeping the weights needs init_sync enabled for every key on the sender"
                )
        except BaseException:  # the storages hold garbage: release them again, stay asleep
            state.rejoin = False
            state.asleep.add(WEIGHT)
            self.released = await receiver.release_weights()
            raise
        finally:
            state.rejoin = False
        self.released = None
        log.info("receiver %s woke up at v%s", self._identity, receiver.version)

    async def _verify(self, latest: int | None, digest: str | None, timeout: float | None) -> None:
        receiver = self.receiver
        if digest is None or latest != receiver.version:
            latest, digest = await receiver.ask_sender(True, timeout)
        if latest != receiver.version or digest is None:
            raise StateError(f"cannot verify v{receiver.version}: the sender is at v{latest} and has only its current version's digest")
        ours = await receiver.digest()
        if ours is None:
            raise StateError("this receiver holds only part of the model (tensor parallel): its digest cannot be compared with the sender's")
        if ours != digest:
            message = f"state digest of v{receiver.version} differs from the sender's (receiver {ours[:16]}, sender {digest[:16]}); resync requested"
            log.error("receiver %s: %s", self._identity, message)
            receiver.nack(IntegrityError.__name__, message)
            raise IntegrityError(message)


class ControlCalls:
    """The control calls as a receiver's public methods (``Receiver`` has them): each is
    carried out by its ``_controller``."""

    _controller: Controller

    @property
    def is_paused(self) -> bool:
        """True while no new version is applied (except through ``update_weights``)."""
        return self._controller.state.paused

    @property
    def asleep(self) -> frozenset[str]:
        """The memory tags released by ``sleep`` and not yet woken (``weight``, ``kv_cache``)."""
        return frozenset(self._controller.state.asleep)

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
