"""FSDP2 (``fully_shard``) trainers under the gathering build (``ShardedSync(gather=True)``; the
sharded build: ``test_fsdp2_sharded.py``): two real gloo ranks on CPU, one Sender on rank 0.

One spawn runs everything (starting ranks is the slow part): for the patch and the bucket
strategy, real AdamW steps on the sharded tiny transformer (tied embedding, a frozen
sharded weight), ``ShardedSync`` on both ranks, and bf16 receivers on rank 0: one joining
after the first version, one joining late while rank 1 is blocked in a training
collective (a bootstrap that needed a gather would hang or fail). Each rank records
what it gathered; the tests compare the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from ranks import spawn_ranks

from examples.fsdp2_trainer import build_sharded, free_port, full_bf16_digest
from examples.tiny_model import build, train_step
from protocol.errors import GatherOrderError
from protocol.state import gathering, materialize, resolve_state
from protocol.wire.checksum import state_digest
from receiver import Receiver
from sender import Sender
from sender.sharded import gathers
from sender.sharded.gathers import _Leader, gather_order
from sender.sharded.sync import ShardedSync

WORLD = 2
VERSIONS = 4
CONFIGS: dict[str, dict[str, Any]] = {
    "patch": {"weight_syncer": {"type": "patch"}},
    # small tensors grouped, large ones alone, interleaved in the gather order (as in any real
    # model; the tiny one's tensors are all small by default): the compare keeps that order
    "patch-mixed": {"weight_syncer": {"type": "patch", "patch": {"group_numel": 1024}}},
    # the device path (issue 35) on gathered DTensors: compared one by one, coded by the device codec a part at once
    "patch-device": {"weight_syncer": {"type": "patch", "patch": {"codec": "device", "group_numel": 1024}}},
    "bucket": {"weight_syncer": {"type": "bucket", "bucket": {"init_sync": {"enabled": True}}}},
}
DEADLINE = 150.0  # seconds for the whole spawn; a hang fails the tests instead of blocking them


async def _scenario(rank: int, mode: str) -> dict[str, Any]:
    model = build_sharded(WORLD)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1 + rank)
    sharded = ShardedSync(model, gather=True)  # the gathering build (tests/test_fsdp2_sharded.py: the sharded one)
    out: dict[str, Any] = {"order": sharded.layout.order, "sequences": [], "checks": []}
    config = CONFIGS[mode]
    async with contextlib.AsyncExitStack() as stack:
        sender = Sender("tcp://127.0.0.1:0", config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
        if sender is not None:
            await stack.enter_async_context(sender)
        await sharded.start(sender, version=0)
        out["sequences"].append(list(sharded.stats.last))
        receivers: list[tuple[Receiver, torch.nn.Module]] = []

        async def join() -> None:
            assert sender is not None
            rollout = build(seed=len(receivers) + 1).to(torch.bfloat16)
            receiver = Receiver(rollout, sender.endpoint, config, identity=f"{mode}-{len(receivers)}")
            await stack.enter_async_context(receiver)
            await receiver.start()
            receivers.append((receiver, rollout))

        for version in range(1, VERSIONS + 1):
            train_step(model, optimizer, generator)
            await sharded.sync(sender, version)
            out["sequences"].append(list(sharded.stats.last))
            expected = full_bf16_digest(model)  # the test's own gathers, on every rank
            if sender is None:
                continue
            if version in (1, 3):  # the first joins after v1 (sender holds v1 with no builder yet), another at v3
                await join()
            await sender.flush()
            for receiver, rollout in receivers:
                await receiver.wait_for_version(version, timeout=30)
                async with receiver.reading():
                    out["checks"].append([mode, version, receiver.identity, state_digest(rollout.state_dict()), expected])
    s = sharded.stats
    out.update(gathers=s.gathers, peak_live=s.peak_live, peak_bytes=s.peak_bytes, overlaps=s.overlaps, live=s.live)
    largest = max(t.numel() * t.element_size() for k, t in model.state_dict().items() if k in sharded.layout.order)
    out["largest_bytes"] = largest

    # Refusals: no collective is made, so each rank checks them alone.
    view = sharded._view()
    hook = _Leader(sharded.layout.gatherer, view)
    refused = []
    with gathering(hook):
        try:
            materialize(view[sharded.layout.order[1]])  # skips order[0]
        except GatherOrderError:
            refused.append("out_of_order")
    hook.active = False
    try:
        hook(view[sharded.layout.order[0]])
    except GatherOrderError:
        refused.append("outside_sync")
    out["refused"] = refused

    # Ranks that disagree on the version all raise, together (no rank left waiting).
    try:
        sharded._agree(100 + rank)
    except GatherOrderError:
        out["disagreement_raised"] = True

    # Control: keeping every gathered tensor is what the peak figure must catch.
    wait, gathers.RELEASE_WAIT = gathers.RELEASE_WAIT, 0.0  # nothing will be released: do not wait for it
    tensors = model.state_dict()
    kept = [sharded.layout.gatherer.gather(k, tensors[k]) for k in sharded.layout.order]
    out["control_peak"] = sharded.stats.peak_live
    del kept
    gathers.RELEASE_WAIT = wait
    out["order_matches_state"] = sharded.layout.order == gather_order(resolve_state(
        {k: tensors[k] for k in sharded.layout.keys}, sharded.trainable_keys))
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    try:
        results = {mode: asyncio.run(_scenario(rank, mode)) for mode in CONFIGS}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("fsdp2")
    spawn_ranks(_worker, WORLD, (free_port(), str(out)), DEADLINE)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_receivers_bit_identical_to_the_full_model_each_version(ranks: list[dict[str, Any]], mode: str) -> None:
    checks = ranks[0][mode]["checks"]
    # receiver 0 from v1, receiver 1 from v3 (a late bootstrap, made without collectives)
    assert [(c[1], c[2]) for c in checks] == [(1, f"{mode}-0"), (2, f"{mode}-0"), (3, f"{mode}-0"), (3, f"{mode}-1"),
                                              (4, f"{mode}-0"), (4, f"{mode}-1")]
    for _, version, identity, got, expected in checks:
        assert got == expected, f"{identity} at v{version} differs from the full model cast to bf16"
    assert len({c[4] for c in checks}) == VERSIONS  # the weights really moved every version


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_ranks_gather_one_order_one_tensor_at_a_time(ranks: list[dict[str, Any]], mode: str) -> None:
    leader, follower = ranks[0][mode], ranks[1][mode]
    order = leader["order"]
    assert order == follower["order"] and len(order) > 20
    assert "pos" not in order  # frozen: gathered once at start, kept, never again
    assert "head.weight" not in order and "embed.weight" in order  # the tied pair: gathered once
    # start + every version: exactly the shared order, on both ranks, each key once
    assert leader["sequences"] == follower["sequences"] == [order] * (VERSIONS + 1)
    for rank in (leader, follower):
        assert rank["peak_live"] == 1, "two gathered full tensors were alive at once"
        assert rank["peak_bytes"] == rank["largest_bytes"]
        assert rank["overlaps"] == 0
        assert rank["control_peak"] == len(order)  # the figure does catch a whole-model gather
        assert rank["order_matches_state"]


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_divergent_gathers_are_refused_before_the_collective(ranks: list[dict[str, Any]], mode: str) -> None:
    for rank in ranks:
        assert rank[mode]["refused"] == ["out_of_order", "outside_sync"]
        assert rank[mode]["disagreement_raised"]


@pytest.mark.timeout(180)
async def test_the_example_trainer_prints_its_endpoint_and_an_outside_rollout_follows_it() -> None:
    """examples/fsdp2_trainer.py as a user runs it: the Sender's endpoint is printed (a
    ``listening`` line; it bound a random port and never said which) and taken from
    ``--endpoint``, so a rollout of one's own, here a bf16 Receiver in this process, joins
    it and ends on the trainer's last version, bit for bit."""
    import sys

    root = Path(__file__).resolve().parent.parent
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(root / "examples" / "fsdp2_trainer.py"), "--steps", "6", "--step-interval", "0.5",
        "--endpoint", "tcp://127.0.0.1:0", cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    lines: list[dict[str, Any]] = []

    async def line() -> dict[str, Any]:
        assert proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert raw, f"the trainer ended early (rc {await proc.wait()}); lines {lines}"
            if raw.startswith(b"{"):
                lines.append(json.loads(raw))
                return lines[-1]

    try:
        listening = await line()
        assert listening["event"] == "listening" and listening["endpoint"].startswith("tcp://127.0.0.1:"), listening
        rollout = build(seed=5).to(torch.bfloat16)
        async with Receiver(rollout, listening["endpoint"], None, identity="outside") as receiver:
            joined = asyncio.ensure_future(receiver.start(timeout=120))
            while (event := await line())["event"] != "done":
                assert event["event"] == "synced"
            await joined
            last = max(e["version"] for e in lines if e["event"] == "synced")
            await receiver.wait_for_version(last, timeout=60)
            async with receiver.reading():
                held = state_digest(rollout.state_dict())
        assert held == next(e["digest"] for e in lines if e.get("version") == last and e["event"] == "synced")
        assert "outside" in lines[-1]["receivers"]
        assert await asyncio.wait_for(proc.wait(), 60) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
