"""What weightsync relies on in SGLang's workers (its scheduler processes, one per TP rank):
the rules of its post-load processing, its reload path and its worker group
(``receiver.held.worker.EngineSide``).

SGLang's own update window does the re-processing: ``begin_weight_update`` restores every
layer's loaded layout (``restore_weights_before_loading``), updates write into it, and
``end_weight_update`` runs every layer's ``process_weights_after_loading`` again. The map
is recorded and written inside that window only, so it sees the loaded layout, and it
never re-runs processing itself (``Rules.reprocess`` False). A layer may be written element
by element only where that pair is known to give back exactly the loaded layout; the
unquantized methods' processing is a no-op except where SGLang packs them in place for
Intel AMX (or shuffles experts for AITER), which it cannot restore: those layers then take
the safe path, SGLang's own ``load_weights`` inside the window, whole.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..held.kinds import Rules

log = logging.getLogger(__name__)

_UNQUANTIZED = {"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod", "UnquantizedFusedMoEMethod"}


def sglang_rules() -> Rules:
    """The rules for this process's SGLang: the unquantized methods are mapped unless SGLang
    packs them in a way ``begin_weight_update`` cannot undo (or this cannot be told)."""
    try:
        from sglang.srt.layers.quantization import unquant
    except ImportError:  # not in an SGLang worker: nothing is vouched for
        return Rules("sglang", reprocess=False)
    packed = getattr(unquant, "_is_cpu_amx_available", True) and getattr(unquant, "_is_cpu", True)
    shuffled = getattr(unquant, "_use_aiter", True)
    rerunnable = set(_UNQUANTIZED)
    if packed:
        rerunnable.clear()  # AMX packs linear, embedding and experts in place
    elif shuffled:
        rerunnable.discard("UnquantizedFusedMoEMethod")
    if rerunnable != _UNQUANTIZED:
        log.warning("weightsync: SGLang packs %s in place here (AMX/AITER): those layers are reloaded whole",
                    sorted(_UNQUANTIZED - rerunnable))
    return Rules("sglang", rerunnable=rerunnable, reprocess=False)


class SGLangSide:
    """``EngineSide`` for an SGLang scheduler process: its ``load_weights``, its world group."""

    name = "sglang"

    def __init__(self) -> None:
        self.rules = sglang_rules()

    @torch.no_grad()
    def reload(self, model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
        """The layers the map does not understand, whole, through the model's own
        ``load_weights`` (what ``update_weights_from_tensor`` with no ``load_format`` does);
        SGLang's ``end_weight_update`` then runs their post-load processing."""
        if weights:
            model.load_weights([(name, t) for name, t in weights.items()])  # type: ignore[operator]

    def step_module(self, model: nn.Module) -> nn.Module:
        """SGLang's model runner calls ``model.forward`` itself, which runs no hook of the
        model's; its forward calls the decoder stack (``model.model``) once a step."""
        inner = getattr(model, "model", None)
        return inner if isinstance(inner, nn.Module) else model

    def _group(self) -> Any:
        from sglang.srt.distributed.parallel_state import get_world_group

        return get_world_group()

    def world(self) -> int:
        try:
            return int(self._group().world_size)
        except (ImportError, AssertionError, AttributeError, RuntimeError):
            return 1

    def rank(self) -> int:
        return int(self._group().rank_in_group)

    def broadcast(self, value: Any) -> Any:
        group = self._group()
        box = [value]
        torch.distributed.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        group = self._group()
        out: list[Any] = [None] * group.world_size
        torch.distributed.all_gather_object(out, value, group=group.cpu_group)
        return out
