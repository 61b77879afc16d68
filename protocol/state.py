"""What a model or state dict holds, seen the same way by both sides.

Given an ``nn.Module`` the tracked keys are its trainable parameters and persistent
buffers; frozen parameters only travel in a bootstrap. Given a plain state dict every
key is tracked unless ``trainable_keys`` says otherwise. Tied weights (two names, one
storage) are found by storage identity so they travel once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import ConfigError

StateLike = nn.Module | Mapping[str, torch.Tensor]


@dataclass
class ModelState:
    tensors: dict[str, torch.Tensor]  # in state-dict order; values may be DTensors
    tracked: list[str]  # keys that take part in patches and buckets
    aliases: dict[str, str] = field(default_factory=dict)  # alias key -> canonical key


def resolve_state(model: StateLike, trainable_keys: Iterable[str] | None = None) -> ModelState:
    """The named tensors of ``model``, its tracked keys and its tied-weight aliases."""
    if isinstance(model, nn.Module):
        tensors = dict(model.state_dict(keep_vars=False))
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        default_tracked = [k for k in tensors if k not in frozen]
    elif isinstance(model, Mapping):
        tensors = dict(model)
        default_tracked = list(tensors)
    else:
        raise ConfigError(f"expected an nn.Module or a state dict, got {type(model).__name__}")
    for k, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"state dict entry {k!r} is a {type(t).__name__}, not a tensor")
    if trainable_keys is None:
        tracked = default_tracked
    else:
        wanted = set(trainable_keys)
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise ConfigError(f"trainable_keys names {missing[0]!r}, which the state dict does not have")
        tracked = [k for k in tensors if k in wanted]
    return ModelState(tensors, tracked, find_aliases(tensors))


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
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    if local.numel() == 0:
        return None
    ptr = local.untyped_storage().data_ptr()
    return (local.device, ptr, local.storage_offset(), tuple(local.shape), local.stride(), local.dtype)


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "full_tensor")


def materialize(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for ``t``: DTensors (FSDP2) are gathered; a collective on every rank."""
    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
