"""protocol.state: what a model's tensors, tracked keys and aliases resolve to."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from protocol.errors import ConfigError
from protocol.state import find_aliases, resolve_state, state_tensors


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.head = nn.Linear(4, 16, bias=False)
        self.head.weight = self.embed.weight  # tied: two names, one storage
        self.norm = nn.LayerNorm(4)
        self.norm.bias.requires_grad_(False)  # frozen: not tracked
        self.register_buffer("steps", torch.zeros(1, dtype=torch.int64))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


def test_state_tensors_are_the_resolved_states_tensors_in_order() -> None:
    """``state_tensors`` is ``resolve_state(...).tensors`` (the per-version fast path): the
    state dict's entries, aliases and frozen ones included, non-persistent buffers not."""
    model = Tied()
    resolved = resolve_state(model)
    tensors = state_tensors(model)
    assert list(tensors) == list(resolved.tensors) == list(model.state_dict())
    assert all(torch.equal(tensors[k], resolved.tensors[k]) for k in tensors)
    assert "scratch" not in tensors and resolved.aliases == {"head.weight": "embed.weight"}
    assert "norm.bias" in tensors and "norm.bias" not in resolved.tracked
    plain = {"a": torch.zeros(2), "b": torch.ones(3)}
    assert state_tensors(plain) == plain and state_tensors(plain) is not plain


@pytest.mark.parametrize("bad", [[torch.zeros(1)], {"w": [1.0]}, None])
def test_a_state_that_is_not_named_tensors_is_a_config_error(bad: object) -> None:
    for resolve in (state_tensors, resolve_state):
        with pytest.raises(ConfigError):
            resolve(bad)  # type: ignore[arg-type]


def test_meta_tensors_are_tied_only_as_one_object() -> None:
    """A shape-only view of a model (a sharded trainer's checkpoint names: every tensor ``meta``,
    every storage pointer 0) is tied only where one tensor object has two names; a real shared
    storage still is a tie."""
    meta = {n: torch.empty(4, 4, device="meta") for n in ("a", "b", "c")}
    assert find_aliases(meta) == {}
    assert find_aliases({**meta, "d": meta["b"]}) == {"d": "b"}
    shared = torch.zeros(4, 4)
    assert find_aliases({"a": shared, "b": torch.zeros(4, 4), "c": shared}) == {"c": "a"}
