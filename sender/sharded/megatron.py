"""Megatron-core models as ``ShardedSync`` sees them (``MegatronLayout``): each rank compares
its own local parameters (its tensor-, pipeline- and expert-parallel shard) and sends their
changes in the checkpoint's (Hugging Face) names and coordinates, so receivers and engines see
what they would from any other trainer. No rank gathers a tensor for a patch.

The map from each rank's parameters to checkpoint tensors is the bridge's own: recorded once,
at construction, by probing its export (``probe.py``: fused QKV, gate/up, vocabulary splits,
stages and experts as the bridge lays them out, never guessed from names), then checked on the
real weights. Each (parameter, tensor) pair is one strided block on each side
(``protocol.wire.span.Span``): a row-parallel weight's shard travels as one span entry of
strided runs. What the probe cannot map (a bridge that computes on values, a pair that is no
strided block) is refused at construction with a ``ConfigError`` naming it.

The bridge is any object with Megatron-Bridge's ``export_hf_weights(model, cpu=True)``: a
collective yielding ``(name, tensor)`` in one order on every rank. It is called at
construction (three times: two probes and the check), and for each bootstrap (every rank; the
leader keeps the tensors while it builds the bootstrap's messages). Patch versions never call
it: ``stats`` counts every tensor it yielded after construction (``GatherStats.gathers``,
``last`` for the current version).

Only the sharded build (a patch Sender): there is no gathering build. Every parameter is
tracked (the export names them all); frozen parameters are not told apart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from protocol.errors import ConfigError
from protocol.wire.framing import Message

from ..plan import SyncPlan
from .gathers import GatherStats
from .probe import Landing, probe, verify
from .shard_build import ReceiverPlan, ShardBuild
from .shard_parts import layout_digest
from .shards import ShardKey

T = TypeVar("T")


def tied_names(bridge: Any) -> dict[str, str]:
    """The checkpoint ties of the bridge's Hugging Face model (alias -> canonical): its
    architecture's ``_tied_weights_keys`` when its config ties word embeddings, else none."""
    config = getattr(getattr(bridge, "hf_pretrained", None), "config", None)
    if config is None or not getattr(config, "tie_word_embeddings", False):
        return {}
    import transformers

    ties: dict[str, str] = {}
    for name in getattr(config, "architectures", None) or []:
        tied = getattr(getattr(transformers, name, None), "_tied_weights_keys", None)
        if isinstance(tied, Mapping):
            ties.update({str(a): str(c) for a, c in tied.items()})
    return ties


def local_parameters(model: Sequence[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """A rank's parameters in a fixed order, named as the model names them (prefixed by the
    chunk's index where there are several: virtual pipeline stages)."""
    prefix = len(model) > 1
    return [(f"{i}.{n}" if prefix else n, p) for i, chunk in enumerate(model) for n, p in chunk.named_parameters()]


class MegatronLayout:
    """A Megatron-core model's layout for ``ShardedSync`` (its ``ShardLayout``): every rank
    builds one, in lockstep (a collective), from the bridge and its model chunks (what
    ``provide_distributed_model`` returned). ``group``: the trainer's ranks (default: the world).

    ``ties``: checkpoint names the export leaves out because they are another tensor
    (alias -> canonical; default ``tied_names(bridge)``: the Hugging Face model's own tied
    keys when its config ties word embeddings). Rollouts that hold the tie (a transformers
    model's ``lm_head.weight`` sharing ``embed_tokens``' storage) are told it at the handshake,
    as by any trainer holding it; an alias whose canonical tensor the export lacks is dropped."""

    gathers = False

    def __init__(
        self, bridge: Any, model: nn.Module | Sequence[nn.Module], *, group: dist.ProcessGroup | None = None,
        ties: Mapping[str, str] | None = None,
    ) -> None:
        self.bridge = bridge
        self.model = [model] if isinstance(model, nn.Module) else list(model)
        self.group = group
        self.params = local_parameters(self.model)
        self.stats = GatherStats()
        self.landings: tuple[Landing, ...] = probe(self.params, self._raw_export, group)
        self.meta = verify(self.params, self.landings, self._raw_export(), group)  # checkpoint name -> meta tensor
        self.ties = {a: c for a, c in (tied_names(bridge) if ties is None else dict(ties)).items() if c in self.meta and a not in self.meta}
        for alias, canonical in self.ties.items():  # the same meta tensor under both names: a tie the Sender sees
            self.meta[alias] = self.meta[canonical]
        self.trainable_keys = list(self.meta)

    def _raw_export(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.bridge.export_hf_weights(self.model, cpu=True, show_progress=False))

    def export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The bridge's export (a collective), counted in ``stats``."""
        for name, t in self._raw_export():
            self.stats.gathers += 1
            self.stats.last.append(name)
            yield name, t

    def agreement(self) -> list[str]:
        return [f"{k}{tuple(t.shape)}{t.dtype}" for k, t in self.meta.items()]

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.params}

    def view(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as meta tensors (names, shapes, dtypes: no values on any rank)."""
        return dict(self.meta)

    def start(self, keep: bool) -> None:
        """Nothing: every tensor is tracked, none gathered once."""

    def build(self, plan: ReceiverPlan) -> ShardBuild:
        """This rank's landings as shard keys, in the receivers' order."""
        keys = [
            ShardKey(landing.tensor, plan.ordinals[landing.tensor], plan.dtypes[landing.tensor],
                     landing.span, landing.param, landing.local)
            for landing in self.landings if landing.tensor in plan.ordinals
        ]
        keys.sort(key=lambda k: (k.ordinal, k.span.lo))
        digest = layout_digest((k, tuple(t.shape)) for k, t in self.meta.items())
        return ShardBuild(self.tensors(), keys, plan, digest)

    async def lead(self, call: Callable[[dict[str, torch.Tensor]], Awaitable[T]]) -> T:
        raise ConfigError("a Megatron model has no gathering build: sync it with a patch Sender")

    def follow(self) -> None:
        """The other ranks' side of a bootstrap: the export, each tensor dropped."""
        for _ in self.export():
            pass

    async def bootstrap(self, plan: SyncPlan, version: int, keys: Sequence[str]) -> list[Message]:
        """The bootstrap of ``keys`` at ``version`` from the bridge's export (every rank exports;
        the leader keeps the tensors until the messages are built)."""
        exported = await asyncio.to_thread(dict, self.export())
        _, messages = plan.bootstrap(version, lambda key: exported[self.ties.get(key, key)], list(keys))
        return await asyncio.to_thread(list, messages)
