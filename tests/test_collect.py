"""PatchBuilder's collect: the lean per-tensor path decides and captures what the plain one did."""

from __future__ import annotations

import torch

from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from sender.patch import PatchBuilder, sampled_differences
from sender.plan import SyncPlan
from sender.stats import SyncStats


def builder_for(state: dict[str, torch.Tensor], receiver: torch.dtype) -> PatchBuilder:
    config = load_config({"type": "patch"})
    metadata = ModelMetadata.of({k: t.to(receiver) for k, t in state.items()})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    builder.capture(state)
    return builder


def test_the_dense_rule_is_the_options_rule_with_the_sample() -> None:
    """Skipping the sample where the counts decide changes no decision."""
    g = torch.Generator().manual_seed(5)
    cur = torch.randn(10_000, generator=g)
    snap = cur.to(torch.bfloat16)
    cur += torch.randn(10_000, generator=g) * 1e-2
    builder = builder_for({"w": cur}, torch.bfloat16)
    rule = builder._dense_rule(builder._keys["w"], cur, snap)
    diffs = sampled_differences(cur, snap)
    for total in range(0, 10_001, 7):
        assert rule(total) == builder.options.goes_dense(total, 10_000, 2, diffs)


def test_collect_captures_and_moves_the_snapshot_exactly() -> None:
    g = torch.Generator().manual_seed(9)
    shapes = {"a": (300, 70), "b": (64,), "c": (5, 5), "d": (2000,)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    builder = builder_for(state, torch.bfloat16)
    before = {k: t.clone() for k, t in builder.snapshot.tensors.items()}
    state["a"].view(-1)[::50] += 0.1  # sparse
    state["b"] += 1.0  # every element: surely whole
    state["d"].view(-1)[::4] += 0.1  # a quarter: a dense candidate
    changes = builder._collect(state, SyncStats(1, "patch"))
    assert [c.key for c in changes] == [builder.plan.ordinal(k) for k in ("a", "b", "d")]
    for c, key in zip(changes, ("a", "b", "d")):
        new = state[key].to(torch.bfloat16).reshape(-1)
        assert torch.equal(builder.snapshot.tensors[key].view(torch.int16), state[key].to(torch.bfloat16).view(torch.int16))
        if c.flat is None:
            assert c.dense is not None and torch.equal(c.dense.view(torch.int16), new.view(shapes[key]).view(torch.int16))
            continue
        old = before[key].reshape(-1)
        flat = torch.nonzero(new.view(torch.int16) != old.view(torch.int16)).squeeze(1)
        assert c.nnz == flat.numel() and torch.equal(c.flat, flat)
        assert c.new is not None and c.old is not None
        assert torch.equal(c.new.view(torch.int16), new[flat].view(torch.int16))
        assert torch.equal(c.old.view(torch.int16), old[flat].view(torch.int16))
        assert (c.dense is not None) == (c.nnz > builder.options.dense_candidate(2) * new.numel())
