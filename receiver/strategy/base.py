"""What both receiver strategies share: the handshake, and collecting a version's messages,
checked (``checks.py``) and staged (``decode.py``) off the event loop, for the
all-or-nothing write (``write_side.py``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar

import torch

from protocol.codec.staging import StagingPool
from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError, ProtocolError, WeightSyncError
from protocol.quant import holds_fp8
from protocol.state import StateLike, find_aliases, state_tensors
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, decode_message, encode_message
from protocol.wire.messages import ErrorReport, Hello, Welcome
from protocol.wire.metadata import ModelMetadata

from ..apply.checks import Claims, check_first, check_same_version, check_untracked, claim
from ..apply.commit import StagedUpdate, Target
from ..apply.decode import decode_part
from ..stats import ApplyStats
from ..threads import in_thread
from .hooks import HOOK_NAMES, StrategyHooks
from .pending import Announced, PendingVersion, _Superseded
from .write_side import WriteSide

log = logging.getLogger(__name__)

Send = Callable[[Sequence[Buffer]], Awaitable[Any]]
Recv = Callable[[], Awaitable[Sequence[Buffer]]]


class ReceiverBase(WriteSide):
    """The rollout side of one sync channel.

    Nothing is written into the model until every message of a version has arrived and
    been checked against the model: sizes, dtypes, index bounds and checksums (and, for a
    handshake's bootstrap, against what WELCOME announced). After an error before the
    write the model is exactly as it was, and ``version`` is unchanged.

    Except where a strategy writes on arrival (``writes_on_arrival``: the bucket
    strategy's ``load_instant``): each message is checked, then written at once, under
    the write side taken at the first one and held for the whole version, so only one
    message's worth is ever staged.

    Once any of a version is written, whatever ends it before it is whole and published
    (an error, a cancellation, a timeout, a failing ``on_commit``) leaves the model *torn*
    (``torn``): ``version`` is None, never the previous one over mixed weights, and the
    write side stays held (readers are kept out) until a whole version is written over
    it; the version is never published. A cancelled write finishes its thread first, so
    nothing is written after the failure is recorded.
    """

    strategy: ClassVar[str]
    data_type: ClassVar[MessageType]
    _hooks: StrategyHooks  # set once in __init__; ``__setattr__`` refuses it after

    def __init__(self, config: SyncConfig | Any = None, hooks: StrategyHooks | None = None) -> None:
        object.__setattr__(self, "_hooks", hooks or StrategyHooks())
        self.config = load_config(config)
        self.version: int | None = None
        self.session: str | None = None
        self.metadata: ModelMetadata | None = None
        self.aliases: dict[int, list[int]] = {}
        self.together = False  # the session's WELCOME: versions commit when flipped, so each is staged whole first
        self.stage_timeout: float | None = None  # and how long its server waits for them staged (a relay takes a share)
        self._own_ties: dict[str, str] = {}  # this model's tied names (alias -> canonical), checked against WELCOME's
        self.last_stats: ApplyStats | None = None
        self._turn = asyncio.Lock()  # one apply() at a time, in the order they were called
        self.device = torch.device("cpu")  # where buffers are decoded
        # Reused host buffers (pinned where CUDA is available) through which each part's
        # device-coded payloads reach a GPU target in one copy (receiver/apply/transfer.py).
        self.staging = StagingPool()
        self._torn: AbstractAsyncContextManager[Any] | None = None  # the write side, kept: a version failed midway
        self._resend = False  # the session asked for a resend (``resend_asked``): parts may come again

    def __setattr__(self, name: str, value: Any) -> None:
        if name in HOOK_NAMES:
            raise AttributeError(f"{type(self).__name__}.{name}: hooks are given once, at construction (StrategyHooks)")
        object.__setattr__(self, name, value)

    @property
    def hooks(self) -> StrategyHooks:
        """What this strategy calls around each version (fixed at construction)."""
        return self._hooks

    # -- handshake --------------------------------------------------------------------
    async def init_receiver(
        self,
        model: StateLike,
        recv: Recv,
        send: Send,
        *,
        receiver_id: str = "",
        digest: str | None = None,
        flip: bool = False,
    ) -> int | None:
        """Send HELLO with this model's metadata, then take WELCOME and apply the bootstrap.

        Returns the version the receiver is at afterwards (None when the sender has none).
        ``flip``: the caller stages versions and commits each when its server flips it
        (a ``Receiver`` does; a sender with ``commit="together"`` refuses the others), and,
        if it relays, reports one staged only once its own receivers have (``Hello.subtree``).
        """
        tensors = state_tensors(model)
        self.metadata = ModelMetadata.of(tensors)
        self._own_ties = find_aliases(tensors)
        # session: the sender session it last followed, to resume from its ring
        # weights held in float8 declare their block and scale format (protocol.quant): the sender quantizes into it
        quant = self.config.fp8.format if holds_fp8(self.metadata.dtypes) else None
        hello = Hello(
            self.metadata, receiver=receiver_id, applied=self.version, digest=digest, session=self.session, flip=flip, subtree=flip,
            quant=quant,
        )
        await send(encode_message(hello.to_message(self.version)))
        self.session = None  # WELCOME may come from a new sender session
        await self.prepare()  # while the sender builds the bootstrap
        welcome = await self._next(recv)
        if welcome.type is not MessageType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {welcome.describe()}")
        told = self._welcome(welcome)
        if told.untracked:
            await in_thread(check_untracked, tensors, self.metadata, told.untracked)
        parts = told.bootstrap
        if parts:
            pending = await self.receive(model, recv, bootstrap=Announced(welcome.version, parts))
            if self._hooks.commit_gate is not None:
                await self._hooks.commit_gate(pending)
            await self.commit(model, pending)
        self.version = welcome.version
        return self.version

    def forget(self) -> None:
        """The model's weights were released: hold no version and follow no session, so the
        next handshake joins as a new receiver (and is bootstrapped); the pinned staging
        buffer (up to a bucket) goes with them."""
        self.version = self.session = None
        self.staging.clear()

    async def prepare(self) -> None:
        """Hook: one-time work that can overlap the handshake (compiling kernels)."""

    def _welcome(self, msg: Message) -> Welcome:
        assert self.metadata is not None
        welcome = Welcome.from_body(msg.body)  # the fields' types; what needs the model is checked here
        if welcome.strategy != self.strategy:
            raise ConfigError(f"sender uses the {welcome.strategy!r} strategy, this receiver is {self.strategy!r}")
        n = len(self.metadata.keys)
        self.aliases = {}
        meta = self.metadata
        for tied, to in welcome.aliases:
            if tied >= n or to >= n:
                raise ProtocolError(f"WELCOME has a bad alias entry {[tied, to]!r:.60}: this model has {n} tensors")
            if tied == to or (meta.shapes[tied], meta.dtypes[tied]) != (meta.shapes[to], meta.dtypes[to]):
                raise ProtocolError(f"WELCOME ties {meta.keys[tied]!r} to {meta.keys[to]!r}, which differ in shape or dtype")
            self.aliases.setdefault(to, []).append(tied)
        # A tie only this side has would get two different tensors written into one storage.
        group = {a: c for c, tied in self.aliases.items() for a in tied}
        for alias, canonical in self._own_ties.items():
            a, c = meta.ordinal(alias), meta.ordinal(canonical)
            if group.get(a, a) != group.get(c, c):
                raise MetadataMismatchError(
                    f"key {alias!r} shares storage with {canonical!r} on the receiver, but the sender holds them as two "
                    "tensors: untie them on the rollout or tie them on the trainer"
                )
        self.session = msg.session
        self.together, self.stage_timeout = welcome.together, welcome.stage_timeout
        return welcome

    def resend_asked(self) -> None:
        """The caller asked its upstream to send again what follows ``version`` (a NACK
        ``BEHIND``: parts were lost on the way). The version in progress, if one is, then
        comes again from its first part: each part it already holds that arrives again as
        the same message (the same sequence number: a ring or a bucket version is sent
        as it was framed) is skipped, and it completes with the parts it lacks. Otherwise,
        as ever, a part out of order or repeated is a ``ProtocolError``: ZeroMQ keeps a
        connection's order. Holds until the next version is received or refused; called
        from the event loop, at any time, also while ``receive`` runs (that is its use)."""
        self._resend = True

    # -- applying versions ------------------------------------------------------------
    async def apply(self, model: StateLike, recv: Recv) -> int:
        """Receive exactly one version, write it into ``model`` and return that version.

        Calls that overlap run one after another, in the order they were made, each taking
        the next whole version from ``recv``."""
        async with self._turn:
            pending = await self.receive(model, recv)
            await self.commit(model, pending)
        assert pending.version is not None
        return pending.version

    async def receive(
        self, model: StateLike, recv: Recv, *, bootstrap: Announced | None = None,
        before_write: Callable[[PendingVersion], Awaitable[None]] | None = None,
    ) -> PendingVersion:
        """Collect and stage every message of the next version; writes nothing, unless
        this strategy writes on arrival: then, once the first message is checked, it
        awaits ``before_write`` (a daemon's pause gate), takes the write side and writes
        each message as it comes; the version returned is ``written``. ``bootstrap``:
        the handshake's, as WELCOME announced it (nothing else is taken then)."""
        if self.metadata is None:
            raise WeightSyncError("init_receiver() must complete before apply()")
        try:
            first = await self._next(recv)
            while True:
                try:
                    return await self._receive(model, recv, first, bootstrap, before_write)
                except _Superseded as e:
                    log.warning("%s replaced by a resync after %d parts; taking it", e.pending, e.parts)
                    first = e.by
        finally:
            self._resend = False

    async def _receive(
        self, model: StateLike, recv: Recv, first: Message, bootstrap: Announced | None,
        before_write: Callable[[PendingVersion], Awaitable[None]] | None,
    ) -> PendingVersion:
        targets = self.targets(model)
        assert self.metadata is not None  # checked by ``receive``
        started = time.perf_counter()
        check_first(first, bootstrap is not None, self.data_type, self.version)
        kind = "bootstrap" if first.type is MessageType.BOOTSTRAP else self.strategy
        pending = PendingVersion(first.type, first.version, first.base_version, stats=ApplyStats(first.version, kind))
        received = 0
        seqs: list[int] = []  # each part's sequence number, as received: a resent part is the same message
        seen_keys = Claims()  # what the version's entries wrote so far (``checks.claim``)
        raw: list[Message] = []
        msg = first
        # A held receiver stages, to commit when asked; so does one whose versions commit at a flip
        # (reported staged only once whole: no transfer inside the flip's window); a resync commits on arrival.
        flips = self.together and first.type is not MessageType.BOOTSTRAP
        instant = self.writes_on_arrival and self._hooks.commit_gate is None and not flips
        held: AbstractAsyncContextManager[Any] | None = None
        wrote = False
        try:
            while True:
                if msg is not first:
                    if first.type is not MessageType.BOOTSTRAP and msg.type is MessageType.BOOTSTRAP and msg.part == 0:
                        # A resync while a version was incomplete: a patch whose compare failed after its
                        # first parts went out (``VersionServer.abandon_patch``), or the one this receiver
                        # asked for (NACK ``LOST``); nothing of a staged version is in the model, and one
                        # written on arrival leaves it torn until the resync is written over it.
                        raise _Superseded(first.describe(), received, msg)
                    check_same_version(first, msg)
                    if self._resend and msg.part < received and msg.seq == seqs[msg.part]:
                        pending.stats.resent_parts += 1  # sent again as asked (``resend_asked``): held already
                        msg = await self._next(recv)
                        continue
                if msg.part != received:  # ZeroMQ keeps order: a gap or a repeat is an error
                    raise ProtocolError(f"{msg.describe()}: expected part {received + 1}")
                seqs.append(msg.seq)
                if bootstrap is not None:
                    bootstrap.check(msg)
                if not msg.last and not msg.tensors:  # each part but the last covers new tensors: a version's parts are bounded
                    raise ProtocolError(f"{msg.describe()}: a part before the last with no tensors")
                received += 1
                for entry in msg.tensors:
                    claim(msg, entry, self.metadata.shapes, seen_keys)
                pending.stats.messages += 1
                pending.stats.wire_bytes += msg.payload_nbytes
                if self._hooks.keep_messages:
                    pending.messages.append(msg)
                if instant:
                    if held is None:
                        held = await self._take_write_side(pending, before_write)
                    await self._stage(msg, targets, pending)  # checked whole before any of it is written
                    self._passed(pending, msg)
                    wrote = True
                    await self._write_staged(targets, pending)
                elif self.decode_on_arrival:
                    await self._stage(msg, targets, pending)
                    self._passed(pending, msg)
                else:
                    raw.append(msg)
                if msg.last:
                    break
                msg = await self._next(recv)
            if held is not None:
                self._publish_written(pending)
        except BaseException:
            if held is not None:
                await self._failed_while_writing(held, wrote, pending)
            raise
        if held is not None:
            await self._let_readers_in(held)
            pending.written = True
            pending.stats.receive_seconds = time.perf_counter() - started
            return pending
        for m in raw:
            await self._stage(m, targets, pending)
            self._passed(pending, m)
        if self._hooks.on_staged is not None:
            await self._hooks.on_staged(pending)
        pending.stats.receive_seconds = time.perf_counter() - started
        return pending

    def _passed(self, pending: PendingVersion, msg: Message) -> None:
        """``msg`` passed its checks (``StrategyHooks.on_part``)."""
        if self._hooks.on_part is not None:
            self._hooks.on_part(pending, msg)

    @property
    def decode_on_arrival(self) -> bool:
        return True

    @property
    def writes_on_arrival(self) -> bool:
        """Write each message into the model as it arrives (see the class docstring)."""
        return False

    # -- each message: received, decoded, staged --------------------------------------
    async def _next(self, recv: Recv) -> Message:
        frames = await recv()
        msg = await in_thread(decode_message, frames)
        if msg.type is MessageType.ERROR:
            try:
                report = ErrorReport.from_body(msg.body)
            except ProtocolError as e:
                raise WeightSyncError(f"sender reported an error, unreadably: {e}") from None
            raise report.error("sender reported: ")
        if self.session is not None and msg.session != self.session:
            raise ProtocolError(f"{msg.describe()}: from session {msg.session[:8]}, expected {self.session[:8]}")
        return msg

    async def _stage(self, msg: Message, targets: list[Target], pending: PendingVersion) -> None:
        started = time.perf_counter()
        updates = await in_thread(self._decode, msg, targets)  # into the staging buffers: done before a cancellation goes on
        pending.updates.extend(updates)
        pending.staged_bytes += sum(u.values.numel() * u.values.element_size() + (0 if u.flat is None else u.flat.numel() * 8) for u in updates)
        pending.stats.staged_bytes_peak = max(pending.stats.staged_bytes_peak, pending.staged_bytes)
        pending.stats.tensors += len(updates)
        pending.stats.changed_elements += sum(u.values.numel() for u in updates)
        pending.stats.h2d_seconds += self.staging.transfer_seconds()
        pending.stats.decode_seconds += time.perf_counter() - started

    def _decode(self, msg: Message, targets: list[Target]) -> list[StagedUpdate]:
        """``msg``'s updates, decoded on ``device`` through ``staging`` (``decode.decode_part``)."""
        assert self.metadata is not None
        return decode_part(msg, targets, self.metadata, self.device, self.staging)
