"""A trainer's LoRA adapters as the state a ``Sender`` tracks: the A and B matrices only.

Adapter-only sync (a vLLM engine's LoRA slots, ``init_info.lora``) sends what the
optimizer changes, in proportion to the adapter, not the merged weights (a low-rank update
changes every element of a merged matrix). The names are PEFT's live ones,
``base_model.model.<module>.lora_A.<adapter>.weight``; the tensors are the parameters
themselves (no copies), so each ``sync`` diffs the adapter as it is now.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from protocol.errors import ConfigError

_LORA = re.compile(r"\.lora_[AB]\.(?P<adapter>[^.]+)\.weight$")


def adapter_state(model: nn.Module, adapters: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """``model``'s LoRA matrices (of ``adapters``, by PEFT adapter name; all by default),
    by name. ``ConfigError`` when there are none, or an adapter asked for has none."""
    wanted = None if adapters is None else set(adapters)
    out: dict[str, torch.Tensor] = {}
    found: set[str] = set()
    for name, param in model.named_parameters():
        m = _LORA.search(name)
        if m is None or (wanted is not None and m["adapter"] not in wanted):
            continue
        found.add(m["adapter"])
        out[name] = param
    missing = sorted((wanted or set()) - found)
    if not out or missing:
        raise ConfigError(f"the model has no LoRA matrices (lora_A / lora_B) of adapter(s) {missing or sorted(wanted or ['any'])}")
    return out
