"""What both receiver strategies share: the handshake, collecting a version's messages,
validating and staging them off the event loop, and the all-or-nothing commit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np
import torch

from protocol.codec.parallel import map_ordered
from protocol.codec.staging import StagingPool
from protocol.codec.tensorcodec import DecodedTensor, at_span, decode_entry, group_offsets, read_verdicts, split_group
from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError, ProtocolError, StaleVersionError, WeightSyncError
from protocol.state import StateLike, find_aliases, state_tensors
from protocol.timing import DeviceSpan
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, MessageType, TensorEntry, ValueEncoding, decode_message, encode_message
from protocol.wire.messages import ErrorReport, Hello, Welcome
from protocol.wire.metadata import ModelMetadata

from .commit import StagedUpdate, Target, commit
from .stats import ApplyStats
from .threads import in_thread
from .transfer import Placement, transfer_part

log = logging.getLogger(__name__)

Send = Callable[[Sequence[Buffer]], Awaitable[Any]]
Recv = Callable[[], Awaitable[Sequence[Buffer]]]
WriteGuard = Callable[[], AbstractAsyncContextManager[Any]]

_WHOLE = -1  # ``ReceiverBase._claim``: a tensor written by an entry without a span


def _check_span(msg: Message, key: int, span: tuple[int, int], numel: int) -> None:
    """A span entry's rules that need the model: only in a patch, 0 <= lo < hi <= numel."""
    lo, hi = span
    if msg.type is not MessageType.PATCH:
        raise ProtocolError(f"{msg.describe()}: tensor {key}: a span entry outside a patch")
    if not 0 <= lo < hi <= numel:
        raise ProtocolError(f"{msg.describe()}: tensor {key}: span [{lo}, {hi}) is not within its {numel} elements")


class _Superseded(Exception):
    """A resync's first message arrived while a patch was incomplete: it replaces the patch."""

    def __init__(self, pending: str, parts: int, by: Message) -> None:
        super().__init__(pending)
        self.pending, self.parts, self.by = pending, parts, by


@dataclass(frozen=True)
class Announced:
    """The bootstrap WELCOME announced: every part is checked against it before any of it
    is written, so a bootstrap that contradicts its WELCOME writes nothing (or, written
    on arrival, is refused at the part that gives it away)."""

    version: int | None
    parts: int

    def check(self, msg: Message) -> None:
        if msg.version != self.version:
            raise ProtocolError(f"{msg.describe()}: WELCOME announced a bootstrap at v{self.version}")
        if msg.part >= self.parts or msg.last != (msg.part + 1 == self.parts):
            raise ProtocolError(f"{msg.describe()}: WELCOME announced a bootstrap of {self.parts} parts")


@dataclass
class PendingVersion:
    """A version received, validated and staged, not yet written."""

    type: MessageType
    version: int | None
    base_version: int | None
    updates: list[StagedUpdate] = field(default_factory=list)
    stats: ApplyStats = field(default_factory=lambda: ApplyStats(None, ""))
    messages: list[Message] = field(default_factory=list)  # as received, when the receiver keeps them (a relay)
    written: bool = False  # written into the model as it arrived (bucket.load_instant): commit() only records it
    staged_bytes: int = 0  # of ``updates``


OnCommit = Callable[["PendingVersion"], None]
VersionGate = Callable[["PendingVersion"], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class StrategyHooks:
    """What a strategy calls around each version, given once when it is built.

    Frozen, and refused by the strategy after construction: who writes, who waits and who
    is told are fixed for its life, so two owners (a relay, an engine) cannot overwrite
    each other's hook. ``Receiver`` composes its own (the model lock, the hold, its
    relay's) with a caller's (``Receiver(hooks=)``)."""

    # Held while a version is written; the daemon makes it its model lock's write side.
    write_guard: WriteGuard = contextlib.nullcontext
    # Awaited before a handshake's bootstrap is written: a daemon that commits only when
    # asked (Receiver(hold=True)) holds a resync there until then.
    commit_gate: VersionGate | None = None
    # Awaited once a version is staged, before it can be committed: an engine prepares
    # what it can off the hold (receiver/vllm re-packs layers ahead). Its error fails the receive.
    on_staged: VersionGate | None = None
    # Called in order inside the write, once the whole version is in the model (an engine
    # installs layers, a relay serves it onwards); one that raises leaves the model torn.
    on_commit: Sequence[OnCommit] = ()
    # Keep each version's messages as received (``PendingVersion.messages``): a relay forwards them.
    keep_messages: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "on_commit", tuple(self.on_commit))  # a list given stays unshared and fixed


_HOOK_NAMES = frozenset({"hooks", "_hooks", *(f.name for f in fields(StrategyHooks))})


@dataclass(frozen=True)
class _Unread:
    """A device-coded entry decoded, its verdict not yet read (``tensorcodec.read_verdicts``)."""

    decoded: DecodedTensor
    group: tuple[int, ...] = ()
    shapes: list[tuple[int, ...]] | None = None  # a group's
    offsets: np.ndarray | torch.Tensor | None = None  # a group's ``group_offsets``: on its device when its part's transfer moved them

    def stage(self, targets: list[Target], cuts: list[int] | None) -> list[StagedUpdate]:
        if self.shapes is None:
            return [StagedUpdate.stage(self.decoded, targets[self.decoded.key])]
        pieces = split_group(self.decoded, self.group, self.shapes, cuts)
        return [StagedUpdate.stage(piece, targets[piece.key]) for piece in pieces]


class ReceiverBase:
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
        self._own_ties: dict[str, str] = {}  # this model's tied names (alias -> canonical), checked against WELCOME's
        self.last_stats: ApplyStats | None = None
        self._turn = asyncio.Lock()  # one apply() at a time, in the order they were called
        self.device = torch.device("cpu")  # where buffers are decoded
        # Reused host buffers (pinned where CUDA is available) through which each part's
        # device-coded payloads reach a GPU target in one copy (receiver/transfer.py).
        self.staging = StagingPool()
        self._torn: AbstractAsyncContextManager[Any] | None = None  # the write side, kept: a version failed midway

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOOK_NAMES:
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
    ) -> int | None:
        """Send HELLO with this model's metadata, then take WELCOME and apply the bootstrap.

        Returns the version the receiver is at afterwards (None when the sender has none).
        """
        tensors = state_tensors(model)
        self.metadata = ModelMetadata.of(tensors)
        self._own_ties = find_aliases(tensors)
        # session: the sender session it last followed, to resume from its ring
        hello = Hello(self.metadata, receiver=receiver_id, applied=self.version, digest=digest, session=self.session)
        await send(encode_message(hello.to_message(self.version)))
        self.session = None  # WELCOME may come from a new sender session
        await self.prepare()  # while the sender builds the bootstrap
        welcome = await self._next(recv)
        if welcome.type is not MessageType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {welcome.describe()}")
        parts = self._welcome(welcome).bootstrap
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
        return welcome

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
        first = await self._next(recv)
        while True:
            try:
                return await self._receive(model, recv, first, bootstrap, before_write)
            except _Superseded as e:
                log.warning("%s abandoned by the sender after %d parts; taking its resync", e.pending, e.parts)
                first = e.by

    async def _receive(
        self, model: StateLike, recv: Recv, first: Message, bootstrap: Announced | None,
        before_write: Callable[[PendingVersion], Awaitable[None]] | None,
    ) -> PendingVersion:
        targets = self.targets(model)
        started = time.perf_counter()
        self._check_first(first, bootstrap is not None)
        kind = "bootstrap" if first.type is MessageType.BOOTSTRAP else self.strategy
        pending = PendingVersion(first.type, first.version, first.base_version, stats=ApplyStats(first.version, kind))
        received = 0
        seen_keys: dict[int, int] = {}  # ordinal -> _WHOLE, or the end of its last span so far (``_claim``)
        raw: list[Message] = []
        msg = first
        instant = self.writes_on_arrival and self._hooks.commit_gate is None  # a held receiver stages, to commit when asked
        held: AbstractAsyncContextManager[Any] | None = None
        wrote = False
        try:
            while True:
                if msg is not first:
                    if first.type is MessageType.PATCH and msg.type is MessageType.BOOTSTRAP and msg.part == 0:
                        # A patch whose compare failed after its first parts went out: the
                        # sender resyncs instead (``VersionServer.abandon_patch``); nothing of it is staged in the model.
                        raise _Superseded(first.describe(), received, msg)
                    self._check_same_version(first, msg)
                if msg.part != received:  # ZeroMQ keeps order: a gap or a repeat is an error
                    raise ProtocolError(f"{msg.describe()}: expected part {received + 1}")
                if bootstrap is not None:
                    bootstrap.check(msg)
                if not msg.last and not msg.tensors:  # each part but the last covers new tensors: a version's parts are bounded
                    raise ProtocolError(f"{msg.describe()}: a part before the last with no tensors")
                received += 1
                for entry in msg.tensors:
                    self._claim(msg, entry, len(targets), seen_keys)
                pending.stats.messages += 1
                pending.stats.wire_bytes += msg.payload_nbytes
                if self._hooks.keep_messages:
                    pending.messages.append(msg)
                if instant:
                    if held is None:
                        held = await self._take_write_side(pending, before_write)
                    await self._stage(msg, targets, pending)  # checked whole before any of it is written
                    wrote = True
                    await self._write_staged(targets, pending)
                elif self.decode_on_arrival:
                    await self._stage(msg, targets, pending)
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
        if self._hooks.on_staged is not None:
            await self._hooks.on_staged(pending)
        pending.stats.receive_seconds = time.perf_counter() - started
        return pending

    @property
    def decode_on_arrival(self) -> bool:
        return True

    @property
    def writes_on_arrival(self) -> bool:
        """Write each message into the model as it arrives (see the class docstring)."""
        return False

    @property
    def torn(self) -> bool:
        """A version failed midway while being written: the model holds no whole version."""
        return self._torn is not None

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """The model's write side: ``write_guard``, or the hold kept on it while the
        model is torn, which a clean exit ends (whatever runs inside rewrites or releases
        the whole model)."""
        if self._torn is None:
            async with self._hooks.write_guard():
                yield
            return
        yield
        await self.release_torn()

    async def release_torn(self) -> None:
        """Let readers in again over a torn model (``close`` does, with a warning): it
        still holds no whole version."""
        held, self._torn = self._torn, None
        if held is not None:
            await held.__aexit__(None, None, None)

    async def _take_write_side(
        self, pending: PendingVersion, before_write: Callable[[PendingVersion], Awaitable[None]] | None
    ) -> AbstractAsyncContextManager[Any]:
        if before_write is not None:
            await before_write(pending)
        if self._torn is not None:  # already held since the version that tore it
            return self._torn
        guard = self._hooks.write_guard()
        await guard.__aenter__()
        return guard

    async def _write_staged(self, targets: list[Target], pending: PendingVersion) -> None:
        started = time.perf_counter()
        await self._write(targets, pending.updates, pending.stats)
        pending.updates, pending.staged_bytes = [], 0  # one message's worth staged at a time
        pending.stats.apply_seconds += time.perf_counter() - started

    def _commit_timed(self, targets: list[Target], updates: list[StagedUpdate], stats: ApplyStats | None) -> None:
        """``commit``, its device time added to ``stats.apply_device_seconds`` (CUDA events
        on each target device; this waits for the writes to be done there)."""
        devices = {t.device for t in targets if t.device.type == "cuda"} or {torch.device("cpu")}
        with contextlib.ExitStack() as stack:
            spans = [stack.enter_context(DeviceSpan(d)) for d in devices]
            commit(targets, updates, self.aliases)
        if stats is not None:
            stats.apply_device_seconds += max(span.seconds() for span in spans)

    async def _write(self, targets: list[Target], updates: list[StagedUpdate], stats: ApplyStats | None = None) -> None:
        """Write ``updates`` off the event loop. A caller cancelled meanwhile waits for the
        thread (``in_thread``): the failure is recorded (``torn``) and the write side handed
        on only once nothing writes."""
        await in_thread(self._commit_timed, targets, updates, stats)

    def _publish_written(self, pending: PendingVersion) -> None:
        """The whole version is in the model: it is the version now, and each ``on_commit``
        hook (which may write too: an engine installs layers) is part of the write."""
        self.version = pending.version
        for hook in self._hooks.on_commit:
            hook(pending)

    async def _let_readers_in(self, held: AbstractAsyncContextManager[Any]) -> None:
        """A whole version was written under ``held``: the model is no longer torn."""
        self._torn = None
        await held.__aexit__(None, None, None)

    async def _failed_while_writing(self, held: AbstractAsyncContextManager[Any], wrote: bool, pending: PendingVersion) -> None:
        if not wrote and self._torn is None:  # nothing of it was written: as if it never came
            await held.__aexit__(*sys.exc_info())
            return
        if self._torn is None:
            log.error("v%s failed after parts of it were written: the model holds no whole version; "
                      "readers are kept out until one is written", pending.version)
        self._torn, self.version = held, None

    async def commit(self, model: StateLike, pending: PendingVersion) -> None:
        """Write a staged version into ``model`` (off the event loop, under
        ``write_guard``) and only then set ``version``; a write that fails or is
        cancelled midway leaves the model ``torn``. A version ``written`` on arrival is
        only recorded."""
        if pending.written:
            self.last_stats = pending.stats
            return
        targets = self.targets(model)
        held = await self._take_write_side(pending, None)
        try:
            started = time.perf_counter()
            await self._write(targets, pending.updates, pending.stats)
            pending.stats.apply_seconds = time.perf_counter() - started
            self._publish_written(pending)
        except BaseException:
            await self._failed_while_writing(held, True, pending)
            raise
        await self._let_readers_in(held)
        self.last_stats = pending.stats
        log.debug("applied %s", pending.stats)

    def targets(self, model: StateLike) -> list[Target]:
        """The model's tensors in metadata order; a model that changed shape is an error."""
        assert self.metadata is not None
        tensors = state_tensors(model)
        out: list[Target] = []
        for key, shape in zip(self.metadata.keys, self.metadata.shapes):
            t = tensors.get(key)
            if t is None or tuple(t.shape) != shape:
                raise MetadataMismatchError(f"key {key!r} is missing from the model or changed shape since init")
            out.append(t)
        return out

    # -- validation -------------------------------------------------------------------
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

    def _check_first(self, msg: Message, bootstrap: bool) -> None:
        allowed = (MessageType.BOOTSTRAP,) if bootstrap else (self.data_type, MessageType.BOOTSTRAP)
        if msg.type not in allowed:
            raise ProtocolError(f"unexpected {msg.describe()}; this receiver takes {[t.name for t in allowed]}")
        current = self.version
        if msg.type is MessageType.PATCH:
            if msg.version is None or msg.base_version != current:
                raise StaleVersionError(
                    f"patch v{msg.version} applies on top of v{msg.base_version}, receiver is at v{current}",
                    current=current, got=msg.base_version, held=type(msg.version) is int and current is not None and msg.version <= current,
                )
            if msg.base_version is not None and msg.version <= msg.base_version:
                raise ProtocolError(f"patch v{msg.version} does not follow its base v{msg.base_version}")
        elif msg.type is MessageType.BUCKET:
            if msg.version is None or (current is not None and msg.version <= current):
                raise StaleVersionError(
                    f"bucket v{msg.version} is not newer than v{current}", current=current, got=msg.version, held=msg.version is not None,
                )
        elif not bootstrap and msg.version is not None and current is not None and msg.version < current:
            raise StaleVersionError(f"bootstrap v{msg.version} is older than v{current}", current=current, got=msg.version)

    def _claim(self, msg: Message, entry: TensorEntry, count: int, seen: dict[int, int]) -> None:
        """Check that ``entry`` writes what no earlier entry of its version wrote (``seen``:
        ordinal -> ``_WHOLE``, or the end of the last span of it so far), and record it: a
        tensor travels in one entry, or in span entries only (``TensorEntry.span``), in a
        patch, each within the tensor and after the one before (across parts too). So every
        entry covers something new, and a version's entries are bounded by its elements."""
        span = entry.span
        for key in entry.covers:
            if key >= count:
                raise ProtocolError(f"{msg.describe()}: tensor ordinal {key} out of range or repeated")
            last = seen.get(key)
            if span is None:
                if last is not None:
                    raise ProtocolError(f"{msg.describe()}: tensor ordinal {key} out of range or repeated"
                                        + ("" if last == _WHOLE else " (a whole entry after span entries of it)"))
                seen[key] = _WHOLE
                continue
            lo, hi = span
            _check_span(msg, key, span, self._numel(key))
            if last == _WHOLE:
                raise ProtocolError(f"{msg.describe()}: tensor {key}: a span entry [{lo}, {hi}) beside a whole entry of it")
            if last is not None and lo < last:
                raise ProtocolError(f"{msg.describe()}: tensor {key}: span [{lo}, {hi}) overlaps or precedes one ending at {last} "
                                    "(a tensor's spans are disjoint and ascending)")
            seen[key] = hi

    def _numel(self, key: int) -> int:
        assert self.metadata is not None
        return math.prod(self.metadata.shapes[key])

    @staticmethod
    def _check_same_version(first: Message, msg: Message) -> None:
        if (msg.type, msg.version, msg.base_version) != (first.type, first.version, first.base_version):
            raise ProtocolError(f"{msg.describe()} arrived while {first.describe()} was incomplete")

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
        assert self.metadata is not None
        metadata = self.metadata
        exact = msg.type is MessageType.PATCH  # buckets and bootstraps may carry a float dtype to convert

        def place(entry: TensorEntry) -> Placement:
            """Where the entry decodes (checked: values and groups only in a patch, a group of one dtype)."""
            if entry.values is not ValueEncoding.RAW and msg.type is not MessageType.PATCH:
                raise ProtocolError(f"{msg.describe()}: {entry.values.name} values outside a patch")
            device = targets[entry.key].device
            if entry.span is not None:  # a 1-D tensor of its hi - lo elements
                _check_span(msg, entry.key, entry.span, self._numel(entry.key))
                return Placement((entry.span[1] - entry.span[0],), metadata.dtypes[entry.key], device)
            if not entry.group:
                return Placement(metadata.shapes[entry.key], metadata.dtypes[entry.key], device)
            dtype = metadata.dtypes[entry.key]
            if msg.type is not MessageType.PATCH or any(metadata.dtypes[k] != dtype for k in entry.group):
                raise ProtocolError(f"{msg.describe()}: tensor {entry.key}: a group outside a patch, or of tensors of several dtypes")
            offsets = group_offsets([metadata.shapes[k] for k in entry.group])
            return Placement((int(offsets[-1]),), dtype, device, offsets)

        placements = [place(entry) for entry in msg.tensors]
        # Device-coded payloads bound for a GPU (and their groups' offsets) and whole tensors'
        # bytes: one copy to it for the message, everything checked before it.
        moved = transfer_part(msg.tensors, msg.frames, placements, self.staging, exact_dtype=exact)

        def one(i: int) -> list[StagedUpdate] | _Unread:
            """The entry's updates, or, for a device-coded one, its decode with the verdict unread
            (``payload``: what the transfer moved for it, a device-coded payload or dense bytes)."""
            entry, where = msg.tensors[i], placements[i]
            payload = moved.payloads.get(i)
            if not entry.group:
                target = targets[entry.key]
                base = target if isinstance(target, torch.Tensor) else None  # read where the entry's values are relative
                if entry.span is not None and base is not None:  # a span's values are relative to its range
                    base = base.view(-1)[entry.span[0]:entry.span[1]] if base.is_contiguous() else None
                decoded = decode_entry(
                    entry, msg.frames, where.shape, where.dtype, self.device, exact_dtype=exact, base=base,
                    target_device=where.device, payload=payload,
                )
                if entry.span is not None:  # its positions in the tensor's flat coordinates, before anything reads there
                    decoded = at_span(decoded, entry.span)
                if decoded.verdict is not None:
                    return _Unread(decoded)
                return [StagedUpdate.stage(decoded, target)]
            shapes = [metadata.shapes[k] for k in entry.group]
            decoded = decode_entry(entry, msg.frames, where.shape, where.dtype, self.device, target_device=where.device, payload=payload)
            if decoded.verdict is not None:
                return _Unread(decoded, entry.group, shapes, moved.offsets.get(i, where.offsets))
            return [StagedUpdate.stage(piece, targets[piece.key]) for piece in split_group(decoded, entry.group, shapes)]

        done = map_ordered(one, range(len(msg.tensors)))
        unread = [d for d in done if isinstance(d, _Unread)]
        if unread:
            # Device-coded entries: every verdict (and every group's cut points) read at once,
            # one host sync for the message, before anything of it is staged.
            cuts = read_verdicts([(u.decoded, u.offsets) for u in unread])
            staged = iter(map_ordered(lambda uc: uc[0].stage(targets, uc[1]), list(zip(unread, cuts))))
            done = [next(staged) if isinstance(d, _Unread) else d for d in done]
        return [update for updates in done if not isinstance(updates, _Unread) for update in updates]
