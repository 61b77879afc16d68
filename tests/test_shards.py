"""Issue 36, step 2: a sharded trainer's compare rank by rank (``sender/sharded/shards.py``).

(a) One process, no torch.distributed: ranks simulated by the row ranges torch's dim-0
chunking gives N = 1..4 ranks (uneven last shards, a rank with no rows of ``pos``), each
"rank" comparing its slice of the live tensors with its own ``ShardCompare``; every rank's
span entries go to a real bf16 receiver as one PATCH (or one part a rank), for 3 versions of
real AdamW steps on a small fp32 model, with the host and the device codec, a tensor that goes
dense and NaN / -0.0 edits. The receiver equals the full model cast to bf16, bit for bit, and
the changes the entries carry are those the unsharded compare finds on the full tensors.

(b) Two gloo ranks, each its own process, on the FSDP2 model of examples/fsdp2_trainer.py:
each rank's ``local_range`` matches its ``to_local()`` and torch's global offset (also on an
uneven, an empty, a replicated DTensor; other placements refused), and a rank's collect after
a real step runs with ``DTensor.full_tensor`` made to raise; its entries, one part a rank,
bring a receiver to the full model.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import pickle
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from coded import stage_decoded
from ranks import spawn_ranks
from test_device_codec import bits
from test_spans import at_base, deliver, frames_of

from benchmarks.opcount import OpCounter
from examples.fsdp2_trainer import build_sharded, free_port
from examples.tiny_model import TinyLM, build, train_step
from protocol.codec.tensorcodec import EncodedTensor, PatchOptions, assemble, at_span, decode_entry
from protocol.config import InitSyncConfig, PatchConfig
from protocol.errors import ConfigError, MetadataMismatchError
from protocol.state import resolve_state, sync_keys
from protocol.wire.framing import Encoding
from protocol.wire.metadata import ModelMetadata
from protocol.wire.span import Span
from sender.diff.compare import make_compare
from sender.diff.snapshot import Snapshot
from sender.plan import SyncPlan
from sender.sharded.shards import ShardCompare, ShardKey, local_range, row_range, shard_keys
from sender.stats import SyncStats

CPU = torch.device("cpu")
WORLDS = (1, 2, 3, 4)
CODECS = {"host": PatchConfig(codec="host"), "device": PatchConfig(codec="device")}
NEVER_DENSE = PatchOptions(dense_above=1.5, device_codec=False)  # the unsharded compare's every change, positions and all


def receiver_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.bfloat16 if t.is_floating_point() else t.dtype


def metadata_of(model: torch.nn.Module) -> ModelMetadata:
    """A bf16 rollout's metadata: what its receiver says in HELLO."""
    tensors = model.state_dict()
    return ModelMetadata(tuple(tensors), tuple(tuple(t.shape) for t in tensors.values()), tuple(receiver_dtype(t) for t in tensors.values()))


def full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().to(receiver_dtype(t), copy=True) for k, t in model.state_dict().items()}


# -- (a) simulated ranks ------------------------------------------------------------------------
@pytest.mark.parametrize("rows", range(0, 10))
@pytest.mark.parametrize("world", WORLDS)
def test_row_ranges_are_torch_chunks(rows: int, world: int) -> None:
    chunks = torch.arange(rows).chunk(world) if rows else ()
    for rank in range(world):
        lo, hi = row_range((rows, 3), rank, world)
        mine = chunks[rank].tolist() if rank < len(chunks) else []
        assert hi - lo == 3 * len(mine)
        if mine:
            assert lo == 3 * mine[0]
        else:
            assert lo == hi == 3 * rows  # torch's offset of an empty shard: the end


def simulated(model: torch.nn.Module, keys: list[str], metadata: ModelMetadata, rank: int, world: int) -> list[ShardKey]:
    """The ``ShardKey``s ``rank`` of ``world`` would compare: rows as FSDP2's ``Shard(0)`` chunks them; a
    0-dim buffer (replicated) on rank 0."""
    tensors = model.state_dict()
    out = []
    for key in keys:
        t = tensors[key]
        span = row_range(tuple(t.shape), rank, world) if t.dim() else ((0, 1) if rank == 0 else (0, 0))
        if span[0] < span[1]:
            out.append(ShardKey(key, metadata.ordinal(key), metadata.dtypes[metadata.ordinal(key)], Span.range(*span)))
    return out


def slices(model: torch.nn.Module, keys: list[ShardKey]) -> dict[str, torch.Tensor]:
    """A simulated rank's local tensors: its rows of the live weights (views, as a shard is)."""
    tensors = model.state_dict()
    return {k.key: k.span.of(tensors[k.key].detach().reshape(-1)) for k in keys}


def carried(entries: list[EncodedTensor], dtypes: dict[int, torch.dtype], old: dict[int, torch.Tensor]) -> set[tuple[int, int]]:
    """(ordinal, flat position) of every change ``entries`` carry: a sparse span's positions as
    they are, a dense span's where its value differs from ``old`` (bitwise)."""
    specs, frames = assemble(entries)
    out: set[tuple[int, int]] = set()
    for spec in specs:
        assert spec.span is not None and not spec.group
        decoded = decode_entry(spec, frames, (spec.span.numel,), dtypes[spec.key], CPU)
        if decoded.verdict is not None:  # read as the receiver reads it, against the tensor's old values
            stage_decoded([(decoded, (), spec.span)], {spec.key: old[spec.key]})
        placed = at_span(decoded, spec.span)
        assert placed.flat is not None
        flat = placed.flat
        if spec.encoding is Encoding.DENSE:
            flat = flat[bits(placed.values) != bits(spec.span.of(old[spec.key].reshape(-1)))]
        out |= {(spec.key, int(p)) for p in flat.tolist()}
    return out


def edit(model: TinyLM, version: int) -> None:
    """After the step: v2 negates ``pos`` (every shard of it goes dense) and zeroes an element;
    v3 makes that element -0.0 and puts NaNs of several payloads and signs in (the last version:
    the training never sees them)."""
    with torch.no_grad():
        if version == 2:
            model.pos.neg_()
            model.embed.weight[0, 0] = 0.0
            model.norm.weight[2] = float("nan")
        if version == 3:
            model.embed.weight[0, 0] = -0.0
            model.norm.weight[3] = float("nan")
            model.norm.weight[4] = -float("nan")
            bias = model.blocks[0].mlp[0].bias
            bias.view(torch.int32)[7] = 0x7FA00001  # a signalling NaN's payload
            bias.view(torch.int32)[8] = -0x00400000  # 0xFFC00000: the negative quiet NaN


async def _three_versions(codec: str) -> dict[str, Any]:
    config = CODECS[codec]
    model = build(seed=0, context=5)  # pos: 5 rows, so 4 ranks hold 2, 2, 1 and 0 of them
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    state = resolve_state(model)
    keys = sync_keys(state)  # tracked, the tied head.weight left out: embed.weight carries it
    metadata = metadata_of(model)
    dtypes = {metadata.ordinal(k): metadata.dtypes[metadata.ordinal(k)] for k in keys}
    # the unsharded compare of the full tensors, every change collected (never dense)
    plan = SyncPlan(state, metadata, InitSyncConfig(enabled=False))
    whole = make_compare(config.codec, plan, NEVER_DENSE, Snapshot("cpu"), {}, stage=False)
    whole.capture(state.tensors)
    ranks: dict[int, list[ShardCompare]] = {}
    receivers: dict[int, tuple[Any, TinyLM]] = {}
    for world in WORLDS:
        ranks[world] = []
        for rank in range(world):
            mine = simulated(model, keys, metadata, rank, world)
            compare = ShardCompare.from_config(slices(model, mine), mine, config)
            compare.capture(slices(model, mine))
            ranks[world].append(compare)
        rollout = build(seed=7 + world, context=5).to(torch.bfloat16)
        receivers[world] = (await at_base(model, rollout, False), rollout)
    out: dict[str, Any] = {"dense": {}, "entries": {}, "changed": []}
    for version in (1, 2, 3):
        before = {metadata.ordinal(k): v for k, v in full_bf16(model).items()}
        train_step(model, optimizer, generator)
        edit(model, version)
        expected = full_bf16(model)
        found: set[tuple[int, int]] = set()
        for c in whole.collect(state.tensors, SyncStats(version, "patch"), lambda c: c):
            assert c.flat is not None and not c.group
            found |= {(c.key, int(p)) for p in c.flat.tolist()}
        out["changed"].append(len(found))
        for world in WORLDS:
            per_rank = []
            for compare in ranks[world]:
                stats = SyncStats(version, "patch")
                per_rank.append(compare.collect(slices(model, compare.keys), stats))
                spans = {(k.ordinal, k.span) for k in compare.keys}
                assert all((e.key, e.span) in spans for e in per_rank[-1])  # the rank's own ranges only
            entries = [e for rank_entries in per_rank for e in rank_entries]
            assert carried(entries, dtypes, before) == found, (world, version)
            out["dense"][(world, version)] = sorted({e.key for e in entries if e.encoding is Encoding.DENSE})
            out["entries"][(world, version)] = len(entries)
            r, rollout = receivers[world]
            # v2 as one part a rank (those with changes), the others as one message
            parts = [p for p in per_rank if p] if version == 2 else [entries]
            assert await deliver(r, rollout, frames_of(r, parts, version)) == version
            assert r.version == version and not r.torn
            got = rollout.state_dict()
            for key, want in expected.items():
                assert torch.equal(bits(got[key]), bits(want)), (world, version, key)
    out["pos"] = metadata.ordinal("pos")
    return out


@pytest.mark.parametrize("codec", list(CODECS))
def test_simulated_ranks_bring_receivers_to_the_full_model(codec: str) -> None:
    """Three versions, N = 1..4 ranks: bit-identical receivers, the unsharded compare's changes."""
    out = asyncio.run(_three_versions(codec))
    assert all(n > 0 for n in out["changed"])
    for world in WORLDS:
        assert out["pos"] in out["dense"][(world, 2)], world  # every shard of pos changed: dense spans
        assert out["entries"][(world, 1)] >= out["entries"][(1, 1)]  # a tensor's changes in a span a rank


def test_a_shard_of_the_wrong_size_or_a_missing_key_is_refused() -> None:
    t = torch.zeros(4, 3)
    key = ShardKey("w", 0, torch.bfloat16, Span.range(3, 9))
    compare = ShardCompare({"w": t.reshape(-1)[3:9]}, [key], PatchConfig().options())
    with pytest.raises(MetadataMismatchError, match="holds 12 elements"):
        compare.capture({"w": t})
    with pytest.raises(MetadataMismatchError, match="missing"):
        compare.collect({})
    empty = ShardCompare({}, [], PatchConfig().options())  # a rank with nothing to compare
    empty.capture({})
    assert empty.collect({}) == []


def megatron_like(layers: int, rank: int, g: torch.Generator) -> tuple[dict[str, torch.Tensor], list[ShardKey]]:
    """One TP=2 rank's parameters laid out as Megatron lays them (two query groups of
    [q, q, k, v] rows in a fused QKV; half the columns of a row-parallel o_proj), with the keys a
    ``MegatronLayout`` probe finds: q, k, v strided in the QKV (local side), the o_proj shard a
    strided block of its checkpoint tensor, a norm (rank 0 sends it)."""
    tensors: dict[str, torch.Tensor] = {}
    keys: list[ShardKey] = []
    for i in range(layers):
        qkv, proj, norm = torch.randn(8, 16, generator=g), torch.randn(16, 8, generator=g), torch.randn(16, generator=g)
        tensors |= {f"{i}.qkv": qkv, f"{i}.proj": proj, f"{i}.norm": norm}
        base = 5 * i
        # a group is 4 rows of 16: q rows 0-1, k row 2, v row 3; this rank holds groups 2r and 2r + 1
        keys += [
            ShardKey(f"{i}.q", base, torch.bfloat16, Span(rank * 64, 64), f"{i}.qkv", Span(0, 32, 2, 64)),
            ShardKey(f"{i}.k", base + 1, torch.bfloat16, Span(rank * 32, 32), f"{i}.qkv", Span(32, 16, 2, 64)),
            ShardKey(f"{i}.v", base + 2, torch.bfloat16, Span(rank * 32, 32), f"{i}.qkv", Span(48, 16, 2, 64)),
            ShardKey(f"{i}.o", base + 3, torch.bfloat16, Span(rank * 8, 8, 16, 16), f"{i}.proj"),
        ]
        if rank == 0:
            keys.append(ShardKey(f"{i}.n", base + 4, torch.bfloat16, Span(0, 16), f"{i}.norm"))
    return tensors, keys


def checkpoint_of(ranks: list[tuple[dict[str, torch.Tensor], list[ShardKey]]]) -> dict[int, torch.Tensor]:
    """Each checkpoint tensor (by ordinal, flat) from the ranks' parameters through their keys."""
    sizes = {k.ordinal: k.span.hi for _, keys in ranks for k in keys}
    out = {o: torch.zeros(max(n for oo, n in sizes.items() if oo == o)) for o in sizes}
    for tensors, keys in ranks:
        for k in keys:
            local = tensors[k.source].reshape(-1)
            values = (k.local.of(local) if k.local is not None else local).reshape(-1)
            k.span.of(out[k.ordinal]).copy_(values.reshape(k.span.of(out[k.ordinal]).shape))
    return {o: t.to(torch.bfloat16) for o, t in out.items()}


@pytest.mark.parametrize("codec", list(CODECS))
def test_megatron_shards_carry_exactly_the_checkpoints_changes_in_kernels_flat_in_the_tensor_count(codec: str) -> None:
    """Keys strided on either side (a Megatron rank's query groups, its row-parallel columns):
    the two ranks' entries carry exactly the changed positions of the checkpoint tensors the
    ranks' parameters make (bitwise, bf16), and under the device codec a version's kernels do
    not grow with the number of strided keys: 8 layers within 12 ops of 2 layers' (no dense
    tensor; the strided keys' elements are copied one ``cat`` a run length)."""
    counts = {}
    for layers in (2, 8):
        g = torch.Generator().manual_seed(layers)
        ranks = [megatron_like(layers, r, g) for r in range(2)]
        compares = [ShardCompare(t, k, CODECS[codec].options(), compare=CODECS[codec].codec) for t, k in ranks]
        for c, (t, _) in zip(compares, ranks):
            c.capture(t)
        before = checkpoint_of(ranks)
        for t, _ in ranks:  # a sparse step: every 7th element of every parameter moves
            for x in t.values():
                x.view(-1)[::7] += 0.5
        after = checkpoint_of(ranks)
        with OpCounter() as counter:
            entries = [e for c, (t, _) in zip(compares, ranks) for e in c.collect(t)]
        ops, _ = counter.take()
        counts[layers] = sum(ops.values())
        want = {(o, int(p)) for o in after for p in torch.nonzero(bits(after[o]) != bits(before[o])).reshape(-1).tolist()}
        assert want and carried(entries, dict.fromkeys(after, torch.bfloat16), before) == want
    if codec == "device":  # the GPU path (the host compare runs per tensor on the CPU, by design)
        assert counts[8] <= counts[2] + 12, counts


def test_plain_tensors_are_compared_by_rank_zero() -> None:
    t = torch.zeros(3, 2)
    assert local_range(t, "steps", rank=0) == (0, 6)
    assert local_range(t, "steps", rank=1) is None
    assert local_range(t, "steps") == (0, 6)  # no torch.distributed here: rank 0
    ordinals, dtypes = {"a": 4, "b": 5}, {"a": torch.bfloat16, "b": torch.int64}
    tensors = {"a": t, "b": torch.zeros(0, dtype=torch.int64)}
    assert shard_keys(tensors, ["a", "b"], ordinals, dtypes, rank=0) == [ShardKey("a", 4, torch.bfloat16, Span.range(0, 6))]
    assert shard_keys(tensors, ["a", "b"], ordinals, dtypes, rank=1) == []


# -- (b) two gloo ranks -------------------------------------------------------------------------
WORLD = 2
DEADLINE = 90.0


def _placements(rank: int) -> dict[str, Any]:
    """local_range against torch on DTensors of every kind, and what it refuses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = init_device_mesh("cpu", (WORLD,))
    out: dict[str, Any] = {"ranges": [], "refused": []}
    for shape, placement in [((5, 3), Shard(0)), ((1, 4), Shard(0)), ((3,), Shard(0)), ((4, 2), Replicate())]:
        t = distribute_tensor(torch.arange(float(torch.Size(shape).numel())).reshape(shape), mesh, [placement])
        local = t.to_local()
        _, offset = compute_local_shape_and_global_offset(t.shape, mesh, t.placements)
        row = torch.Size(shape[1:]).numel()
        out["ranges"].append([list(shape), str(placement), local_range(t, "x"), local.numel(), offset[0] * row])
    refused = {
        "shard1": distribute_tensor(torch.zeros(4, 4), mesh, [Shard(1)]),
        "partial": DTensor.from_local(torch.zeros(4), mesh, [Partial()]),
        "mesh2d": distribute_tensor(torch.zeros(4, 4), init_device_mesh("cpu", (WORLD, 1)), [Shard(0), Replicate()]),
    }
    for name, t in refused.items():
        try:
            local_range(t, name)
        except ConfigError as e:
            out["refused"].append([name, str(e)])
    return out


def _rank(rank: int, out: Path) -> None:
    from torch.distributed.tensor import DTensor

    record = _placements(rank)
    model = build_sharded(WORLD)  # pos frozen: not tracked
    tensors = model.state_dict()
    keys = sync_keys(resolve_state(model))
    metadata = metadata_of(build(seed=0))
    mine = shard_keys(tensors, keys, {k: metadata.ordinal(k) for k in keys}, {k: metadata.dtypes[metadata.ordinal(k)] for k in keys})
    record["model"] = []
    for key in keys:
        t = tensors[key]
        span = local_range(t, key)
        local = t.to_local() if isinstance(t, DTensor) else t
        record["model"].append([key, span, local.numel(), t.numel()])
    compare = ShardCompare.from_config(tensors, mine, PatchConfig(codec="device"))  # torch ops: no numba to load here
    compare.capture(tensors)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    train_step(model, optimizer, torch.Generator().manual_seed(1 + rank))

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank's compare gathered a tracked tensor")

    gather, DTensor.full_tensor = DTensor.full_tensor, refuse  # type: ignore[method-assign]
    try:
        entries = compare.collect(model.state_dict())
    finally:
        DTensor.full_tensor = gather  # type: ignore[method-assign]
    record["spans"] = sorted({(k.ordinal, tuple(k.span.to_wire())) for k in mine})
    record["entry_spans"] = [[e.key, e.span.to_wire() if e.span else []] for e in entries]
    wire = [(e.key, e.encoding, e.values, e.nnz, [(s, bytes(w)) for s, w in e.buffers], e.group, e.span) for e in entries]
    (out / f"entries{rank}.pkl").write_bytes(pickle.dumps(wire))
    full = {k: (t.full_tensor() if isinstance(t, DTensor) else t).detach() for k, t in model.state_dict().items()}  # the check's own gathers
    if rank == 0:
        torch.save({k: t.to(receiver_dtype(t)) for k, t in full.items()}, out / "full.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        _rank(rank, Path(out_dir))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    spawn_ranks(_worker, WORLD, (free_port(), str(out)), DEADLINE)
    return out


def test_gloo_ranks_local_ranges_are_their_shards(gloo: Path) -> None:
    records = [json.loads((gloo / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, record in enumerate(records):
        for shape, placement, span, local_numel, offset in record["ranges"]:
            if placement == "R":  # Replicate: rank 0 compares it whole
                assert span == ([0, local_numel] if rank == 0 else None)
                continue
            assert span == [offset, offset + local_numel], (shape, rank)
        assert [name for name, _ in record["refused"]] == ["shard1", "partial", "mesh2d"]
        for name, message in record["refused"]:
            assert repr(name) in message
        for key, span, local_numel, _ in record["model"]:
            if key == "steps":  # a plain buffer: rank 0's
                assert span == ([0, 1] if rank == 0 else None)
            else:
                assert span is not None and span[1] - span[0] == local_numel
    # uneven (5 rows: 3 and 2), empty (1 row: rank 1 none), 1-D (3: 2 and 1)
    assert [r[4] for r in records[1]["ranges"][:3]] == [9, 4, 2] and records[1]["ranges"][1][3] == 0
    for key, _, _, numel in records[0]["model"]:  # the ranks' ranges tile each tensor
        spans = sorted(tuple(s) for r in records for k, s, _, _ in r["model"] if k == key and s is not None and s[0] < s[1])
        assert spans[0][0] == 0 and spans[-1][1] == numel and all(a[1] == b[0] for a, b in itertools.pairwise(spans)), key


def test_gloo_ranks_entries_bring_a_receiver_to_the_full_model(gloo: Path) -> None:
    """Each rank compared without gathering (``full_tensor`` raised); its entries, one part a
    rank, on a receiver bootstrapped at v0: the full model after the step, cast to bf16."""
    records = [json.loads((gloo / f"rank{r}.json").read_text()) for r in range(WORLD)]
    parts = []
    for rank in range(WORLD):
        entries = [EncodedTensor(*e) for e in pickle.loads((gloo / f"entries{rank}.pkl").read_bytes())]
        spans = {(o, tuple(s)) for o, s in records[rank]["spans"]}
        assert entries and all(e.span is not None and (e.key, tuple(e.span.to_wire())) in spans for e in entries)
        parts.append(entries)
    full = torch.load(gloo / "full.pt")

    async def apply() -> dict[str, torch.Tensor]:
        rollout = build(seed=3).to(torch.bfloat16)
        r = await at_base(build(seed=0), rollout, False)  # v0: build_sharded's weights before sharding
        assert await deliver(r, rollout, frames_of(r, parts, 1)) == 1
        return rollout.state_dict()

    got = asyncio.run(apply())
    for key, want in full.items():
        assert torch.equal(bits(got[key]), bits(want)), key
