"""Where an adapter matrix lies in vLLM's LoRA slots, without an engine, at TP=1 and on
each rank of TP=2: the read-back's geometry (``receiver.vllm.lora.SlotView``), worked out
from a layer's shard, must find exactly what vLLM's own ``set_lora`` wrote (its slicing),
for a row-parallel layer (A's columns sharded), a packed gate/up and a packed q/k/v (B's
rows sharded, k/v by kv-head shard)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

R, MAX_RANK, SLOTS, HIDDEN, HEAD = 4, 8, 3, 64, 16


def _layer(cls: type, tp: int, rank: int, **attrs: object) -> nn.Module:
    """A vLLM LoRA layer with only what ``set_lora`` reads (no base layer, no engine)."""
    layer = object.__new__(cls)
    nn.Module.__init__(layer)
    for k, v in {"tp_size": tp, "tp_rank": rank, **attrs}.items():
        setattr(layer, k, v)
    return layer


def _stacked(rows: list[int], cols: list[int]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(SLOTS, 1, r, c, dtype=torch.bfloat16) for r, c in zip(rows, cols))


def layers(tp: int, rank: int) -> dict[str, tuple[nn.Module, list[tuple[int, int]]]]:
    """Each layer kind, and its sub-modules' (in, out) whole sizes."""
    from vllm.lora.layers.column_parallel_linear import MergedColumnParallelLinearWithLoRA, MergedQKVParallelLinearWithLoRA
    from vllm.lora.layers.row_parallel_linear import RowParallelLinearWithLoRA

    inter, q, kv = 2 * HIDDEN, HIDDEN, HEAD * 2  # 4 query heads, 2 kv heads of 16
    row = _layer(RowParallelLinearWithLoRA, tp, rank, n_slices=1, input_size=inter // tp, output_size=HIDDEN,
                 lora_a_stacked=_stacked([MAX_RANK], [inter // tp]), lora_b_stacked=_stacked([HIDDEN], [MAX_RANK]))
    gate_up = _layer(MergedColumnParallelLinearWithLoRA, tp, rank, n_slices=2, output_sizes=[inter, inter],
                     output_slices=(inter // tp, inter // tp), output_ids=(rank, rank),
                     lora_a_stacked=_stacked([MAX_RANK] * 2, [HIDDEN] * 2), lora_b_stacked=_stacked([inter // tp] * 2, [MAX_RANK] * 2))
    qkv = _layer(MergedQKVParallelLinearWithLoRA, tp, rank, n_slices=3, output_sizes=[q, kv, kv],
                 output_slices=(q // tp, kv // tp, kv // tp), output_ids=(rank, rank, rank),
                 lora_a_stacked=_stacked([MAX_RANK] * 3, [HIDDEN] * 3), lora_b_stacked=_stacked([q // tp, kv // tp, kv // tp], [MAX_RANK] * 3))
    return {"down_proj": (row, [(inter, HIDDEN)]), "gate_up_proj": (gate_up, [(HIDDEN, inter)] * 2),
            "qkv_proj": (qkv, [(HIDDEN, q), (HIDDEN, kv), (HIDDEN, kv)])}


def _read(view: object, whole: torch.Tensor) -> dict[int, float]:
    """The elements ``view`` says this rank holds, read at the places it names."""
    flat = list(range(whole.numel()))
    out: dict[int, float] = {}
    for storage, at, offsets in view.places(flat):  # type: ignore[attr-defined]
        for i, off in zip(at, offsets):
            out[flat[i]] = float(storage[off])
    return out


@pytest.mark.parametrize("kind", ["down_proj", "gate_up_proj", "qkv_proj"])
@pytest.mark.parametrize("tp", [1, 2])
def test_the_read_back_finds_what_set_lora_wrote(kind: str, tp: int) -> None:
    from receiver.vllm.lora import SlotView

    torch.manual_seed(tp)
    subs = layers(1, 0)[kind][1]
    a = [torch.randn(R, n_in).to(torch.bfloat16) for n_in, _ in subs]
    b = [torch.randn(n_out, R).to(torch.bfloat16) for _, n_out in subs]
    seen_a: list[dict[int, int]] = [{} for _ in subs]
    seen_b: list[dict[int, int]] = [{} for _ in subs]
    for rank in range(tp):
        layer, _ = layers(tp, rank)[kind]
        slot = 1
        if len(subs) == 1:
            layer.set_lora(slot, a[0], b[0])
        else:
            layer.set_lora(slot, list(a), list(b))
        for s in range(len(subs)):
            for whole, a_side, seen in ((a[s], True, seen_a), (b[s], False, seen_b)):
                view = SlotView(layer, slot, s, a_side, tuple(whole.shape), torch.bfloat16)
                got = _read(view, whole)
                flat = whole.reshape(-1)
                assert got and all(v == float(flat[i]) for i, v in got.items()), (kind, tp, rank, s, a_side)
                for i in got:
                    seen[s][i] = seen[s].get(i, 0) + 1
    # every element is held on some rank: once where sharded (A by a row-parallel layer, B by
    # a column-parallel one), on every rank where replicated
    sharded_a, sharded_b = kind == "down_proj", kind != "down_proj"
    for s, (n_in, n_out) in enumerate(subs):
        assert set(seen_a[s]) == set(range(R * n_in)) and set(seen_b[s]) == set(range(n_out * R))
        assert set(seen_a[s].values()) == ({1} if sharded_a or tp == 1 else {tp})
        assert set(seen_b[s].values()) == ({1} if sharded_b or tp == 1 else {tp})
