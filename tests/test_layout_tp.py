"""Tensor-parallel ranks of a vLLM-like engine (tests/vllm_like.py) kept on a trainer's
checkpoint through receiver/held/layout.py, across shapes, ranks and kinds of update.

The property: for any sequence of versions mixing sparse changes and whole tensors (alone,
or as views into one received run, as ``split_group`` and buckets hand them over), every
rank's parameters equal what its own ``load_weights`` makes of the full checkpoint at that
version. The engines start from other weights, so a bootstrap that misses an element shows.
Then the same through the real sender and receiver strategies, over their frames.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest
import torch
from channel import Channel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from versions import apply, bits, version_updates
from vllm_like import Engine, Shape, differing, loaded, random_checkpoint

import receiver
import sender
from protocol.errors import WriteCheckError
from protocol.state import Placed
from protocol.wire.framing import Encoding, MessageType, decode_message
from receiver.apply.commit import StagedUpdate, commit
from receiver.apply.readback import check_written
from receiver.held.layout import Layout, derive_layout
from receiver.vllm.rules import VLLM

# (tp, kv heads, query heads per kv head): every GQA ratio 1:1 to 4:1 at TP 1, 2 and 4, with
# kv heads fewer than ranks (replicated), as many, and more.
GQA = [(tp, kv, ratio) for tp in (1, 2, 4) for kv in (1, 2, 4) for ratio in (1, 2, 3, 4)
       if (kv * ratio) % tp == 0 and (kv % tp == 0 or tp % kv == 0)]
VOCABS = (40, 64, 100, 130)  # padded to 64, 64, 128, 192: at TP 4 a rank of 40 holds no row
ACTIONS = ("same", "sparse", "xor", "whole", "run")  # "run": a whole tensor inside one buffer with others


def shapes() -> st.SearchStrategy[Shape]:
    return st.builds(
        lambda g, bias, tied, vocab, layers: Shape(tp=g[0], kv_heads=g[1], heads=g[1] * g[2], bias=bias, tied=tied, vocab=vocab, layers=layers),
        st.sampled_from(GQA), st.booleans(), st.booleans(), st.sampled_from(VOCABS), st.integers(1, 2),
    )


def engine_ranks(s: Shape, start_seed: int) -> tuple[list[Engine], list[Layout]]:
    """Every rank of an engine, its map derived, then holding weights of its own."""
    engines = [Engine(s, rank) for rank in range(s.tp)]
    layouts = [derive_layout(e, s.metadata(), VLLM) for e in engines]
    other = random_checkpoint(s, start_seed)
    for e in engines:
        e.load_weights(list(other.items()))
    return engines, layouts


def trainer_keys(s: Shape) -> tuple[list[str], dict[int, list[int]]]:
    """The checkpoint's names in order, and the receiver's aliases (lm_head tied to the
    embedding: written through the same update, as the sender sends it once)."""
    keys = list(s.checkpoint_shapes())
    aliases = {keys.index("model.embed_tokens.weight"): [keys.index("lm_head.weight")]} if s.tied else {}
    return keys, aliases


def assert_ranks_equal_a_fresh_load(s: Shape, engines: list[Engine], checkpoint: dict[str, torch.Tensor], when: str) -> None:
    for rank, engine in enumerate(engines):
        assert differing(engine, loaded(s, rank, checkpoint)) == [], f"{s}, rank {rank}, {when}"


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(s=shapes(), data=st.data(), seed=st.integers(0, 2**16))
def test_every_rank_equals_its_own_load_of_the_checkpoint_at_every_version(s: Shape, data: Any, seed: int) -> None:
    keys, aliases = trainer_keys(s)
    engines, layouts = engine_ranks(s, seed + 1)
    g = torch.Generator().manual_seed(seed)
    checkpoint = random_checkpoint(s, seed + 2)
    # The bootstrap: every tensor whole, each alone or in a run.
    boot = data.draw(st.lists(st.sampled_from(("whole", "run")), min_size=len(keys), max_size=len(keys)), label="bootstrap")
    checkpoint, decoded = version_updates(keys, aliases, {k: torch.zeros_like(v) for k, v in checkpoint.items()}, boot, g)
    for layout in layouts:
        apply(layout, keys, aliases, decoded)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "after the bootstrap")
    for version in range(1, data.draw(st.integers(1, 3), label="versions") + 1):
        actions = data.draw(st.lists(st.sampled_from(ACTIONS), min_size=len(keys), max_size=len(keys)), label=f"v{version}")
        checkpoint, decoded = version_updates(keys, aliases, checkpoint, actions, g)
        for layout in layouts:
            apply(layout, keys, aliases, decoded)
        assert_ranks_equal_a_fresh_load(s, engines, checkpoint, f"v{version} {actions}")


@pytest.mark.parametrize("tp", [2, 4])
def test_a_whole_tensor_as_a_view_past_other_bytes_lands_where_load_weights_puts_it(tp: int) -> None:
    """The bug this file was written for: a mapped tensor assigned from a view with a
    storage offset (a group run, a bucket) read its boxes from the storage's start. The
    qkv bias at TP 2 is one: q/k/v biases split over ranks, fused into qkv_proj.bias."""
    s = Shape(tp=tp, heads=6 if tp == 2 else 12, kv_heads=2 if tp == 2 else 4, bias=True)
    engines, layouts = engine_ranks(s, 1)
    checkpoint = random_checkpoint(s, 2)
    for layout in layouts:
        for key, t in layout.tensors.items():
            buffer = torch.cat([torch.full((5,), 7.0, dtype=torch.bfloat16), checkpoint[key].reshape(-1)])
            view = buffer[5:].view(checkpoint[key].shape)
            if isinstance(t, Placed):
                t.assign(view)
            else:
                t.copy_(view)
    assert isinstance(layouts[0].tensors["model.layers.0.self_attn.q_proj.bias"], Placed)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "assigned from views")


@settings(max_examples=40, deadline=None)
@given(s=shapes(), seed=st.integers(0, 2**16))
def test_peek_finds_every_element_where_the_vectorised_locate_does(s: Shape, seed: int) -> None:
    """Two inverses of one map: ``MappedTensor.peek`` (plain integers, checked against the
    forward map) and ``read_held`` (``Segment.locate`` over tensors)."""
    _, layouts = engine_ranks(s, seed)
    g = torch.Generator().manual_seed(seed)
    for layout in layouts:
        for t in layout.tensors.values():
            if not isinstance(t, Placed):
                continue
            flat = torch.randint(t.numel(), (24,), generator=g).unique()
            held, values = t.read_held(flat)
            want = [b if h else None for b, h in zip(bits(values).tolist(), held.tolist())]
            assert t.peek(flat.tolist()) == want


def test_a_whole_tensor_of_the_wrong_shape_is_refused_before_any_write() -> None:
    s = Shape(tp=2)
    engines, layouts = engine_ranks(s, 1)
    t = layouts[1].tensors["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(t, Placed)
    before = engines[1].layers[0].qkv_proj.weight.clone()
    with pytest.raises(ValueError, match="shape"):
        t.assign(torch.zeros(t.numel(), dtype=torch.bfloat16))
    assert torch.equal(engines[1].layers[0].qkv_proj.weight, before)


# -- through the real strategies and their frames -------------------------------------------
CONFIGS = {
    "patch": {"type": "patch"},
    "patch-whole": {"type": "patch", "patch": {"dense_above": 0.0}},  # every changed tensor sent whole
    "patch-whole-ungrouped": {"type": "patch", "patch": {"dense_above": 0.0, "group_numel": 0}},
    "bucket-instant": {"type": "bucket", "bucket": {"load_instant": True, "init_sync": {"enabled": True}}},
    "bucket-staged": {"type": "bucket", "bucket": {"load_instant": False, "init_sync": {"enabled": True}}},
}


def step(checkpoint: dict[str, torch.Tensor], share: float, g: torch.Generator, tied: bool) -> None:
    """Change a share of every tensor's elements in place (the trainer's bf16 state)."""
    for key, t in checkpoint.items():
        if tied and key == "lm_head.weight":
            continue
        n = t.numel()
        flat = torch.randperm(n, generator=g)[: max(1, math.ceil(n * share))]
        t.view(-1)[flat] = torch.randn(flat.numel(), generator=g).to(t.dtype)


async def connect(s: Any, r: Any, model: Any, state: Any, ch: Channel, version: int | None) -> None:
    await asyncio.wait_for(asyncio.gather(
        s.init_sender(model, ch.to_receiver.send, ch.to_sender.recv, version=version),
        r.init_receiver(state, ch.to_receiver.recv, ch.to_sender.send),
    ), timeout=60)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
async def test_strategies_keep_every_rank_on_the_checkpoint(name: str, tp: int, tied: bool) -> None:
    """One sender per rank (a rank is a receiver of its own), GQA 3:1 with qkv bias and a
    padded vocabulary; versions with a few percent changed (patches) and all changed
    (whole tensors), then a resync of a rank that already holds a version, and one more
    version after it."""
    config = CONFIGS[name]
    s = Shape(tp=tp, heads=12, kv_heads=4, head_dim=2, hidden=8, vocab=100, bias=True, tied=tied, layers=2)
    engines, layouts = engine_ranks(s, 11)
    g = torch.Generator().manual_seed(tp)
    checkpoint = random_checkpoint(s, 12)
    pairs = [(sender.make_sender(config), receiver.make_receiver(config), Channel()) for _ in range(tp)]
    states = [{k: layout.tensors[k] for k in checkpoint} for layout in layouts]
    for (snd, rcv, ch), state in zip(pairs, states):
        await connect(snd, rcv, checkpoint, state, ch, 0)
    assert_ranks_equal_a_fresh_load(s, engines, checkpoint, "after the bootstrap")
    for version, share in enumerate((0.03, 1.0, 0.02, 1.0), start=1):
        step(checkpoint, share, g, tied)
        for (snd, rcv, ch), state in zip(pairs, states):
            start = len(ch.to_receiver.sent)
            await snd.sync(checkpoint, ch.to_receiver.send, version)
            assert await asyncio.wait_for(rcv.apply(state, ch.to_receiver.recv), 60) == version
            sent = [decode_message(f) for f in ch.to_receiver.sent[start:]]
            if name.startswith("patch") and share == 1.0:  # the case the engine got wrong: tensors sent whole
                assert any(e.encoding is Encoding.DENSE for m in sent for e in m.tensors)
            if name == "patch-whole" and share == 1.0:
                assert any(e.encoding is Encoding.DENSE and e.group for m in sent for e in m.tensors)  # a whole run
        assert_ranks_equal_a_fresh_load(s, engines, checkpoint, f"{name} v{version}")
    # A rank that holds v4 reconnects (a new sender session): bootstrapped over its weights.
    snd, rcv, ch = pairs[-1]
    step(checkpoint, 0.5, g, tied)
    fresh, ch2 = sender.make_sender(config), Channel()
    await connect(fresh, rcv, checkpoint, states[-1], ch2, 5)
    assert decode_message(ch2.to_receiver.sent[1]).type is MessageType.BOOTSTRAP
    assert rcv.version == 5
    assert differing(engines[-1], loaded(s, tp - 1, checkpoint)) == []
    step(checkpoint, 1.0, g, tied)
    await fresh.sync(checkpoint, ch2.to_receiver.send, 6)
    assert await asyncio.wait_for(rcv.apply(states[-1], ch2.to_receiver.recv), 60) == 6
    assert differing(engines[-1], loaded(s, tp - 1, checkpoint)) == []


# -- reading the writes back (receiver/apply/readback.py) ------------------------------------------
def _rng() -> random.Random:
    return random.Random(0)


def test_reading_back_passes_on_every_tensor_a_correct_map_wrote() -> None:
    s = Shape(tp=2, heads=6, kv_heads=2, bias=True, vocab=40)
    _, layouts = engine_ranks(s, 1)
    keys, aliases = trainer_keys(s)
    g = torch.Generator().manual_seed(3)
    checkpoint = random_checkpoint(s, 2)
    for actions in (["run"] * len(keys), ["sparse", "whole", "xor", "run", "same"] * len(keys)):
        checkpoint, decoded = version_updates(keys, aliases, checkpoint, actions[: len(keys)], g)
        for layout in layouts:
            targets = [layout.tensors[k] for k in keys]
            staged = [StagedUpdate.stage(d, targets[d.key]) for d in decoded]
            commit(targets, staged, aliases)
            compared = [check_written(keys[u.ordinal], targets[u.ordinal], u, 8, _rng()) for u in staged]
            assert sum(compared) > 0
            assert all(c <= 8 for c in compared)


def test_reading_back_catches_a_whole_tensor_written_from_the_wrong_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug of issue 34 put back: boxes read from the storage's start, not the view's."""
    from receiver.held.layout import Segment

    def from_storage_start(self: Segment, whole: torch.Tensor) -> torch.Tensor:
        return whole.reshape(-1).as_strided(self.sizes, self.src_strides, self.src_offset)

    monkeypatch.setattr(Segment, "src_view", from_storage_start)
    s = Shape(tp=2, heads=6, kv_heads=2, bias=True)
    _, layouts = engine_ranks(s, 1)
    key = "model.layers.0.self_attn.k_proj.bias"
    target = layouts[1].tensors[key]
    assert isinstance(target, Placed)
    values = torch.randn(10 + target.numel()).to(torch.bfloat16)
    update = StagedUpdate(0, None, values[10:].view(target.shape))
    commit([target], [update], {})
    with pytest.raises(WriteCheckError, match=key):
        check_written(key, target, update, 8, _rng())


def test_reading_back_catches_a_sparse_change_written_over_or_lost() -> None:
    s = Shape(tp=2)
    engines, layouts = engine_ranks(s, 1)
    key = "model.layers.0.mlp.down_proj.weight"  # columns split over the ranks
    target = layouts[0].tensors[key]
    assert isinstance(target, Placed)
    flat = torch.arange(0, target.numel(), 3)
    update = StagedUpdate(0, flat, torch.full((flat.numel(),), 2.5, dtype=torch.bfloat16))
    commit([target], [update], {})
    assert check_written(key, target, update, 64, _rng()) > 0
    engines[0].layers[0].down_proj.weight.data.fill_(-1.0)  # something wrote over the change
    with pytest.raises(WriteCheckError, match=key):
        check_written(key, target, update, 64, _rng())


def test_reading_back_compares_only_what_this_rank_holds_and_plain_tensors_too() -> None:
    s = Shape(tp=4, heads=4, kv_heads=4, vocab=40)  # rank 3 holds no vocabulary row
    _, layouts = engine_ranks(s, 1)
    key = "model.embed_tokens.weight"
    none_here = layouts[3].tensors[key]
    assert isinstance(none_here, Placed) and none_here.held == 0
    update = StagedUpdate(0, None, torch.ones(none_here.shape, dtype=torch.bfloat16))
    commit([none_here], [update], {})
    assert check_written(key, none_here, update, 8, _rng()) == 0
    plain = torch.zeros(5, 4, dtype=torch.bfloat16)
    update = StagedUpdate(0, torch.tensor([1, 7, 19]), torch.tensor([1.0, 2.0, 3.0]).to(torch.bfloat16))
    commit([plain], [update], {})
    assert check_written("plain", plain, update, 8, _rng()) == 3
    plain.view(-1)[7] = 0
    with pytest.raises(WriteCheckError, match="element 7"):
        check_written("plain", plain, update, 8, _rng())
