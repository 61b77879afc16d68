"""The vLLM layout map on a GPU's terms (receiver/held/layout.py, receiver/apply/readback.py),
said on CPU tensors: a mapped write and read wait for nothing (no compaction by a boolean
index, no copy to the host), and a commit's read-back reads each device twice whatever the
number of tensors. Correctness of the same writes is test_layout_tp's property."""

from __future__ import annotations

import random
from typing import Any

import torch
from test_device_codec import SyncCounter
from test_layout_tp import assert_ranks_equal_a_fresh_load, engine_ranks, trainer_keys, version_updates
from vllm_like import Shape, random_checkpoint

from receiver.apply.commit import StagedUpdate, commit
from receiver.apply.readback import check_all

BOOLEAN_INDEXED = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default,
                   torch.ops.aten._index_put_impl_.default)


class Reads(SyncCounter):
    """``SyncCounter``, explicit copies to the host (``.to("cpu", copy=True)``) and boolean
    indexing (``t[mask]``, ``t[mask] = v``: on CUDA a ``nonzero`` first, which waits for
    the device to learn how many; on CPU it is not dispatched as one)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._to_copy.default and str((kwargs or {}).get("device")) == "cpu":
            self.syncs["copy to the host"] += 1
        if func in BOOLEAN_INDEXED and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.syncs["boolean index"] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def a_version(layers: int) -> tuple[Shape, Any, Any, list[str], dict[int, list[int]], dict[str, torch.Tensor], list[Any]]:
    s = Shape(tp=2, kv_heads=2, heads=6, bias=True, tied=True, vocab=100, layers=layers)
    engines, layouts = engine_ranks(s, start_seed=5)
    keys, aliases = trainer_keys(s)
    checkpoint = random_checkpoint(s, 1)
    for e in engines:
        e.load_weights(list(checkpoint.items()))
    g = torch.Generator().manual_seed(layers)
    new, decoded = version_updates(keys, aliases, checkpoint, ["sparse"] * len(keys), g)
    return s, engines, layouts, keys, aliases, new, decoded


def test_mapped_writes_and_reads_wait_for_nothing_and_land() -> None:
    s, engines, layouts, keys, aliases, new, decoded = a_version(2)
    for layout in layouts:
        targets = [layout.tensors[k] for k in keys]
        with Reads() as counter:
            staged = [StagedUpdate.stage(d, targets[d.key]) for d in decoded]
            commit(targets, staged, aliases)
        assert not counter.syncs, counter.syncs
    assert_ranks_equal_a_fresh_load(s, engines, new, "sparse writes through the map")


def test_a_commits_read_back_is_two_reads_whatever_the_tensors() -> None:
    reads = {}
    for layers in (1, 6):
        _, _, layouts, keys, aliases, _, decoded = a_version(layers)
        layout = layouts[1]
        targets = [layout.tensors[k] for k in keys]
        staged = [StagedUpdate.stage(d, targets[d.key]) for d in decoded]
        commit(targets, staged, aliases)
        checks = [(keys[o], targets[o], u) for u in staged for o in (u.ordinal, *aliases.get(u.ordinal, ()))]
        with Reads() as counter:
            compared = check_all(checks, 8, random.Random(0))
        assert compared > 0
        reads[len(checks)] = dict(counter.syncs)
    (few, few_reads), (many, many_reads) = sorted(reads.items())
    assert many > 3 * few
    # two reads of the device; and twice, the host's indices made into one tensor for it
    # (on a GPU moved from pinned memory, without waiting: counted all the same)
    assert few_reads == many_reads == {"copy to the host": 2, "aten::lift_fresh": 2}, reads
