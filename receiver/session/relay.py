"""A receiver that relays: it serves the versions it has applied to receivers below it.

A tree of relays keeps the trainer's uplink flat as the fleet grows: the trainer sends
each update once per first-level child, and each relay forwards it, with the same
protocol, to its own children. A relay forwards exactly the frames it received (patch
or bucket payloads are not decoded twice nor re-encoded), re-stamped. A patch's parts go
on as each passes the relay's own checks, before the relay has the whole version, let
alone commits it, so a tree's latency does not grow by one apply a level (a paused relay
still feeds its children); each child commits only whole versions it checked itself. A
patch the relay could not take whole (a part refused, a resync instead) is abandoned
below it too: its children hold the parts unwritten until their own resync. Bucket
versions and bootstraps go on once the relay has committed them; under
``commit="together"`` a bucket version goes on once the relay has staged it whole (its
children commit only at the flip, which comes once the relay's upstream has it staged).

Under ``commit="together"`` a relay reports a version staged upward (``report``) only once
its own receivers have staged it too, or its own deadline went without some (named upward:
``protocol/net/flips.py``); when the flip comes down it flips them at once (``flip``), as
it commits.

Forwarded messages keep the upstream session id: every relay below one trainer speaks
for the same lineage of versions, so a child that moves to another relay (its parent
died) resumes from that relay's ring instead of taking a bootstrap. A child joining
behind the ring gets a bootstrap built from the relay's own model.

The relay's lock is held around every commit of the receiver (``guard``): a bootstrap
or digest served to a child is always of the version the relay announces.

A relay's weights can sleep (``Receiver.sleep``, under the same guard): it goes on serving
what it holds without them (its ring of patches, a bootstrap still cached), and refuses
what needs them (a new bootstrap, a digest) with a ``StateError``, which makes a child
reconnect, to its next upstream, until the relay wakes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from protocol.codec.buckets import bucket_messages, plan_buckets
from protocol.errors import ConfigError, MetadataMismatchError, StateError, WeightSyncError
from protocol.net.flips import RELAY_SHARE, STAGE_TIMEOUT, Flip, Flips
from protocol.net.server import VersionServer
from protocol.quant import holds_fp8
from protocol.state import StateLike, state_tensors
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message, MessageType
from protocol.wire.limits import Limits
from protocol.wire.messages import Ack, Hello, Welcome
from protocol.wire.metadata import ModelMetadata

from ..rwlock import ReadWriteLock
from ..strategy.base import ReceiverBase
from ..strategy.hooks import StrategyHooks, WriteGuard
from ..strategy.pending import PendingVersion
from ..threads import in_thread


class Relay:
    """Serves ``strategy()``'s applied versions of ``state()`` at ``endpoint``: the
    ``VersionSource`` of its ``server``.

    Built by ``Receiver(..., relay_endpoint=...)`` before its strategy, whose hooks
    ``compose`` adds this relay's to; ``lock`` is that receiver's model lock.
    """

    def __init__(
        self,
        endpoint: str,
        strategy: Callable[[], ReceiverBase],
        state: Callable[[], StateLike],
        lock: ReadWriteLock,
        *,
        bucket_size: int,
        **server: Any,
    ) -> None:
        """``server``: ``VersionServer``'s options (ring size, credits, timings, context, CURVE)."""
        self.server = VersionServer(endpoint, role="relay", **server)
        self._held, self._state, self._model_lock = strategy, state, lock
        self._bucket_size = bucket_size
        self._open: tuple[int | None, int] | None = None  # (base, version) of the patch whose parts go on as they pass
        self._forwarded: int | None = None  # under together: the bucket version that went on once staged, before its commit
        # told when this relay's receivers are done staging a version: its receiver reports it upward now
        self.tell_upstream: Callable[[], None] | None = None

    def compose(self, hooks: StrategyHooks) -> StrategyHooks:
        """``hooks`` with this relay's: commits under ``guard``; each patch part forwarded
        once it passed its checks; bucket versions and bootstraps kept and served onwards
        once committed, after ``hooks``' own ``on_commit`` (an engine's install is part of
        the write: a bucket version it fails is never served)."""
        if hooks.on_part is not None:
            raise ConfigError("hooks: on_part is a relay's own (Receiver(relay_endpoint=) forwards parts with it)")
        return replace(
            hooks, write_guard=self.guard(hooks.write_guard), on_commit=(*hooks.on_commit, self._committed), keep_messages=True,
            on_part=self._passed,
        )

    @property
    def _strategy(self) -> ReceiverBase:
        return self._held()

    def start(self, together: bool = False) -> None:
        """Bind and serve; the receiver has completed its first handshake. ``together``: its
        upstream flips versions (``commit="together"``): so does this relay, for its children,
        at its upstream's word, once the receivers below it staged each (``report``)."""
        server, version = self.server, self._strategy.version
        if together:
            server.flips = Flips(stage_timeout=self._stage_timeout(), follow=True)
            server.flips.on_ready = self._ready
        server.moved(version)
        if server.flips is not None and version is not None:  # what it holds is flipped already
            server.flips.decide(version)
        if self._strategy.session is not None:
            server.stamp.session = self._strategy.session
        server.start(self, Limits.for_control(state_tensors(self._state())))

    async def close(self) -> None:
        await self.server.close()

    def guard(self, write: WriteGuard) -> WriteGuard:
        """Wrap the receiver's write guard: commits and what children are served exclude
        each other, so a child's bootstrap is never labelled with another version."""

        @asynccontextmanager
        async def guarded() -> AsyncIterator[None]:
            async with self.server.lock, write():
                yield

        return guarded

    def _passed(self, pending: PendingVersion, msg: Message) -> None:
        """A message passed the relay's checks: a patch's part goes to the children now."""
        version, server = pending.version, self.server
        if pending.type is not MessageType.PATCH or version is None:
            self._forward_buckets(pending, msg)
            return
        pending.messages = []  # forwarded here, not kept for the commit
        key = (pending.base_version, version)
        if self._open != key:
            self._abandon_open()  # a patch the relay never took whole (refused midway, superseded)
            self._follow_lineage()
            self._open = key
            self._wait_staged(version)
        server.publish_patch(pending.base_version, version, server.stamp(msg), last=msg.last)

    def _forward_buckets(self, pending: PendingVersion, msg: Message) -> None:
        """Under together, a bucket version staged whole goes on now: the flip it waits for
        waits for the receivers below this relay to stage it too."""
        version, server = pending.version, self.server
        if pending.type is not MessageType.BUCKET or version is None or server.flips is None or not msg.last:
            return
        self._abandon_open()
        self._follow_lineage()
        messages, pending.messages = pending.messages, []
        self._wait_staged(version)
        server.publish_buckets(version, [server.stamp(m) for m in messages])
        self._forwarded = version

    def _wait_staged(self, version: int) -> None:
        """Under together: ``version`` goes to the receivers below; its flip here waits for them
        staged (ready, ``report``), within a share of the upstream's ``stage_timeout``."""
        flips = self.server.flips
        if flips is not None and (flips.flipped is None or version > flips.flipped):  # (not a version flipped already, sent again)
            flips.stage_timeout = self._stage_timeout()
            flips.published(version, [p.name for p in self.server.peers.values()])

    def _stage_timeout(self) -> float:
        upstream = self._strategy.stage_timeout
        return RELAY_SHARE * (STAGE_TIMEOUT if upstream is None else upstream)

    def _ready(self, flip: Flip) -> None:
        if self.tell_upstream is not None:
            self.tell_upstream()

    def report(self, staged: int | None) -> Ack:
        """What this relay's ACKs and heartbeats say upward: the receivers below it
        (``VersionServer.subtree``) and, under together, ``staged`` (the version it holds
        staged itself) once they are done staging it too: every one of them staged it, or its
        deadline went without those named in ``Ack.missing``. Reads only: called from the
        receiver's heartbeats and ACKs as often as they go."""
        below, flips = self.server.subtree(), self.server.flips
        if staged is None or flips is None:
            return Ack(below, staged)
        flip = flips.ready(staged)
        return Ack(below) if flip is None else Ack(below, staged, flip.left_out())

    def flip(self, version: int) -> None:
        """Its upstream flipped ``version``, which this relay commits now: so do the receivers
        below it, at once (those that did not stage it are resynced). Again for the same
        version (its commit also decides it) it does nothing."""
        if self.server.flips is not None:
            self.server.flipped(self.server.flips.decide(version))

    def _abandon_open(self) -> None:
        if self._open is not None:
            self.server.abandon_patch(*self._open)
            self._open = None

    def _follow_lineage(self) -> None:
        """Forwarded messages keep the upstream's session: a new one starts a new lineage."""
        session, server = self._strategy.session, self.server
        if session is not None and session != server.stamp.session:
            server.stamp.session = session
            server.forget()

    def _committed(self, pending: PendingVersion) -> None:
        """The receiver applied ``pending`` (called inside ``guard``): it is the relay's
        version now (a patch's parts went on as they passed), served onwards."""
        messages, version, server = pending.messages, pending.version, self.server
        pending.messages = []
        if pending.type is MessageType.PATCH and version is not None and self._open == (pending.base_version, version):
            self._open = None  # every part is out already
            server.moved(version)
        else:
            self._abandon_open()
            self._follow_lineage()
            if pending.type is MessageType.PATCH and version is not None and messages:
                server.moved(version)
                for i, msg in enumerate(messages):  # every part: the relay applied them all
                    server.publish_patch(pending.base_version, version, server.stamp(msg), last=i + 1 == len(messages))
            elif pending.type is MessageType.BUCKET and version is not None:
                server.moved(version)
                if self._forwarded != version:  # else: out already, once staged
                    server.publish_buckets(version, [server.stamp(m) for m in messages])
            else:  # a bootstrap (a resync from upstream): children behind it are resynced too
                server.forget()
                server.moved(version)
        if server.flips is not None and version is not None:  # committed: its children commit now (if ``flip`` did not say so first)
            server.flipped(server.flips.decide(version))

    # -- VersionSource: what the server asks ----------------------------------------------
    async def admit(self, hello: Hello) -> Welcome:
        metadata = self._strategy.metadata
        if metadata is None:
            raise WeightSyncError("this relay has not completed its own handshake yet")
        metadata.require_same(hello.metadata, "this relay's model")
        if holds_fp8(metadata.dtypes):
            mine = self._strategy.config.fp8.format
            told = mine if hello.quant is None else hello.quant
            if told != mine:
                raise MetadataMismatchError(f"this receiver declares {told.describe()}; this relay holds {mine.describe()}")
        aliases = tuple((a, c) for c, group in self._strategy.aliases.items() for a in group)
        return Welcome(self._strategy.strategy, aliases, 0)

    async def bootstrap(self, version: int | None) -> list[Message]:
        metadata = self._strategy.metadata
        if metadata is None or self._strategy.version != version:
            raise StateError("this relay's weights are released (asleep): it cannot build a bootstrap until it wakes")
        aliases = {a for group in self._strategy.aliases.values() for a in group}
        keys = [k for i, k in enumerate(metadata.keys) if i not in aliases]
        tensors = state_tensors(self._state())
        buckets = plan_buckets(keys, lambda k: tensors[k].numel() * tensors[k].element_size(), self._bucket_size)
        messages = bucket_messages(
            MessageType.BOOTSTRAP, buckets, tensors.__getitem__, metadata.ordinal, lambda _, t: t.dtype, None,
            version=version, copy=True,  # copies: the model moves on while frames are queued
        )
        async with self._model_lock.reading():
            return await in_thread(list, messages)

    async def digest(self, version: int | None) -> str:
        if self._strategy.version != version:  # under the lock, as the release is
            raise StateError("this relay's weights are released (asleep): it has no digest until it wakes")
        tensors = state_tensors(self._state())
        async with self._model_lock.reading():
            return await in_thread(state_digest, tensors, list(tensors))

    def describe(self) -> ModelMetadata | None:
        return self._strategy.metadata
