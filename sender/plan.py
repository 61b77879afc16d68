"""How the trainer's model maps onto a receiver's metadata: ordinals, dtypes, tracked
keys, aliases and the bootstrap. Shared by the transport-free senders and the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from protocol.codec.buckets import bucket_messages, plan_buckets
from protocol.config import InitSyncConfig
from protocol.errors import ConfigError, MetadataMismatchError
from protocol.state import ModelState, sync_keys
from protocol.wire.checksum import state_digest
from protocol.wire.framing import Message, MessageType
from protocol.wire.messages import Welcome
from protocol.wire.metadata import ModelMetadata

from .fp8_view import Fp8View
from .streams import Mark

Source = Callable[[str], torch.Tensor]


@dataclass
class SyncPlan:
    state: ModelState
    metadata: ModelMetadata
    init_sync: InitSyncConfig
    # The rollout's weight format, when it differs from the trainer's (block fp8): then
    # ``state`` is the view's, and every version's tensors pass through ``rollout``.
    view: Fp8View | None = None
    tracked: list[str] = field(init=False)  # tracked keys without aliases: each storage travels once
    on_cuda: bool = field(init=False)  # any tracked tensor is on a CUDA device

    def __post_init__(self) -> None:
        self.metadata.check_against(self.state.tensors)
        self.tracked = sync_keys(self.state)
        # where the tracked tensors live: patch.codec auto codes on the device on CUDA (PatchOptions.resolved)
        self.on_cuda = any(self.device(k).type == "cuda" for k in self.tracked)
        if self.init_sync.enabled:
            self.bootstrap_keys()  # a prefix that matches nothing is a configuration error: fail now

    def device(self, key: str) -> torch.device:
        """Where ``key``'s tensor lives on the trainer (a quantized weight: where it is quantized)."""
        return self.state.tensors[key].device if self.view is None else self.view.devices[key]

    def rollout(self, tensors: Mapping[str, torch.Tensor], only: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """A version's trainer tensors as the receivers hold them: as given, or through the
        view (``only``: the rollout keys wanted; default the tracked ones). Call it where
        the trainer's stream has done its step (it reads them; on a GPU it queues the
        quantizing kernels on this thread's current stream)."""
        if self.view is None:
            return dict(tensors)
        return self.view.tensors(tensors, None if only is None else set(only))

    async def rolled(
        self, tensors: Mapping[str, torch.Tensor], after: Mark | None = None, only: Iterable[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], Mark]:
        """``rollout`` off the event loop, once the work ``after`` marks is done (default:
        what the caller's current streams hold now), and the mark of its own work, which
        whoever reads its tensors on another thread waits for. Without a view: the
        tensors as given, and ``after``."""
        after = Mark.now(tensors.values()) if after is None else after
        if self.view is None:
            return dict(tensors), after

        def run() -> tuple[dict[str, torch.Tensor], Mark]:
            after.wait()
            out = self.rollout(tensors, only)
            return out, Mark.now(out.values())

        return await asyncio.to_thread(run)

    def ordinal(self, key: str) -> int:
        return self.metadata.ordinal(key)

    def check_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """``MetadataMismatchError`` unless every tracked key is in ``tensors`` at its shape
        at init. Checked before a sync reads anything: one that failed at its tenth tensor
        would have moved the snapshot (or retained copy) of the nine before it on."""
        for key in self.tracked:
            t = tensors.get(key)
            if t is None:
                raise MetadataMismatchError(f"key {key!r} was tracked at init but is missing from the model now")
            shape = self.metadata.shapes[self.ordinal(key)]
            if tuple(t.shape) != shape:
                raise MetadataMismatchError(f"key {key!r} changed shape from {list(shape)} to {list(t.shape)}")

    def receiver_dtype(self, key: str) -> torch.dtype:
        return self.metadata.dtypes[self.metadata.ordinal(key)]

    def wire_aliases(self) -> list[list[int]]:
        return [[self.ordinal(a), self.ordinal(c)] for a, c in self.state.aliases.items()]

    def bootstrap_keys(self) -> list[str]:
        """Keys of the bootstrap: all, or those equal to a prefix or under ``prefix.``.

        A tied alias that matches brings its canonical key (the storage travels once).
        """
        aliases = self.state.aliases
        canonical = [k for k in self.state.tensors if k not in aliases]
        prefixes = self.init_sync.prefixes
        if prefixes is None:
            return canonical
        matched = set()
        for p in prefixes:
            hits = {aliases.get(k, k) for k in self.state.tensors if k == p or k.startswith(p + ".")}
            if not hits:
                raise ConfigError(f"init_sync prefix {p!r} matches no key of the state dict")
            matched |= hits
        return [k for k in canonical if k in matched]

    def bootstrap(
        self, version: int | None, source: Source | None = None, keys: list[str] | None = None
    ) -> tuple[int, Iterator[Message]]:
        """The bootstrap at the receiver's dtypes: how many buckets, and the buckets, built
        one at a time as they are sent. ``source`` gives a key's tensor (default: the
        model's); ``keys`` defaults to the init-sync keys."""
        if keys is None:
            keys = self.bootstrap_keys() if self.init_sync.enabled else []
        buckets = plan_buckets(
            keys, lambda k: self.state.tensors[k].numel() * self.receiver_dtype(k).itemsize, self.init_sync.bucket_size
        )
        messages = bucket_messages(
            MessageType.BOOTSTRAP,
            buckets,
            source or self.state.tensors.__getitem__,
            self.ordinal,
            lambda k, _: self.receiver_dtype(k),
            None,
            version=version,
        )
        return len(buckets), messages

    def never_sent(self) -> list[str]:
        """The keys a receiver of this plan never gets whole: neither tracked (itself or as
        the alias of a tracked key) nor in the bootstrap (``init_sync`` off, or outside its
        prefixes): a frozen weight, an untracked buffer. It must already hold them."""
        sent = set(self.tracked) | set(self.bootstrap_keys() if self.init_sync.enabled else [])
        aliases = self.state.aliases
        return [k for k in self.metadata.keys if aliases.get(k, k) not in sent]

    def untracked_digests(self, source: Source | None = None) -> tuple[tuple[int, str], ...]:
        """(ordinal, state digest at the receiver's dtype) of each ``never_sent`` key, for
        WELCOME: the receiver compares its own copies and refuses to follow a trainer it
        would silently differ from. ``source`` gives a key's tensor (default: the model's)."""
        get = source or self.state.tensors.__getitem__
        aliases = self.state.aliases
        return tuple(
            (self.ordinal(k), state_digest({k: get(aliases.get(k, k)).detach().to(self.receiver_dtype(k))}, [k]))
            for k in self.never_sent()
        )

    def welcome(self, strategy: str, bootstrap_parts: int = 0, untracked: tuple[tuple[int, str], ...] = ()) -> Welcome:
        """What a receiver of this plan is told in WELCOME."""
        return Welcome(strategy, tuple((a, c) for a, c in self.wire_aliases()), bootstrap_parts, untracked)
