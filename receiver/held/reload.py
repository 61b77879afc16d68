"""The safe path for layers the map does not understand: the engine's own ``load_weights``.

A layer of kind RELOAD (``kinds.py``) keeps its checkpoint tensors whole on the host (the
receiver patches those copies, bit for bit, like any plain tensor); when a version has
changed any of them, *all* the checkpoint tensors of those layers are handed to the
engine's reload (``EngineSide.reload``: vLLM's layerwise reload, SGLang's ``load_weights``
and post-load step), which loads them and runs the layer's post-load processing. All of a
layer, because a layer reloaded in part is processed with the rest of its elements
uninitialised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .kinds import Kind


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
