"""The transport-free sender: one receiver, injected ``send``/``recv`` callables."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError, StaleVersionError, WeightSyncError
from protocol.state import ModelState, StateLike, resolve_state
from protocol.wire.buffers import Buffer
from protocol.wire.framing import Message, Stamper, decode_message
from protocol.wire.messages import ErrorReport, Hello

from .fp8_view import fp8_view
from .plan import SyncPlan
from .stats import SyncStats

log = logging.getLogger(__name__)

Send = Callable[[Sequence[Buffer]], Awaitable[Any]]
Recv = Callable[[], Awaitable[Sequence[Buffer]]]


def check_next_version(current: int | None, version: int) -> None:
    """Versions are non-negative ints that strictly increase."""
    if type(version) is not int or version < 0:
        raise ConfigError(f"version must be a non-negative int, got {version!r}")
    if current is not None and version <= current:
        raise StaleVersionError(f"version {version} does not follow {current}", current=current, got=version)


def plan_for(state: ModelState, hello: Hello, config: SyncConfig) -> SyncPlan:
    """Check a HELLO against the trainer's model; ``MetadataMismatchError`` names the key.
    The first receiver's handshake, here and in the daemon (``sender/serve/source.py``).
    A receiver holding weights in block fp8 gets a plan over the trainer's state quantized
    into its format (``sender/fp8_view.py``)."""
    view = fp8_view(state, hello.metadata, hello.quant, config.fp8)
    return SyncPlan(state if view is None else view.state, hello.metadata, config.init_sync, view)


def check_same(plan: SyncPlan, hello: Hello, config: SyncConfig) -> None:
    """A later receiver's HELLO against the plan the first one fixed: the same metadata
    (keys, order, shapes, dtypes) and, for fp8 weights, the same block and scale format.
    One sender serves one weight format: ``MetadataMismatchError`` names the difference."""
    plan.metadata.require_same(hello.metadata, "the other receivers")
    if plan.view is not None:
        told = config.fp8.format if hello.quant is None else hello.quant
        if told != plan.view.settings.format:
            raise MetadataMismatchError(
                f"this receiver declares {told.describe()}; the other receivers hold {plan.view.settings.format.describe()} "
                "(one sender serves one weight format: run one sender per format)"
            )


async def send_all(send: Send, stamp: Stamper, messages: Iterator[Message]) -> int:
    """Build (off the event loop) and send each message; returns the bytes sent."""
    total = 0
    while (msg := await asyncio.to_thread(next, messages, None)) is not None:
        frames = stamp(msg)
        total += sum(len(f) for f in frames)
        await send(frames)
    return total


class SenderBase:
    """The actor side of one sync channel. Subclasses implement ``_sync``."""

    strategy: ClassVar[str]

    def __init__(self, config: SyncConfig | Any = None) -> None:
        self.config = load_config(config)
        self.stamp = Stamper()
        self.version: int | None = None
        self.plan: SyncPlan | None = None
        self._turn = asyncio.Lock()  # one sync at a time, in the order they were called

    @property
    def session(self) -> str:
        return self.stamp.session

    async def init_sender(
        self,
        model: StateLike,
        send: Send,
        recv: Recv,
        trainable_keys: Iterable[str] | None = None,
        *,
        version: int | None = None,
    ) -> None:
        """Take the receiver's HELLO, check its metadata, send WELCOME and the bootstrap.

        On a mismatch the receiver is sent an ERROR naming the key, and the same
        ``MetadataMismatchError`` is raised here.
        """
        state = resolve_state(model, trainable_keys)
        hello = Hello.from_message(decode_message(await recv()))
        try:
            plan = plan_for(state, hello, self.config)
        except (MetadataMismatchError, ConfigError) as e:
            await send(self.stamp(ErrorReport.of(e).to_message()))
            raise
        self.plan, self.version = plan, version
        rollout, _ = await plan.rolled(state.tensors, only=plan.state.tensors)  # every key as the receiver holds it
        parts, bootstrap = plan.bootstrap(version, rollout.__getitem__)
        untracked = await asyncio.to_thread(plan.untracked_digests, rollout.__getitem__)
        await send(self.stamp(plan.welcome(self.strategy, parts, untracked).to_message(version)))
        started = time.perf_counter()
        nbytes = await send_all(send, self.stamp, bootstrap)
        log.info("bootstrap sent: %d buckets, %d bytes in %.3fs (version %s)", parts, nbytes, time.perf_counter() - started, version)
        await self.on_init(rollout)

    async def on_init(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hook for strategies that keep state from the initial weights (the patch snapshot),
        given as the receiver holds them."""

    async def sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        """Send ``model`` as ``version``, which must exceed the last one synced.

        Calls that overlap run one after another, in the order they were made (asyncio's
        lock is fair), so each version's messages go out whole and in order; a call whose
        version no longer exceeds the last one by its turn raises ``StaleVersionError`` and
        sends nothing."""
        async with self._turn:
            return await self._sync(model, send, version)

    async def _sync(self, model: StateLike, send: Send, version: int) -> SyncStats:
        raise NotImplementedError

    async def close(self) -> None:
        """Stop every thread the strategy owns (the patch builder's). Idempotent."""

    def require_plan(self, version: int) -> SyncPlan:
        if self.plan is None:
            raise WeightSyncError("init_sender() must complete before sync()")
        check_next_version(self.version, version)
        return self.plan
