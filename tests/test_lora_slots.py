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


def _manager(tp: int, rank: int) -> tuple[nn.Module, object]:
    """A vLLM LRU LoRA manager over two layers (a packed q/k/v and a row-parallel down_proj)
    of one TP rank: vLLM's own registration, activation and ``set_lora``, no engine."""
    from types import SimpleNamespace

    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.model_executor.layers.linear import QKVParallelLinear

    built = layers(tp, rank)
    qkv, down = built["qkv_proj"][0], built["down_proj"][0]
    qkv_base = object.__new__(QKVParallelLinear)
    nn.Module.__init__(qkv_base)
    for k, v in {"input_size": HIDDEN, "total_num_heads": 4, "total_num_kv_heads": 2, "head_size": HEAD,
                 "output_sizes": [HIDDEN, 2 * HEAD, 2 * HEAD]}.items():
        setattr(qkv_base, k, v)
    qkv_base.weight = nn.Parameter(torch.randn(HIDDEN + 4 * HEAD, HIDDEN).to(torch.bfloat16), requires_grad=False)
    down_base = nn.Linear(2 * HIDDEN, HIDDEN, bias=False).to(torch.bfloat16)
    down_base.input_size, down_base.output_size = 2 * HIDDEN, HIDDEN
    qkv.base_layer, down.base_layer = qkv_base, down_base
    manager = object.__new__(LRUCacheLoRAModelManager)
    model = nn.Module()
    model.lora_manager = manager
    names = {"model.layers.0.self_attn.qkv_proj": qkv, "model.layers.0.mlp.down_proj": down}
    attrs = {
        "lora_config": SimpleNamespace(fully_sharded_loras=False, max_lora_rank=MAX_RANK, max_loras=SLOTS, max_cpu_loras=4,
                                       lora_dtype=torch.bfloat16),
        "modules": names, "model": model, "lora_index_to_id": [None] * SLOTS,
        "packed_modules_mapping": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
        "packed_modules": {"model.layers.0.self_attn.qkv_proj": [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]},
        "is_pooling_model": False, "_enable_mixed_moe_lora_format": False, "_enable_moe_shared_loras": False, "_is_non_gated_moe": False,
    }
    for k, v in attrs.items():
        setattr(manager, k, v)
    manager._registered_adapters = AdapterLRUCache(4, manager.deactivate_adapter)
    manager._active_adapters = AdapterLRUCache(SLOTS, manager._deactivate_adapter)
    return model, manager


def _trainer(r: int = R) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for parent, leaf, n_in, n_out in [("self_attn", "q_proj", HIDDEN, HIDDEN), ("self_attn", "k_proj", HIDDEN, 2 * HEAD),
                                      ("self_attn", "v_proj", HIDDEN, 2 * HEAD), ("mlp", "down_proj", 2 * HIDDEN, HIDDEN)]:
        stem = f"base_model.model.model.layers.0.{parent}.{leaf}"
        out += [(f"{stem}.lora_A.default.weight", (r, n_in)), (f"{stem}.lora_B.default.weight", (n_out, r))]
    return out


LORA = {"default": {"id": 7, "name": "policy", "r": R, "lora_alpha": 12, "target_modules": ["q_proj", "k_proj", "v_proj", "down_proj"]}}


def _bootstrapped(tp: int, rank: int) -> tuple[object, object, object, list[tuple[str, object]]]:
    """A manager of one rank, its ``AdapterSlots`` for ``LORA`` with random buffers, after
    the first commit (which registers the adapter), and that commit's writes."""
    from receiver.apply.commit import StagedUpdate
    from receiver.vllm.adapters import parse_specs
    from receiver.vllm.lora import AdapterSlots

    model, manager = _manager(tp, rank)
    slots = AdapterSlots(model, _trainer(), parse_specs(LORA))
    for t in slots.buffers.values():
        t.copy_(torch.randn(t.shape))
    slots.commit(list(slots.buffers))
    return model, manager, slots, [(n, StagedUpdate(i, None, t.clone())) for i, (n, t) in enumerate(slots.buffers.items())]


def _matrices(lora: object) -> list[torch.Tensor]:
    """Every A and B matrix of a registered ``LoRAModel`` (packed ones per sub-module)."""
    sides = [side for w in lora.loras.values() for side in (w.lora_a, w.lora_b)]  # type: ignore[attr-defined]
    return [t for side in sides for t in (side if isinstance(side, list) else [side]) if t is not None]


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 0), (2, 1)])
def test_a_version_serves_from_vllms_own_build_at_the_end_of_the_update_and_is_read_back(tp: int, rank: int) -> None:
    """The first commit registers and pins the adapter, read back whole; a later commit
    writes only the buffers (the registered copy and its slot keep the previous version:
    vLLM drops them at the end of the update, a copy into them would be wasted); when vLLM
    drops every adapter (``finish_weight_update``) the version is built again as vLLM
    builds one from disk (packing, B scaled by 12 / 4) and lands in its slot, this rank's
    slice. The read-back fails on a slot element, a registered element or a base weight
    written behind it, and removes an adapter it registered wrong."""
    import random

    from protocol.errors import WriteCheckError
    from receiver.apply.commit import StagedUpdate

    torch.manual_seed(0)
    rng = random.Random(0)
    _, manager, slots, writes = _bootstrapped(tp, rank)
    assert slots.check(writes, 64, rng) == 3 * len(writes)  # each in its buffer, its registered copy and its slot
    assert set(manager.list_adapters()) == {7} and 7 in manager.lora_index_to_id
    registered, served = manager.get_adapter(7), _slot(manager, 7)
    held = [t.clone() for t in _matrices(registered)]
    changed = [n for n in slots.buffers if "k_proj.lora_B" in n or "down_proj.lora_A" in n]
    for n in changed:
        slots.buffers[n].reshape(-1)[::3] += 1.0
    slots.commit(changed)
    assert slots.check([(n, StagedUpdate(0, None, slots.buffers[n].clone())) for n in changed], 64, rng) == len(changed)
    assert manager.get_adapter(7) is registered  # untouched until vLLM drops it
    assert all(torch.equal(a, b) for a, b in zip(_matrices(registered), held, strict=True))
    now = _slot(manager, 7)
    assert all(torch.equal(a, b) for n in served for a, b in zip(served[n], now[n]))
    manager.remove_all_adapters()  # what finish_weight_update does: vLLM drops it, weightsync builds it again as vLLM would
    assert 7 in manager.lora_index_to_id and manager.get_adapter(7) is not registered
    index = manager.lora_index_to_id.index(7)
    k_b = next(n for n in changed if "k_proj.lora_B" in n)
    down_a = next(n for n in changed if "down_proj.lora_A" in n)
    shard = 2 * HEAD // tp  # k's rows on this rank (kv heads split across ranks)
    got_k = manager.modules["model.layers.0.self_attn.qkv_proj"].lora_b_stacked[1][index, 0]
    assert torch.equal(got_k[:, :R], (slots.buffers[k_b] * (12 / 4)).to(torch.bfloat16)[rank * shard : (rank + 1) * shard])
    cols = 2 * HIDDEN // tp  # down_proj's A columns on this rank
    got_down = manager.modules["model.layers.0.mlp.down_proj"].lora_a_stacked[0][index, 0]
    assert torch.equal(got_down[:R], slots.buffers[down_a][:, rank * cols : (rank + 1) * cols])
    assert not got_k[:, R:].any() and not got_down[R:].any()  # the rank's padding past r
    for behind in ("a slot element", "a registered element", "a base weight"):
        _, manager, slots, writes = _bootstrapped(tp, rank)
        index = manager.lora_index_to_id.index(7)
        qkv = manager.modules["model.layers.0.self_attn.qkv_proj"]
        if behind == "a slot element":
            qkv.lora_b_stacked[1][index].view(-1)[3] += 1.0
        elif behind == "a registered element":
            manager.get_adapter(7).loras["model.layers.0.mlp.down_proj"].lora_a.view(-1)[3] += 1.0
        else:
            qkv.base_layer.weight.data.add_(1.0)
        with pytest.raises(WriteCheckError):
            slots.check(writes, 64, rng)
        assert (manager.get_adapter(7) is None) == (behind != "a base weight"), behind  # registered wrong: removed


def test_an_adapter_that_does_not_fit_leaves_the_manager_untouched() -> None:
    from protocol.errors import AdapterMismatchError
    from receiver.vllm.adapters import parse_specs
    from receiver.vllm.lora import AdapterSlots

    model, manager = _manager(1, 0)
    slots_before = [t.clone() for m in manager.modules.values() for t in m.lora_a_stacked + m.lora_b_stacked]
    for lora, tensors in (({"default": {**LORA["default"], "r": 2}}, _trainer()),  # rank other than the trainer's
                          ({"default": {**LORA["default"], "target_modules": ["q_proj", "k_proj", "v_proj"]}}, _trainer())):
        with pytest.raises(AdapterMismatchError):
            AdapterSlots(model, tensors, parse_specs(lora))
    assert manager.list_adapters() == {} and manager.lora_index_to_id == [None] * SLOTS
    assert "remove_all_adapters" not in vars(manager)  # not wrapped
    after = [t for m in manager.modules.values() for t in m.lora_a_stacked + m.lora_b_stacked]
    assert all(torch.equal(a, b) for a, b in zip(slots_before, after))


def _one_ulp_off(monkeypatch: pytest.MonkeyPatch, layer: str) -> list[int]:
    """vLLM's ``LoRAModel.from_lora_tensors`` (what weightsync rebuilds an adapter with),
    with one element of ``layer``'s B one ulp off in what it builds; returns a list that
    counts the builds it corrupted."""
    from vllm.lora.lora_model import LoRAModel

    built = LoRAModel.from_lora_tensors.__func__  # type: ignore[attr-defined]
    corrupted: list[int] = []

    def off(cls: type, *args: object, **kwargs: object) -> object:
        lora = built(cls, *args, **kwargs)
        b = lora.loras[layer].lora_b
        b.view(torch.int16).reshape(-1)[5] += 1  # the next bf16 value away from zero: one ulp
        corrupted.append(1)
        return lora

    monkeypatch.setattr(LoRAModel, "from_lora_tensors", classmethod(off))
    return corrupted


def _slot(manager: object, adapter: int) -> dict[str, list[torch.Tensor]]:
    """A copy of ``adapter``'s slot in every LoRA layer (A's and B's stacked, each sub)."""
    index = manager.lora_index_to_id.index(adapter)  # type: ignore[attr-defined]
    return {n: [t[index].clone() for t in (m.lora_a_stacked + m.lora_b_stacked)] for n, m in manager.modules.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1)])
def test_a_one_ulp_error_in_the_reregistration_is_caught_and_the_last_version_kept(tp: int, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """What serves after a weight update is the copy weightsync registers again when vLLM
    drops every adapter (``finish_weight_update``): one element of one B one ulp off in
    that rebuild raises a ``WriteCheckError`` out of vLLM's ``remove_all_adapters``, and the
    adapter that serves is the last version that read back whole (its slots, its
    registered copy), not the wrong one. The next update, built right, serves again."""
    import random

    from protocol.errors import WriteCheckError
    from receiver.apply.commit import StagedUpdate

    torch.manual_seed(0)
    rng = random.Random(0)
    _, manager, slots, writes = _bootstrapped(tp, rank)  # the bootstrap: registered
    slots.check(writes, 64, rng)  # and read back
    manager.remove_all_adapters()  # the end of a weight update: registered again, read back
    first, first_lora = _slot(manager, 7), manager.get_adapter(7)
    down = "model.layers.0.mlp.down_proj"
    changed = [n for n in slots.buffers if "down_proj.lora_B" in n]
    for n in changed:
        slots.buffers[n].reshape(-1)[::2] += 1.0
    slots.commit(changed)
    slots.check([(n, StagedUpdate(0, None, slots.buffers[n].clone())) for n in changed], 64, rng)
    corrupted = _one_ulp_off(monkeypatch, down)
    with pytest.raises(WriteCheckError, match="down_proj"):
        manager.remove_all_adapters()
    assert corrupted, "the re-registration did not go through from_lora_tensors"
    # the last whole version serves: registered and in a slot, bit for bit
    assert manager.get_adapter(7) is first_lora and 7 in manager.lora_index_to_id
    after = _slot(manager, 7)
    for name, tensors in first.items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, after[name])), name
    monkeypatch.undo()
    manager.remove_all_adapters()  # the next weight update's end, built right: the new version serves
    assert manager.get_adapter(7) is not first_lora
    index = manager.lora_index_to_id.index(7)
    b = manager.modules[down].lora_b_stacked[0][index, 0]
    want = slots.buffers[changed[0]].to(torch.bfloat16) * (12 / 4)
    assert torch.equal(b[:, :R], want) and not b[:, R:].any()
