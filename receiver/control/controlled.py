"""A receiver's session machinery as its control calls drive it (``controller.ControlTarget``).

``Receiver`` builds one over its ``Follower`` and the model it writes, and hands it to its
``Controller``: the controller sees these few calls, not the receiver's private state.
What only the control calls do to a session is here: end it (``leave_session``, through
``ControlState.leaving``, which the session loop's waits see) and query its upstream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from protocol.errors import WeightSyncError
from protocol.state import StateLike, state_tensors

from .. import memory
from ..session.follower import Follower, Owner


class ControlledFollower:
    """``follower`` and ``model`` (what ``owner.state()`` shows under the trainer's names) as
    ``controller.ControlTarget``; ``healthy`` is the receiver's."""

    def __init__(self, follower: Follower, owner: Owner, model: StateLike, healthy: Callable[[], bool]) -> None:
        self._follower, self._owner, self._model, self._healthy = follower, owner, model, healthy

    @property
    def version(self) -> int | None:
        return self._follower.version

    @property
    def healthy(self) -> bool:
        return self._healthy()

    @property
    def handshaking(self) -> bool:
        return self._follower.handshaking

    @property
    def handshakes(self) -> int:
        return self._follower.handshakes

    def state(self) -> StateLike:
        return self._owner.state()

    async def wait(self, predicate: Callable[[], bool], timeout: float | None, *, what: str = "") -> None:
        await self._owner.wait(predicate, timeout, what=what)

    async def notify(self) -> None:
        await self._owner.notify()

    async def leave_session(self) -> None:
        """End the current session at a point where no thread touches the model."""
        follower = self._follower
        if not follower.in_session:
            return
        follower.lifecycle.leaving = True
        if follower.link is not None:
            follower.link.leave("asked to leave")
        await self._owner.notify()
        try:
            await self._owner.wait(lambda: not follower.in_session, None)
        finally:
            follower.lifecycle.leaving = False

    async def ask_sender(self, digest: bool, timeout: float | None) -> tuple[int | None, str | None]:
        """The sender's current version and, if asked, its state digest (one round trip)."""
        follower = self._follower
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def linked() -> bool:
            return follower.link is not None and follower.link.is_open

        # A held receiver's resync waits for update_weights inside its handshake: the
        # sender has welcomed it and answers on that socket already.
        await self._owner.wait(lambda: follower.connected or (follower.settings.hold and follower.handshaking and linked()), timeout,
                               what="a connection to the sender")
        link = follower.link
        if link is None:
            raise WeightSyncError("not connected to the sender")
        left = None if deadline is None else max(0.0, deadline - loop.time())
        return await link.ask(follower.version, digest, left)

    async def digest(self) -> str | None:
        return await self._follower.digest()

    def nack(self, reason: str, message: str) -> None:
        self._follower.nack(reason, message)

    async def release_weights(self) -> memory.ReleasedWeights:
        await self.leave_session()
        strategy = self._owner.strategy()
        async with strategy.exclusive():  # a relay's too: it serves children nothing from released storage
            released = memory.release(self._model, state_tensors(self._owner.state()))
            strategy.forget()  # the weights are gone: rejoin as a new receiver, so the sender bootstraps it
        self._follower.pending_version = None
        return released

    async def restore_weights(self, released: memory.ReleasedWeights) -> None:
        async with self._owner.lock.writing():
            released.restore()

    def bootstrap_coverage(self) -> tuple[int, int]:
        strategy = self._owner.strategy()
        meta, boot = strategy.metadata, self._follower.last_bootstrap
        assert meta is not None
        needed = len(meta.keys) - sum(len(a) for a in strategy.aliases.values())
        return (0 if boot is None else boot.tensors), needed
