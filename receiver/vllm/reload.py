"""The safe path for layers the map does not understand: vLLM's own ``load_weights``.

A layer of kind RELOAD (``kinds.py``) keeps its checkpoint tensors whole on the host (the
receiver patches those copies, bit for bit, like any plain tensor); when a version has
changed any of them, *all* the checkpoint tensors of those layers are handed to vLLM's
layerwise reload (``initialize_layerwise_reload`` / ``load_weights`` /
``finalize_layerwise_reload``, as vLLM's own checkpoint-format weight-transfer engines do),
which rebuilds each layer at its load-time layout, loads, runs its post-load processing and
copies the result into the storage the engine runs on. All of a layer, because a layer
reloaded in part is processed with the rest of its elements uninitialised.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from protocol.errors import PlacementError

from .kinds import Kind

log = logging.getLogger(__name__)


@torch.no_grad()
def reload(model: nn.Module, model_config: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """Load ``weights`` (checkpoint name -> whole tensor) through vLLM's layerwise reload.
    Layers none of them reaches keep their tensors (vLLM puts them back)."""
    if not weights:
        return
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError as e:  # pragma: no cover - every vLLM with weight transfer has it
        raise PlacementError(f"this vLLM has no layerwise reload, so layers the map does not know cannot be updated: {e}") from e
    device = _device(model)
    initialize_layerwise_reload(model)
    try:
        model.load_weights([(name, t.to(device)) for name, t in weights.items()])  # type: ignore[operator]
    finally:
        finalize_layerwise_reload(model, model_config)


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


@dataclass
class Reloads:
    """One worker's layers of kind RELOAD and the checkpoint tensors they load, each kept
    whole on the host (``mirrors``: what the receiver writes, as it would a plain tensor)."""

    mirrors: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint name -> its whole copy
    layers: dict[nn.Module, Kind] = field(default_factory=dict)  # reloaded layer -> its kind (the reason)
    layers_of_key: dict[str, list[nn.Module]] = field(default_factory=dict)  # checkpoint name -> the layers it loads into

    def weights_for(self, written: Iterable[str]) -> dict[str, torch.Tensor]:
        """Every tensor of every reloaded layer that one of the ``written`` names loads into:
        a layer is reloaded whole or not at all."""
        touched = {id(layer) for key in written for layer in self.layers_of_key.get(key, ())}
        return {key: t for key, t in self.mirrors.items() if any(id(layer) in touched for layer in self.layers_of_key[key])}
