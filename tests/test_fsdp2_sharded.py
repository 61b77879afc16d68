"""FSDP2 trainers under the sharded build (issue 36): every rank compares its own shards, only the
encoded changes move to the leader. Real gloo ranks on CPU (2 and 4), each its own process.

One spawn a world size runs, for the patch strategy (host and device codec) and the bucket one
(which keeps gathering): real AdamW steps on the sharded tiny transformer with a tied embedding,
a frozen sharded weight, a vocabulary of 251 rows (the last shard shorter) and a plain int64
buffer every rank holds (compared by rank 0 alone), ``ShardedSync`` on every rank and bf16
receivers on rank 0, one joining before v1 and one after v2 (each bootstrapped at the next
version). The leader records every PATCH frame it publishes; each rank records what it
gathered and moved. Then, in the same spawn, the ranks disagree on a version, and one rank's
build fails: every rank raises the same typed error, nothing is published, and the next
version resyncs the receivers by bootstrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ranks import spawn_ranks
from test_device_codec import bits
from test_shards import carried

from examples.fsdp2_trainer import build_sharded, free_port, full_bf16_digest
from examples.tiny_model import build, train_step
from protocol.errors import GatherOrderError, WeightSyncError
from protocol.wire.checksum import state_digest
from protocol.wire.framing import decode_message
from receiver import Receiver
from sender import Sender
from sender.sharded.sync import ShardedSync

VERSIONS = 4
VOCAB = 251  # rows of the (tied) embedding: 126 + 125 on 2 ranks, 63 x 3 + 62 on 4
CONFIGS: dict[str, dict[str, Any]] = {
    "patch": {"weight_syncer": {"type": "patch", "patch": {"codec": "host", "part_bytes": 4096}}},
    "patch-device": {"weight_syncer": {"type": "patch", "patch": {"codec": "device"}}},
    "bucket": {"weight_syncer": {"type": "bucket", "bucket": {"init_sync": {"enabled": True}}}},
}
DEADLINE = 300.0  # seconds for one spawn; a hang fails the tests instead of blocking them


def full_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor whole at the receivers' dtype (the test's own gathers, outside the sync)."""
    out = {}
    for key, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        out[key] = full.detach().to(torch.bfloat16 if full.is_floating_point() else full.dtype, copy=True)
    return out


Part = Callable[..., bytes]  # ``ShardBuild.part``


@contextlib.contextmanager
def part_wrapped(sharded: ShardedSync, wrap: Callable[[Part], Part] | None) -> Iterator[None]:
    """Inside, this rank's ``ShardBuild.part`` is ``wrap`` of the real one (None: this rank's is left alone)."""
    build = sharded._build
    if wrap is None:
        yield
        return
    assert build is not None
    real = build.part
    build.part = wrap(real)  # type: ignore[method-assign]
    try:
        yield
    finally:
        build.part = real  # type: ignore[method-assign]


async def _waiting(sender: Sender, timeout: float = 30.0) -> None:
    """Until the sender's source has been asked for a bootstrap (a receiver waits for the next version)."""
    deadline = time.monotonic() + timeout
    while not sender.bootstrap_wanted:
        if time.monotonic() > deadline:
            raise TimeoutError("no receiver asked for a bootstrap")
        await asyncio.sleep(0.01)


async def _scenario(rank: int, world: int, mode: str) -> dict[str, Any]:
    model = build_sharded(world, vocab=VOCAB)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1 + rank)
    sharded = ShardedSync(model, timeout=30)
    out: dict[str, Any] = {"order": sharded.layout.order, "gathered": [], "checks": [], "changes": [], "group_bytes": [], "parts": []}
    config = CONFIGS[mode]
    published: list[tuple[int, Any]] = []
    failing_publish: list[bool] = []
    out["published_at"] = {}
    async with contextlib.AsyncExitStack() as stack:
        sender = Sender("tcp://127.0.0.1:0", config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
        if sender is not None:
            await stack.enter_async_context(sender)
            publish = sender.server.publish_patch

            def recording(base: int | None, version: int, frames: list[Any], *, last: bool = True) -> None:
                if failing_publish:
                    failing_publish.pop()
                    raise WeightSyncError("injected: the leader's Sender failed to publish a part")
                published.append((version, [bytes(f) for f in frames]))
                out["published_at"].setdefault(str(version), []).append(time.time())
                publish(base, version, frames, last=last)

            sender.server.publish_patch = recording  # type: ignore[method-assign]
        await sharded.start(sender, version=0)
        out["sharded"] = sharded.sharded
        out["gathered"].append(list(sharded.stats.last))
        receivers: list[tuple[Receiver, torch.nn.Module]] = []
        joining: list[asyncio.Task[Any]] = []

        async def join() -> None:
            assert sender is not None
            rollout = build(seed=len(receivers) + 1, vocab=VOCAB).to(torch.bfloat16)
            receiver = Receiver(rollout, sender.endpoint, config, identity=f"{mode}-{len(receivers)}")
            await stack.enter_async_context(receiver)
            receivers.append((receiver, rollout))
            if sharded.sharded:  # bootstrapped at the next version: start it, sync, then wait
                joining.append(asyncio.ensure_future(receiver.start()))
                await _waiting(sender)
            else:
                await receiver.start()

        async def check(version: int, expected: str | None) -> None:
            for task in joining:
                await task
            joining.clear()
            assert sender is not None
            await sender.flush()
            for receiver, rollout in receivers:
                await receiver.wait_for_version(version, timeout=30)
                async with receiver.reading():
                    out["checks"].append([version, receiver.identity, state_digest(rollout.state_dict()), expected])

        async def check_all(version: int) -> None:
            """On every rank: the full model's digest is a collective (its gathers); the
            leader's receivers must then hold it at ``version``."""
            expected = full_bf16_digest(model)
            if sender is not None:
                await check(version, expected)

        if rank == 0:
            await join()  # before v1
        for version in range(1, VERSIONS + 1):
            before = full_bf16(model)
            train_step(model, optimizer, generator)
            stats = await sharded.sync(sender, version)
            out["gathered"].append(list(sharded.stats.last))
            if sharded.part_stats is not None and sharded.part_stats.version == version:
                wire = None if stats is None else stats.wire_bytes
                out["group_bytes"].append([version, sharded.part_stats.group_bytes, sharded.part_stats.sizes, wire])
            after = full_bf16(model)
            out["model_bytes"] = sum(t.numel() * t.element_size() for k, t in after.items() if k in sharded.layout.compared)
            expected = full_bf16_digest(model)
            if sender is None:
                continue
            assert sender.plan is not None or version == 1
            patch = [decode_message(f) for v, f in published if v == version]
            if patch and sender.plan is not None:
                plan = sender.plan
                dtypes = {plan.ordinal(k): plan.receiver_dtype(k) for k in plan.tracked}
                old = {plan.ordinal(k): before[k] for k in plan.tracked}
                entries = [(m.tensors, m.frames) for m in patch]
                got = set().union(*(carried_frames(t, f, dtypes, old) for t, f in entries))
                want = {(plan.ordinal(k), int(p)) for k in plan.tracked
                        for p in torch.nonzero(bits(after[k]).reshape(-1) != bits(before[k]).reshape(-1)).reshape(-1).tolist()}
                out["changes"].append([version, got == want, len(want), [m.part for m in patch], [m.last for m in patch]])
            await check(version, expected)
            if version == 2:
                await join()  # after v2: bootstrapped at v3 (the sharded build) or at once (bucket)
        out["stats"] = {"gathers": sharded.stats.gathers, "peak_live": sharded.stats.peak_live}

        # -- failures, in the same group ---------------------------------------------------------
        version = VERSIONS
        if sharded.sharded:
            # (a) the ranks disagree on the version: every rank raises, nothing moves
            version += 1
            train_step(model, optimizer, generator)
            try:
                await sharded.sync(sender, version + rank)
            except GatherOrderError:
                out["disagreement"] = "GatherOrderError"
            out["after_disagreement"] = None if sender is None else sender.version
            # (b) then in lockstep: every receiver resynced by bootstrap to the version
            await sharded.sync(sender, version)
            out["resync_gathered"] = list(sharded.stats.last)
            await check_all(version)
            if sender is not None:
                out["resyncs"] = sum(int(r["resyncs"]) for r in sender.receivers.values())  # type: ignore[call-overload]
            # (c) one rank's build fails: every rank raises the same typed error, nothing published
            version += 1
            train_step(model, optimizer, generator)
            def failing(part: Part) -> Part:
                def failed(*args: Any) -> bytes:
                    raise RuntimeError("injected: this rank's compare failed")

                return failed

            with part_wrapped(sharded, failing if rank == world - 1 else None):
                try:
                    await sharded.sync(sender, version)
                except WeightSyncError as e:
                    out["failed_build"] = type(e).__name__
            out["after_failed_build"] = None if sender is None else sender.version
            version += 1
            train_step(model, optimizer, generator)
            await sharded.sync(sender, version)
            out["recovered_gathered"] = list(sharded.stats.last)
            await check_all(version)
            # (d) the leader's Sender fails before the parts are agreed: every rank raises, then resync
            version += 1
            train_step(model, optimizer, generator)
            if sender is not None:
                failing_publish.append(True)
            try:
                await sharded.sync(sender, version)
            except WeightSyncError as e:
                out["failed_publish"] = type(e).__name__
            out["after_failed_publish"] = None if sender is None else sender.version
            version += 1
            train_step(model, optimizer, generator)
            await sharded.sync(sender, version)
            await check_all(version)
            # (e) the last rank compares slowly: the leader's own part is out before that rank's is built
            version += 1
            train_step(model, optimizer, generator)
            def slow(part: Part) -> Part:
                def slowed(*args: Any) -> bytes:
                    time.sleep(1.5)
                    built = part(*args)
                    out["slow"] = {"version": version, "built_at": time.time()}
                    return built

                return slowed

            with part_wrapped(sharded, slow if rank == world - 1 else None):
                await sharded.sync(sender, version)
            await check_all(version)
        out["last_version"] = version
    return out


def carried_frames(specs: Any, frames: Any, dtypes: dict[int, torch.dtype], old: dict[int, torch.Tensor]) -> set[tuple[int, int]]:
    """``test_shards.carried`` of a decoded message's entries."""
    from protocol.codec.tensorcodec import EncodedTensor

    entries = []
    for spec in specs:
        buffers = [(b, frames[b.frame - 1]) for b in spec.buffers]
        entries.append(EncodedTensor(spec.key, spec.encoding, spec.values, spec.nnz, buffers, spec.group, spec.span))
    return carried(entries, dtypes, old)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=90))
    try:
        results = {mode: asyncio.run(_scenario(rank, world, mode)) for mode in CONFIGS}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def spawn(world: int, out: Path) -> list[dict[str, Any]]:
    spawn_ranks(_worker, world, (world, free_port(), str(out)), DEADLINE)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(request.param, tmp_path_factory.mktemp(f"sharded{request.param}"))


@pytest.mark.parametrize("mode", list(CONFIGS))
def test_receivers_bit_identical_to_the_full_model_each_version(ranks: list[dict[str, Any]], mode: str) -> None:
    leader = ranks[0][mode]
    assert leader["sharded"] == (mode != "bucket")
    checks = leader["checks"]
    seen = [(c[0], c[1]) for c in checks[:6]]
    # receiver 0 from v1, receiver 1 from v3 (a bootstrap at the version after it joined)
    assert seen == [(1, f"{mode}-0"), (2, f"{mode}-0"), (3, f"{mode}-0"), (3, f"{mode}-1"), (4, f"{mode}-0"), (4, f"{mode}-1")]
    for version, identity, got, expected in checks:
        assert got == expected, f"{identity} at v{version} differs from the full model cast to bf16"
    assert len({c[3] for c in checks}) == len({c[0] for c in checks}) >= VERSIONS  # the weights really moved every version


@pytest.mark.parametrize("mode", ["patch", "patch-device"])
def test_the_patch_carries_exactly_the_changed_elements(ranks: list[dict[str, Any]], mode: str) -> None:
    changes = ranks[0][mode]["changes"]
    assert [c[0] for c in changes] == [2, 3, 4]  # v1 is the first bootstrap: no patch
    for version, equal, changed, parts, lasts in changes:
        assert equal, f"v{version}: the sharded patch's changes differ from the bitwise changes of the full model"
        assert changed > 0
        assert parts == list(range(len(parts))) and lasts == [False] * (len(parts) - 1) + [True]
    if mode == "patch":  # part_bytes 4096: a rank's changes travel in several messages
        assert max(len(c[3]) for c in changes) > len(ranks)


@pytest.mark.parametrize("mode", ["patch", "patch-device"])
def test_no_rank_gathers_during_a_patch_version(ranks: list[dict[str, Any]], mode: str) -> None:
    order = ranks[0][mode]["order"]
    for rank in ranks:
        gathered = rank[mode]["gathered"]
        # start: nothing; v1 and v3 bootstrap waiting receivers (every tracked key once, in
        # order); v2 and v4 are patches alone: no gather at all
        assert gathered == [[], order, [], order, []]
        assert rank[mode]["stats"]["peak_live"] <= 1


@pytest.mark.parametrize("mode", ["patch", "patch-device"])
def test_the_group_carries_the_encoded_changes_not_the_model(ranks: list[dict[str, Any]], mode: str) -> None:
    world = len(ranks)
    leader = ranks[0][mode]["group_bytes"]
    assert [m[0] for m in leader][:3] == [2, 3, 4]
    for rank in ranks:
        moved = rank[mode]["group_bytes"]
        assert [m[2] for m in moved] == [m[2] for m in leader]  # every rank agreed on every part's size
    for version, group_bytes, sizes, wire in leader[:3]:
        control = world * (world - 1) * 64
        assert group_bytes == sum(sizes[1:]) + control  # the leader's own part never crosses the group
        # what the group carries is about the encoded patch (framed per rank) ...
        assert group_bytes <= 1.5 * wire, (version, group_bytes, wire)
        # ... a small share of the model (lr 1e-3 on a tiny model: most bf16 elements move)
        assert group_bytes < ranks[0][mode]["model_bytes"]


@pytest.mark.parametrize("mode", ["patch", "patch-device"])
def test_disagreeing_or_failing_ranks_raise_together_and_the_next_version_resyncs(ranks: list[dict[str, Any]], mode: str) -> None:
    order = ranks[0][mode]["order"]
    for rank in ranks:
        r = rank[mode]
        assert r["disagreement"] == "GatherOrderError"
        assert r["failed_build"] == "GatherOrderError"
        assert r["resync_gathered"] == order and r["recovered_gathered"] == order  # the resync's bootstrap gathers
        assert r["failed_publish"] == "GatherOrderError"
    leader = ranks[0][mode]
    assert leader["after_disagreement"] == VERSIONS
    assert leader["after_failed_build"] == VERSIONS + 1
    assert leader["after_failed_publish"] == VERSIONS + 3
    assert leader["resyncs"] == 2  # after the disagreement: each of the 2 receivers resynced once


def test_the_leaders_part_travels_while_the_other_ranks_still_compare(ranks: list[dict[str, Any]]) -> None:
    slow = ranks[-1]["patch"]["slow"]  # the last rank took 1.5 s more to build its part
    published = ranks[0]["patch"]["published_at"][str(slow["version"])]
    assert min(published) < slow["built_at"] - 1.0, "the leader waited for every rank before publishing"
    assert max(published) > slow["built_at"]  # and the rest came after that rank's part


# -- a rank killed mid-version, and the group restarted -------------------------------------------
KILL_AT = 3  # rank 1 dies building its part of this version
PART_TIMEOUT = 5.0


async def _phase(rank: int, endpoint: str, phase: int, out: Path) -> None:
    """Phase 1: v1 (bootstrap), v2, then rank 1 dies at v3. Phase 2 (a restarted group, a new
    Sender on the same endpoint, resumed at v2): v3 resyncs the receiver, v4 patches it."""
    model = build_sharded(2, vocab=VOCAB)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(10 * phase + rank)
    sharded = ShardedSync(model, timeout=PART_TIMEOUT)
    record: dict[str, Any] = {"expected": {}}
    config = CONFIGS["patch"]
    sender = Sender(endpoint, config, trainable_keys=sharded.trainable_keys) if rank == 0 else None
    try:
        if sender is not None:
            await sender.__aenter__()
        start = 0 if phase == 1 else KILL_AT - 1
        await sharded.start(sender, version=start)
        if sender is not None:
            await _waiting(sender, 60)  # the test's receiver is waiting for a bootstrap
        versions = range(1, KILL_AT + 1) if phase == 1 else range(KILL_AT, KILL_AT + 2)
        for version in versions:
            train_step(model, optimizer, generator)
            if phase == 1 and version == KILL_AT and rank == 1:
                assert sharded._build is not None
                sharded._build.part = lambda *a: os._exit(17)  # type: ignore[method-assign,misc,return-value]
            began = time.monotonic()
            try:
                await sharded.sync(sender, version)
            except WeightSyncError as e:
                record.update(error=type(e).__name__, seconds=time.monotonic() - began, at=version)
                record["sender_version"] = None if sender is None else sender.version
                break
            record["expected"][version] = full_bf16_digest(model)
            if sender is not None:
                await sender.flush()
                await sender.wait_acked(version, timeout=30)
    finally:
        if sender is not None:
            await sender.close()
        Path(out, f"phase{phase}-rank{rank}.json").write_text(json.dumps(record))


def _phase_worker(rank: int, port: int, endpoint: str, phase: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=20))
    asyncio.run(_phase(rank, endpoint, phase, Path(out)))
    os._exit(0)  # a group with a dead rank cannot be destroyed cleanly: leave


def _run_phase(endpoint: str, phase: int, out: Path) -> list[int | None]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_phase_worker, args=(r, port, endpoint, phase, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    return [p.exitcode for p in procs]


async def test_a_killed_rank_publishes_nothing_and_a_restarted_group_resyncs(tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    rollout = build(seed=5, vocab=VOCAB).to(torch.bfloat16)
    async with Receiver(rollout, endpoint, CONFIGS["patch"], identity="survivor") as receiver:
        joined = asyncio.ensure_future(receiver.start(timeout=120))
        codes = await asyncio.to_thread(_run_phase, endpoint, 1, tmp_path)
        assert codes == [0, 17]
        await joined
        leader = json.loads((tmp_path / "phase1-rank0.json").read_text())
        # the leader raised a typed error within the part timeout (plus the agreement's); v3 not published
        assert leader["at"] == KILL_AT and leader["error"] in ("WeightSyncTimeout", "WeightSyncError", "GatherOrderError")
        assert leader["seconds"] < 2 * PART_TIMEOUT + 5
        assert leader["sender_version"] == KILL_AT - 1
        assert receiver.version == KILL_AT - 1
        async with receiver.reading():
            assert state_digest(rollout.state_dict()) == leader["expected"][str(KILL_AT - 1)]
        # a restarted group, a new Sender on the same endpoint: the receiver is resynced, then patched
        codes = await asyncio.to_thread(_run_phase, endpoint, 2, tmp_path)
        assert codes == [0, 0]
        restarted = json.loads((tmp_path / "phase2-rank0.json").read_text())
        assert "error" not in restarted
        await receiver.wait_for_version(KILL_AT + 1, timeout=30)
        async with receiver.reading():
            assert state_digest(rollout.state_dict()) == restarted["expected"][str(KILL_AT + 1)]
        assert receiver.reconnects >= 1
