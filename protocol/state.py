"""What a model or state dict holds, seen the same way by both sides.

Given an ``nn.Module`` the tracked keys are its trainable parameters and persistent
buffers; frozen parameters only travel in a bootstrap. Given a plain state dict every
key is tracked unless ``trainable_keys`` says otherwise. Tied weights (two names, one
storage) are found by storage identity so they travel once.

Sharded (FSDP2) state dicts hold DTensors, and gathering one is a collective: every rank
must gather the same tensors in the same order (``sender.sharded.gathers.gather_order``);
``gathering`` lets the rank that hosts the sender route its gathers through a hook that
enforces it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import nn

from protocol.errors import ConfigError
from protocol.wire.dtypes import bit_view


class Placed:
    """A tensor a receiver holds scattered over other tensors, not as one storage.

    An inference engine keeps a checkpoint tensor fused into a bigger parameter, split
    across tensor-parallel ranks, padded, or in a copy it re-packs (``receiver.vllm``).
    Such a state declares each checkpoint tensor's shape and dtype through this
    interface, and the receiver reads and writes its elements by flat index; no
    checkpoint-shaped copy exists. Elements not held here read as zero and writes to
    them are dropped (another rank holds them).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def read(self, flat: torch.Tensor) -> torch.Tensor:
        """The elements at the (sorted, in-bounds) flat indices, as one 1-D tensor."""
        raise NotImplementedError

    def read_held(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of the flat indices this state holds, ``read(flat)``)."""
        return torch.ones(flat.numel(), dtype=torch.bool, device=self.device), self.read(flat)

    def peek(self, flat: Sequence[int]) -> list[int | None]:
        """The bits (an integer each) of a few elements at these flat indices, None where
        not held here: a cheap read of a handful, for checking what was written."""
        held, values = self.read_held(torch.tensor(list(flat), dtype=torch.int64))
        return [b if h else None for b, h in zip(bit_view(values).tolist(), held.tolist())]

    def places(self, flat: Sequence[int]) -> list[tuple[torch.Tensor, list[int], list[int]]] | None:
        """Where a few elements at these flat indices lie: (a 1-D tensor holding some of
        them, their positions in ``flat``, their offsets in it) each; those not held here
        are in none. None where a state cannot say (then ``peek`` reads them)."""
        return None

    def write(self, flat: torch.Tensor, values: torch.Tensor) -> None:
        """Set the elements at the flat indices; those not held here are dropped."""
        raise NotImplementedError

    def assign(self, values: torch.Tensor) -> None:
        """Set every element from a whole tensor of this shape."""
        raise NotImplementedError

    def materialize(self) -> torch.Tensor | None:
        """The whole tensor, for digests; None when part of it is held elsewhere."""
        raise NotImplementedError


StateLike = nn.Module | Mapping[str, "torch.Tensor | Placed"]


@dataclass
class ModelState:
    tensors: dict[str, torch.Tensor]  # in state-dict order; values may be DTensors
    tracked: list[str]  # keys that take part in patches and buckets
    aliases: dict[str, str] = field(default_factory=dict)  # alias key -> canonical key


def resolve_state(model: StateLike, trainable_keys: Iterable[str] | None = None) -> ModelState:
    """The named tensors of ``model``, its tracked keys and its tied-weight aliases."""
    tensors = state_tensors(model)
    if isinstance(model, nn.Module):
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        default_tracked = [k for k in tensors if k not in frozen]
    else:
        default_tracked = list(tensors)
    if trainable_keys is None:
        tracked = default_tracked
    else:
        wanted = set(trainable_keys)
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise ConfigError(f"trainable_keys names {missing[0]!r}, which the state dict does not have")
        tracked = [k for k in tensors if k in wanted]
    return ModelState(tensors, tracked, find_aliases(tensors))


def state_tensors(model: StateLike) -> dict[str, torch.Tensor]:
    """The named tensors of ``model`` (its state dict, or the mapping itself), in order:
    ``resolve_state``'s, without the tracked keys and aliases it also works out (half its
    cost on a module, paid on every version where only the tensors are wanted)."""
    if isinstance(model, nn.Module):
        tensors = dict(model.state_dict(keep_vars=False))
    elif isinstance(model, Mapping):
        tensors = dict(model)
    else:
        raise ConfigError(f"expected an nn.Module or a state dict, got {type(model).__name__}")
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor | Placed):
            raise ConfigError(f"state dict entry {k!r} is a {type(t).__name__}, not a tensor")
    return tensors


def find_aliases(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Map each later name of a shared tensor to the first name that holds it."""
    seen: dict[tuple[object, ...], str] = {}
    aliases: dict[str, str] = {}
    for key, t in tensors.items():
        ident = _identity(t)
        if ident is None:
            continue
        if ident in seen:
            aliases[key] = seen[ident]
        else:
            seen[ident] = key
    return aliases


def _identity(t: torch.Tensor) -> tuple[object, ...] | None:
    if isinstance(t, Placed):
        return None  # its own placement says where it lives; no storage to share
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    if local.numel() == 0:
        return None
    if local.device.type == "meta":  # no storage (a shape-only view of a model): one object under two names is a tie
        return ("meta", id(local))
    ptr = local.untyped_storage().data_ptr()
    return (local.device, ptr, local.storage_offset(), tuple(local.shape), local.stride(), local.dtype)


def sync_keys(state: ModelState) -> list[str]:
    """The keys a sender reads from the model at every version, in state-dict order: the
    tracked keys without aliases, so each storage is read once."""
    return [k for k in state.tracked if k not in state.aliases]


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


Gather = Callable[[torch.Tensor], torch.Tensor]
_GATHER: ContextVar[Gather | None] = ContextVar("weightsync_gather", default=None)


@contextmanager
def gathering(hook: Gather) -> Iterator[None]:
    """Route ``materialize`` of DTensors through ``hook`` in this context, and in the
    threads (``asyncio.to_thread``) and tasks started from it: the hook decides when a
    collective may run, so one rank can never gather on its own."""
    token = _GATHER.set(hook)
    try:
        yield
    finally:
        _GATHER.reset(token)


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for ``t``: DTensors (FSDP2) are gathered, a collective on every
    rank, through the ``gathering`` hook when one is set."""
    if not is_dtensor(t):
        return t
    hook = _GATHER.get()
    return hook(t) if hook is not None else t.full_tensor()  # type: ignore[attr-defined]
