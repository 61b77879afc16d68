"""What both sender strategies share: the handshake, the init bootstrap, message numbering."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from protocol.buffers import Buffer
from protocol.config import SyncConfig, load_config
from protocol.errors import ConfigError, MetadataMismatchError, ProtocolError, StaleVersionError, WeightSyncError
from protocol.framing import Message, MessageType, decode_message, encode_message
from protocol.metadata import ModelMetadata
from protocol.state import ModelState, StateLike, resolve_state

from .buckets import bucket_messages, plan_buckets

log = logging.getLogger(__name__)

Send = Callable[[Sequence[Buffer]], Awaitable[Any]]
Recv = Callable[[], Awaitable[Sequence[Buffer]]]


class SenderBase:
    """The actor side of one sync channel. Subclasses implement ``sync``."""

    strategy: ClassVar[str]

    def __init__(self, config: SyncConfig | Any = None) -> None:
        self.config = load_config(config)
        self.session = uuid.uuid4().hex
        self.version: int | None = None
        self.metadata: ModelMetadata | None = None
        self.state: ModelState | None = None
        self._seq = 0

    # -- messages ---------------------------------------------------------------------
    def stamp(self, msg: Message) -> list[Buffer]:
        """Frames of ``msg`` with this sender's session and the next sequence number."""
        msg.session = self.session
        msg.seq = self._seq
        self._seq += 1
        return encode_message(msg)

    def ordinal(self, key: str) -> int:
        assert self.metadata is not None
        return self.metadata.ordinal(key)

    def receiver_dtype(self, key: str) -> torch.dtype:
        assert self.metadata is not None
        return self.metadata.dtypes[self.metadata.ordinal(key)]

    def next_version(self, version: int) -> None:
        if type(version) is not int or version < 0:
            raise ConfigError(f"version must be a non-negative int, got {version!r}")
        if self.version is not None and version <= self.version:
            raise StaleVersionError(f"version {version} does not follow {self.version}", current=self.version, got=version)

    # -- handshake --------------------------------------------------------------------
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

        On a metadata mismatch the receiver is sent an ERROR naming the key, and
        ``MetadataMismatchError`` is raised here too.
        """
        state = resolve_state(model, trainable_keys)
        hello = decode_message(await recv())
        if hello.type is not MessageType.HELLO:
            raise ProtocolError(f"expected HELLO, got {hello.describe()}")
        metadata = ModelMetadata.from_body(hello.body)
        try:
            metadata.check_against(state.tensors)
        except MetadataMismatchError as e:
            await send(self.stamp(error_message("metadata_mismatch", str(e))))
            raise
        self.metadata, self.state, self.version = metadata, state, version
        parts, bootstrap = self.bootstrap_messages(state) if self.config.init_sync.enabled else (0, iter(()))
        aliases = [[self.ordinal(a), self.ordinal(c)] for a, c in state.aliases.items()]
        welcome = Message(
            MessageType.WELCOME,
            version=version,
            body={"strategy": self.strategy, "aliases": aliases, "bootstrap": parts},
        )
        await send(self.stamp(welcome))
        started = time.perf_counter()
        for msg in bootstrap:
            await send(self.stamp(msg))
        log.info("bootstrap sent: %d buckets in %.3fs (version %s)", parts, time.perf_counter() - started, version)
        await self.after_init(state)

    async def after_init(self, state: ModelState) -> None:
        """Hook for strategies that keep state from the initial weights (the patch snapshot)."""

    def bootstrap_keys(self, state: ModelState) -> list[str]:
        """Keys of the init bootstrap: all, or those equal to a prefix or under ``prefix.``."""
        canonical = [k for k in state.tensors if k not in state.aliases]
        prefixes = self.config.init_sync.prefixes
        if prefixes is None:
            return canonical
        for p in prefixes:
            if not any(k == p or k.startswith(p + ".") for k in canonical):
                raise ConfigError(f"init_sync prefix {p!r} matches no key of the state dict")
        return [k for k in canonical if any(k == p or k.startswith(p + ".") for p in prefixes)]

    def bootstrap_messages(self, state: ModelState) -> tuple[int, Iterator[Message]]:
        """The bootstrap of the current weights at the receiver's dtypes: the number of
        buckets, and the buckets, built one at a time as they are sent."""
        keys = self.bootstrap_keys(state)
        buckets = plan_buckets(
            keys,
            lambda k: state.tensors[k].numel() * self.receiver_dtype(k).itemsize,
            self.config.init_sync.bucket_size,
        )
        messages = bucket_messages(
            MessageType.BOOTSTRAP,
            buckets,
            state.tensors,
            self.ordinal,
            lambda k, t: t.to(self.receiver_dtype(k)),
            None,
            version=self.version,
        )
        return len(buckets), messages

    def tracked_keys(self) -> list[str]:
        """Tracked keys without aliases: each storage travels once."""
        assert self.state is not None
        return [k for k in self.state.tracked if k not in self.state.aliases]

    def require_init(self) -> ModelState:
        if self.state is None or self.metadata is None:
            raise WeightSyncError("init_sender() must complete before sync()")
        return self.state


def error_message(code: str, text: str) -> Message:
    return Message(MessageType.ERROR, body={"code": code, "message": text})
