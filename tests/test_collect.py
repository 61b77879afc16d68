"""PatchBuilder's collect: the lean per-tensor path decides and captures what the plain one did."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from daemon_helpers import wait_until

from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.framing import Encoding
from protocol.wire.metadata import ModelMetadata
from sender.diff import fastdiff
from sender.plan import SyncPlan
from sender.stats import SyncStats
from sender.version.backlog import Backlog
from sender.version.patch import PatchBuilder


def builder_for(state: dict[str, torch.Tensor], receiver: torch.dtype, group_numel: int = 0, **patch: object) -> PatchBuilder:
    """A builder of ``state``; ``group_numel`` 0 (every tensor on its own) unless a test is about groups."""
    config = load_config({"type": "patch", "patch": {"group_numel": group_numel, **patch}})
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
    compare = builder.compare
    rule = compare._dense_rule(compare._keys["w"], cur.numel())
    diffs = fastdiff.sampled_differences(cur, snap, max(1, cur.numel() // fastdiff.SAMPLE))
    taken = []

    def sample() -> torch.Tensor:
        taken.append(1)
        return diffs

    for total in range(0, 10_001, 7):
        taken.clear()
        assert rule(total, sample) == builder.options.goes_dense(total, 10_000, 2, diffs)
        open_band = compare._keys["w"].candidate * 10_000 < total <= compare._keys["w"].surely * 10_000
        assert bool(taken) == open_band  # the sample only where the counts leave it open


def test_collect_captures_and_moves_the_snapshot_exactly() -> None:
    g = torch.Generator().manual_seed(9)
    shapes = {"a": (300, 70), "b": (64,), "c": (5, 5), "d": (2000,)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    builder = builder_for(state, torch.bfloat16)
    before = {k: t.clone() for k, t in builder.snapshot.tensors.items()}
    state["a"].view(-1)[::50] += 0.1  # sparse
    state["b"] += 1.0  # every element: surely whole
    state["d"].view(-1)[::4] += 0.1  # a quarter: a dense candidate
    changes = builder.compare.collect(state, SyncStats(1, "patch"), lambda c: c)
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


@pytest.mark.parametrize("whole", [True, False], ids=["one-compare", "one-by-one"])
def test_small_tensors_are_captured_as_one_run_of_their_elements(whole: bool) -> None:
    """A group's changes are its members' changes end to end, at their offsets in the run;
    members without changes add none, the snapshot moves exactly, and a large key stays alone.
    The same whether the run is compared at once (plain CPU tensors of one dtype) or its
    members one by one (here: one of them bf16 in the trainer)."""
    g = torch.Generator().manual_seed(11)
    shapes = {"big": (300, 70), "n1": (64,), "n2": (8, 8), "n3": (100,), "n4": (3, 7)}
    state = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    if not whole:
        state["n2"] = state["n2"].to(torch.bfloat16)
    builder = builder_for(state, torch.bfloat16, group_numel=1000)
    group = builder.compare._groups["n1"]
    assert group.keys == ("n1", "n2", "n3", "n4") and "big" not in builder.compare._groups
    assert group.offsets == (0, 64, 128, 228, 249)
    assert builder.compare._compares_whole(group, state) is whole
    before = {k: t.clone() for k, t in builder.snapshot.tensors.items()}
    state["big"].view(-1)[::50] += 0.1
    state["n1"].view(-1)[::3] += 0.1
    state["n1"].view(-1)[1::3] += 0.1
    state["n2"] += 0.5
    state["n4"] += 0.5
    stats = SyncStats(1, "patch")
    changes = builder.compare.collect(state, stats, lambda c: c)
    assert sorted(c.group for c in changes) == [(), group.ordinals]
    run = next(c for c in changes if c.group)
    assert run.key == group.ordinals[0] and run.shape == (249,)
    assert stats.tensors_changed == 4  # big, n1, n2, n4
    new = torch.cat([state[k].to(torch.bfloat16).reshape(-1) for k in group.keys])
    old = torch.cat([before[k].reshape(-1) for k in group.keys])
    flat = torch.nonzero(new.view(torch.int16) != old.view(torch.int16)).squeeze(1)
    assert run.nnz == flat.numel() and torch.equal(run.flat, flat)
    assert torch.equal(run.new.view(torch.int16), new[flat].view(torch.int16))
    assert torch.equal(run.old.view(torch.int16), old[flat].view(torch.int16))
    for k in group.keys:
        assert torch.equal(builder.snapshot.tensors[k].view(torch.int16), state[k].to(torch.bfloat16).view(torch.int16))
    # more than a dense candidate's share changed: the whole new run is kept beside it
    assert run.nnz > builder.options.dense_candidate(2) * 249
    assert run.dense is not None and torch.equal(run.dense.view(torch.int16), new.view(torch.int16))


def test_groups_are_by_receiver_dtype_and_bounded() -> None:
    """Members share their receiver dtype; a group holds at most GROUP_SPAN x group_numel
    elements; a small key with no partner travels alone."""
    from sender.diff.changes import GROUP_SPAN, plan_groups

    state = {f"b{i}": torch.zeros(100) for i in range(10)} | {"h": torch.zeros(50, dtype=torch.float16)}
    builder = builder_for(state, torch.bfloat16, group_numel=100)
    metadata = ModelMetadata.of({k: (t if t.dtype == torch.float16 else t.to(torch.bfloat16)) for k, t in state.items()})
    plan = SyncPlan(resolve_state(state), metadata, builder.plan.init_sync)
    groups = plan_groups(plan, 100)
    assert "h" not in groups  # the only float16 key
    distinct = list(dict.fromkeys(groups.values()))
    assert [g.keys for g in distinct] == [tuple(f"b{i}" for i in range(j, min(j + GROUP_SPAN, 10))) for j in range(0, 10, GROUP_SPAN)]
    assert all(g.numel <= GROUP_SPAN * 100 for g in distinct)
    assert plan_groups(plan, 0) == {} and plan_groups(plan, 99) == {}


async def test_a_compare_on_a_worker_thread_hands_each_tensor_to_the_encoder_as_it_goes() -> None:
    """Off the event loop the changes go to the encoder thread as collected (nothing raw is
    kept for later); on it they are encoded with their part. Either way the same message,
    and an encoder's failure surfaces where the version is encoded."""
    from protocol.wire.framing import decode_message, encode_message

    g = torch.Generator().manual_seed(3)
    state = {f"w{i}": torch.randn(300, 70, generator=g) for i in range(4)} | {f"b{i}": torch.randn(70, generator=g) for i in range(6)}
    messages = {}
    for inline in (True, False):
        builder = builder_for(state, torch.bfloat16, group_numel=1000)
        builder.collector._inline = lambda tensors, inline=inline: inline  # type: ignore[method-assign]
        moved = {k: t + 0.01 * (torch.rand(t.shape, generator=torch.Generator().manual_seed(7)) < 0.1) for k, t in state.items()}
        captured, stats = await builder.collect(moved, 1)
        assert len(captured) == 5 and stats.tensors_changed == 10  # 4 matrices, one group of 6
        assert all((c.encoded is None) == inline and (c.changes is not None) == inline for c in captured)
        msg = await builder.encode(captured, 1, 0, stats)
        messages[inline] = decode_message(encode_message(msg))
    assert [t.to_wire()[:4] for t in messages[True].tensors] == [t.to_wire()[:4] for t in messages[False].tensors]
    assert [bytes(f) for f in messages[True].frames] == [bytes(f) for f in messages[False].frames]

    builder = builder_for(state, torch.bfloat16, group_numel=1000)
    builder.collector._inline = lambda tensors: False  # type: ignore[method-assign]

    def broken(changes: object) -> object:
        raise RuntimeError("encoder down")

    builder.encoding._encode = broken  # type: ignore[assignment, method-assign]
    captured, stats = await builder.collect({k: t + 1 for k, t in state.items()}, 1)
    with pytest.raises(RuntimeError, match="encoder down"):
        await builder.encode(captured, 1, 0, stats)


@pytest.mark.parametrize("limit", [30_000, 0])
async def test_the_compare_waits_while_too_much_waits_for_the_encoder(limit: int) -> None:
    """``patch.encode_backlog_bytes``: with the encoder held on the first tensor, the compare
    goes on only while the changes waiting ahead of its last tensor fit the limit (each
    tensor here captures ~25 kB), and finishes once the encoder catches up; 0: it never
    waits. The message is the same either way."""
    import threading

    from protocol.wire.framing import decode_message, encode_message

    g = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn(300, 70, generator=g) for i in range(8)}
    moved = {k: t + 0.01 * (torch.rand(t.shape, generator=g) < 0.1) for k, t in state.items()}
    builder = builder_for(state, torch.bfloat16, encode_backlog_bytes=limit)
    builder.collector._inline = lambda tensors: False  # type: ignore[method-assign]
    gate, compared = threading.Event(), []
    encode, compare = builder.encoding._encode, builder.compare._compare

    def held(changes: Any) -> Any:
        gate.wait(30)
        return encode(changes)

    def counted(*args: Any) -> Any:
        compared.append(args[0])
        return compare(*args)

    builder.encoding._encode, builder.compare._compare = held, counted  # type: ignore[assignment, method-assign]
    collect = asyncio.ensure_future(builder.collect(moved, 1))
    if limit:
        # w0 and w1 are handed over at once (0 and ~25 kB ahead); w2 has ~50 kB ahead: it waits
        await wait_until(lambda: len(compared) == 3)
        await asyncio.sleep(0.2)
        assert len(compared) == 3 and not collect.done()
        gate.set()
    captured, stats = await asyncio.wait_for(collect, 30)
    assert len(compared) == 8 and (stats.backlog_wait_seconds > 0) == bool(limit)
    gate.set()
    msg = decode_message(encode_message(await builder.encode(captured, 1, 0, stats)))

    plain = builder_for(state, torch.bfloat16)
    plain_captured, plain_stats = await plain.collect(moved, 1)
    expected = decode_message(encode_message(await plain.encode(plain_captured, 1, 0, plain_stats)))
    assert [bytes(f) for f in msg.frames] == [bytes(f) for f in expected.frames]


async def test_whole_copies_the_sender_keeps_anyway_do_not_hold_the_compare_back() -> None:
    """fp32 receivers: every tensor goes whole, as a copy the sender reuses from version to
    version, so waiting for the encoder would save no memory; with the encoder held and a
    1-byte limit the compare still runs to the end without waiting."""
    import threading

    g = torch.Generator().manual_seed(6)
    state = {f"w{i}": torch.randn(300, 70, generator=g) for i in range(8)}
    moved = {k: t + 0.01 for k, t in state.items()}
    builder = builder_for(state, torch.float32, encode_backlog_bytes=1)
    builder.collector._inline = lambda tensors: False  # type: ignore[method-assign]
    gate, encode = threading.Event(), builder.encoding._encode

    def held(changes: Any) -> Any:
        gate.wait(30)
        return encode(changes)

    builder.encoding._encode = held  # type: ignore[method-assign]
    collect = asyncio.ensure_future(builder.collect(moved, 1))
    try:
        captured, stats = await asyncio.wait_for(asyncio.shield(collect), 10)
    finally:
        gate.set()
    await collect
    assert len(captured) == 8 and stats.backlog_wait_seconds == 0
    msg = await builder.encode(captured, 1, 0, stats)
    assert [t.encoding for t in msg.tensors] == [Encoding.DENSE] * 8


def test_what_a_capture_adds_to_memory_while_it_waits_for_the_encoder() -> None:
    """The backlog counts a capture's changes and any fresh whole copy (a group's run, a CUDA
    clone), but not a whole copy the sender keeps from version to version."""
    from sender.diff.changes import Changes

    flat, values, whole = torch.arange(10, dtype=torch.int32), torch.zeros(10, dtype=torch.bfloat16), torch.zeros(100)
    changes = 10 * 4 + 2 * 10 * 2
    assert Changes(0, (100,), 10, flat, values, values, None, []).pending_nbytes() == changes
    assert Changes(0, (100,), 10, flat, values, values, whole, []).pending_nbytes() == changes + 400
    assert Changes(0, (100,), 10, flat, values, values, whole, [], kept=True).pending_nbytes() == changes
    assert Changes(0, (100,), 100, None, None, None, whole, []).pending_nbytes() == 400
    assert Changes(0, (100,), 100, None, None, None, whole, [], kept=True).pending_nbytes() == 0


def test_encode_backlog_bytes_is_checked() -> None:
    from protocol.errors import ConfigError

    for bad in (-1, 1.5, "4MiB", True):
        with pytest.raises(ConfigError, match="encode_backlog_bytes"):
            load_config({"type": "patch", "patch": {"encode_backlog_bytes": bad}})
    state = {"w": torch.randn(4, 4)}
    assert builder_for(state, torch.float32).collector.backlog_limit == 4 << 20  # the floor, for a small model
    assert builder_for(state, torch.float32, encode_backlog_bytes=0).collector.backlog_limit == 0
    assert builder_for(state, torch.float32, encode_backlog_bytes=12345).collector.backlog_limit == 12345


async def test_several_encoder_threads_keep_each_tensor_in_its_place() -> None:
    """``patch.encode_threads`` 3: the first tensor's encoding is held until the others are
    done, so they finish out of order; the message is byte for byte the one-thread one."""
    import threading

    from protocol.wire.framing import decode_message, encode_message

    g = torch.Generator().manual_seed(8)
    state = {f"w{i}": torch.randn(300, 70, generator=g) for i in range(6)}
    moved = {k: t + 0.01 * (torch.rand(t.shape, generator=g) < 0.1) for k, t in state.items()}
    builder = builder_for(state, torch.bfloat16, encode_threads=3, encode_backlog_bytes=0)
    assert builder.encode_threads == 3
    builder.collector._inline = lambda tensors: False  # type: ignore[method-assign]
    gate, done = threading.Event(), []
    encode = builder.encoding._encode

    def first_last(changes: Any) -> Any:
        if changes.key == 0:
            assert gate.wait(30)
        out = encode(changes)
        done.append(changes.key)
        if len(done) == 2:  # two others are done while the first is held
            gate.set()
        return out

    builder.encoding._encode = first_last  # type: ignore[method-assign]
    captured, stats = await builder.collect(moved, 1)
    msg = decode_message(encode_message(await builder.encode(captured, 1, 0, stats)))
    assert done[0] != 0 and 0 in done  # the first finished after others

    plain = builder_for(state, torch.bfloat16, encode_threads=1)
    plain_captured, plain_stats = await plain.collect(moved, 1)
    expected = decode_message(encode_message(await plain.encode(plain_captured, 1, 0, plain_stats)))
    assert [t.key for t in msg.tensors] == [t.key for t in expected.tensors] == list(range(6))
    assert [bytes(f) for f in msg.frames] == [bytes(f) for f in expected.frames]


def test_encode_threads_is_checked_and_defaults_to_half_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.errors import ConfigError
    from sender.version import part_encoder as patch

    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ConfigError, match="encode_threads"):
            load_config({"type": "patch", "patch": {"encode_threads": bad}})
    for cores, threads in ((None, 1), (1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (16, 4), (128, 4)):
        monkeypatch.setattr(patch.os, "cpu_count", lambda c=cores: c)
        assert patch.encode_threads(None) == threads, cores
    assert patch.encode_threads(7) == 7


def test_a_backlog_bounds_what_it_holds_whatever_order_encodings_finish_in() -> None:
    """Several encoder threads: a later item may finish first. The wait still ends only once
    what was added before the last item, less what was released, fits the limit, so at most
    the limit plus the last item is held."""
    import threading
    from concurrent.futures import Future

    backlog = Backlog(10)
    a, b, c = Future[Any](), Future[Any](), Future[Any]()
    backlog.add(8, a)
    backlog.add(8, b)
    backlog.add(8, c)  # 16 ahead of c
    b.set_result(None)  # the middle one first: 8 ahead of c now
    assert backlog.wait() == 0.0
    d = Future[Any]()
    backlog.add(8, d)  # a and c, 16, ahead of d
    waiter = threading.Thread(target=backlog.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    d.set_result(None)  # the last one itself: a and c, still 16 held, counted as 8 ahead
    waiter.join(10)
    assert not waiter.is_alive()


def test_a_backlog_releases_what_the_encoder_is_done_with_however_it_ended() -> None:
    """The bytes ahead of the last item count until their encodings are done: a failed or
    cancelled one releases its bytes too, so a broken encoder never stalls the compare."""
    import threading
    from concurrent.futures import Future

    backlog = Backlog(10)
    first, second, third = Future[Any](), Future[Any](), Future[Any]()
    backlog.add(8, first)
    backlog.add(8, second)
    assert backlog.wait() == 0.0  # 8 bytes ahead of the second
    backlog.add(8, third)  # 16 ahead of it: over the limit
    waiter = threading.Thread(target=backlog.wait)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    first.set_exception(RuntimeError("encoder down"))
    waiter.join(10)
    assert not waiter.is_alive()
    unbounded = Backlog(0)
    unbounded.add(1 << 40, Future())
    unbounded.add(1, Future())
    assert unbounded.wait() == 0.0


async def test_a_builders_threads_end_when_it_is_closed() -> None:
    """The compare thread and the encoder threads belong to their builder, and ``close``
    stops them (after a compare under way); a collect after it is refused."""
    import threading

    from protocol.errors import WeightSyncError

    state = {"w": torch.randn(300, 70)}
    builder = builder_for(state, torch.bfloat16, encode_threads=2)
    builder.collector._inline = lambda tensors: False  # type: ignore[method-assign]
    before_threads = set(threading.enumerate())
    both = threading.Barrier(2, timeout=10)
    for f in [builder.encoding._pool.submit(both.wait) for _ in range(2)]:  # two threads, started
        f.result()
    captured, stats = await builder.collect({"w": state["w"] + 1}, 1)  # the compare on its thread
    await builder.encode(captured, 1, 0, stats)
    threads = [t for t in threading.enumerate() if t.name.startswith(("weightsync-encode", "weightsync-compare")) and t not in before_threads]
    assert sorted(t.name.rpartition("_")[0] for t in threads) == ["weightsync-compare", "weightsync-encode", "weightsync-encode"]
    await builder.close()
    await builder.close()  # again: nothing left to stop
    for thread in threads:
        thread.join(timeout=10)
        assert not thread.is_alive()
    with pytest.raises(WeightSyncError, match="closed"):
        await builder.collect(state, 2)
