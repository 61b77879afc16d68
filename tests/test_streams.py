"""Stream ordering on the sender (sender/streams.py), said on CPU with a fake CUDA where needed.

- The compare reads the model after the work queued on the streams current when ``sync()``
  was called (a trainer may step on a side stream): ``Sender.sync`` records a ``Mark`` on its
  caller's thread, and the compare's thread waits for it before its first read.
- Each device's ``CopyStream`` has two streams: ``fetch`` for the snapshot's copies to the
  device and its write-backs, ``out`` for what leaves for the host (staged changes, a part's
  one copy). A copy waits for the event of the work that produced its source, never for a
  whole stream.

On CPU the events are None and nothing waits: the same code runs. The CUDA tests (a step on a
side stream is what the patch carries; the copies on their streams) skip without a GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from examples.tiny_model import build
from protocol.config import load_config
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from receiver import Receiver
from sender import Sender, streams
from sender.diff.compare_host import HostCompare
from sender.diff.snapshot import Snapshot
from sender.plan import SyncPlan
from sender.streams import CopyStream, Mark
from sender.version import collector
from sender.version.patch import PatchBuilder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU = torch.device("cuda", 0)


# -- the compare waits for the stream current at sync() ------------------------------------------
def test_a_mark_on_cpu_holds_no_event_and_waits_for_nothing() -> None:
    mark = Mark.now([torch.zeros(2), torch.ones(3)])
    assert mark.events == ((torch.device("cpu"), None),)
    mark.wait()


class Seen:
    """What ``streams.record`` and ``streams.wait`` were asked, on which thread, and when the
    compare first read the model: the order of events across the sync's threads."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, Any]] = []

    def record(self, device: torch.device) -> object:
        token = object()
        self.log.append(("record", threading.current_thread().name, token))
        return token

    def wait(self, device: torch.device, event: Any) -> None:
        self.log.append(("wait", threading.current_thread().name, event))

    def read(self) -> None:
        self.log.append(("read", threading.current_thread().name, None))


def watch(monkeypatch: pytest.MonkeyPatch, compare: Any) -> Seen:
    seen = Seen()
    monkeypatch.setattr(streams, "record", seen.record)
    monkeypatch.setattr(streams, "wait", seen.wait)
    monkeypatch.setattr(collector, "INLINE_READ_BYTES", -1)  # the compare on its own thread, as on CUDA
    real = compare.collect

    def collect(*args: Any, **kwargs: Any) -> Any:
        seen.read()
        return real(*args, **kwargs)

    monkeypatch.setattr(compare, "collect", collect)
    return seen


async def test_sync_marks_the_callers_streams_and_the_compare_thread_waits_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    config = {"weight_syncer": {"type": "patch", "patch": {"codec": "host"}}}
    model = build(seed=0)
    async with Sender("tcp://127.0.0.1:0", config) as sender:
        await sender.start(model, version=0)
        async with Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, config) as receiver:
            await receiver.start()
            source = sender._trainer
            assert source is not None and source.builder is not None
            builder = source.builder
            assert isinstance(builder, PatchBuilder)
            seen = watch(monkeypatch, builder.compare)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            caller = threading.current_thread().name
            await sender.sync(model, 1)
            await sender.flush()
            await receiver.wait_for_version(1, timeout=30)
    log = seen.log
    records = [entry for entry in log if entry[0] == "record"]
    assert records[0][1] == caller  # recorded by sync() on its caller's thread: one device, one event
    waits = [i for i, entry in enumerate(log) if entry[0] == "wait" and entry[2] is records[0][2]]
    reads = [i for i, entry in enumerate(log) if entry[0] == "read"]
    assert len(waits) == 1 and len(reads) == 1 and waits[0] < reads[0]
    assert log[waits[0]][1] == log[reads[0]][1] != caller  # on the compare's thread, before its first read
    assert sender.stats[1].changed_elements > 0


async def test_a_builder_marks_when_called_and_its_compare_thread_waits_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PatchBuilder.message`` (no ``Sender``): its own mark, taken when it is called."""
    state = {"w": torch.randn(1000), "b": torch.randn(10)}
    config = load_config({"type": "patch", "patch": {"codec": "device"}})
    metadata = ModelMetadata.of({k: t.to(torch.bfloat16) for k, t in state.items()})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    await builder.hold(state)
    seen = watch(monkeypatch, builder.compare)
    state["w"] += 1.0
    _, stats = await builder.message(state, 1, 0)
    kinds = [(kind, thread == threading.current_thread().name) for kind, thread, _ in seen.log]
    assert kinds == [("record", True), ("wait", False), ("read", False)]
    assert stats.changed_elements > 0
    await builder.close()


async def test_on_cpu_an_inline_compare_marks_and_waits_for_nothing() -> None:
    """A small CPU state compared on the event loop's thread: the same marks, no events, one change."""
    state = {"w": torch.randn(64)}
    config = load_config({"type": "patch"})
    builder = PatchBuilder(SyncPlan(resolve_state(state), ModelMetadata.of(state), config.init_sync), config.patch)
    await builder.hold(state)
    state["w"][3] += 1.0
    _, stats = await asyncio.wait_for(builder.message(state, 1, 0), 30)
    assert stats.changed_elements == 1
    await builder.close()


# -- two streams a device: fetches and write-backs, and what leaves for the host -----------------
def test_on_cpu_every_copy_is_plain_and_no_stream_is_made() -> None:
    copies = CopyStream(torch.device("cpu"))
    assert copies.fetch is None and copies.out is None
    src = torch.arange(6.0)
    assert copies.to_host(src) == (src, None)
    dst = torch.empty(6)
    host, event = copies.to_host(src, dst)
    assert host is dst and event is None and torch.equal(dst, src)
    hosts, event = copies.to_host_all([src])
    assert hosts[0] is src and event is None
    back = torch.zeros(6)
    assert copies.write_back(src, back) is None and torch.equal(back, src)


class FakeStream:
    """A stream that records what it is asked to wait for."""

    def __init__(self, name: str, log: list[tuple[str, ...]]) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", self.name, event.name))

    def wait_stream(self, stream: FakeStream) -> None:
        raise AssertionError("a copy waits for an event, never a whole stream")


class FakeEvent:
    """An event that records the stream it is recorded on."""

    name = "unrecorded"

    def __init__(self, log: list[tuple[str, ...]]) -> None:
        self.log = log

    def record(self, stream: FakeStream) -> None:
        self.name = f"event@{stream.name}"
        self.log.append(("record", stream.name))


class FakeCuda:
    """``torch.cuda``'s streams, events and stream context, recorded: what ran where."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.made = 0
        self.current = self.on = FakeStream("current", self.log)

    def new_stream(self, device: Any = None) -> FakeStream:
        self.made += 1
        return FakeStream(f"stream{self.made}", self.log)

    def new_event(self) -> FakeEvent:
        return FakeEvent(self.log)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.on

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before, self.on = self.on, stream
        try:
            yield
        finally:
            self.on = before


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()
    for name, value in (("Stream", fake.new_stream), ("Event", fake.new_event), ("current_stream", fake.current_stream),
                        ("stream", fake.stream)):
        monkeypatch.setattr(torch.cuda, name, value)
    return fake


class OnGpu(torch.Tensor):
    """A CPU tensor that says it is on cuda:0 and records whose stream keeps it alive."""

    kept: list[str]

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return GPU

    def record_stream(self, stream: Any) -> None:
        OnGpu.kept.append(stream.name)


def on_gpu(t: torch.Tensor) -> torch.Tensor:
    OnGpu.kept = []
    return t.as_subclass(OnGpu)


def test_a_device_has_one_stream_for_fetches_and_write_backs_and_another_for_what_leaves(fake_cuda: FakeCuda) -> None:
    snapshot = Snapshot("cpu")
    copies = snapshot.stream(GPU)
    assert snapshot.stream(GPU) is copies  # one a device, made once
    assert copies.fetch is not None and copies.out is not None and copies.fetch is not copies.out
    fetch, out = copies.fetch.name, copies.out.name

    # a part's copy (the device encoder's) and staged changes: on ``out``, after the given event only
    produced = fake_cuda.new_event()
    produced.record(fake_cuda.current)
    fake_cuda.log.clear()
    src = on_gpu(torch.arange(4.0))
    host, event = copies.to_host(src, after=produced)
    assert torch.equal(host, torch.arange(4.0)) and event is not None and event.name == f"event@{out}"
    assert fake_cuda.log == [("wait", out, "event@current"), ("record", out)] and OnGpu.kept == [out]

    # no event given: one recorded now on the current stream (where the source was just made)
    fake_cuda.log.clear()
    hosts, event = copies.to_host_all([on_gpu(torch.ones(3)), on_gpu(torch.zeros(2))])
    assert fake_cuda.log == [("record", "current"), ("wait", out, "event@current"), ("record", out)]
    assert [h.shape for h in hosts] == [torch.Size([3]), torch.Size([2])]
    fake_cuda.log.clear()
    assert copies.to_host_all([]) == ([], None) and not fake_cuda.log  # a run without changes: nothing to copy

    # the snapshot's write-back: on ``fetch``, after the work that moved it (recorded at ``store``)
    fake_cuda.log.clear()
    stored = torch.zeros(4)
    snapshot.store(on_gpu(torch.full((4,), 7.0)), stored)
    assert fake_cuda.log == [("record", "current"), ("wait", fetch, "event@current"), ("record", fetch)]
    assert torch.equal(stored, torch.full((4,), 7.0)) and OnGpu.kept == [fetch]
    assert snapshot._writebacks and snapshot._writebacks[0][0].name == f"event@{fetch}"


def test_the_host_compare_stages_changes_on_the_out_stream(fake_cuda: FakeCuda) -> None:
    """Changes staged for the host codec: one event after the compare, every copy on ``out``."""
    state = {"w": torch.randn(100)}
    config = load_config({"type": "patch", "patch": {"codec": "host"}})
    plan = SyncPlan(resolve_state(state), ModelMetadata.of(state), config.init_sync)
    snapshot = Snapshot("cpu")
    compare = HostCompare(plan, config.patch.options(), snapshot, {}, stage=True)
    from sender.diff.changes import Changes

    flat, new = on_gpu(torch.arange(3)), on_gpu(torch.ones(3))
    staged = compare._staged(Changes(0, (100,), 3, flat, new, on_gpu(torch.zeros(3)), None, []))
    out = snapshot.stream(GPU).out
    assert out is not None
    assert fake_cuda.log[0] == ("record", "current")  # once, right after the compare's work
    assert fake_cuda.log[1:] == [("wait", out.name, "event@current"), ("record", out.name)] * 3
    assert OnGpu.kept == [out.name] * 3 and len(staged.events) == 3 and staged.flat is not None
    assert torch.equal(staged.flat, torch.arange(3))


def test_a_mark_waits_on_the_current_stream_for_what_was_current_when_it_was_taken(fake_cuda: FakeCuda) -> None:
    side = fake_cuda.new_stream()
    with torch.cuda.stream(side):
        mark = Mark.now([on_gpu(torch.zeros(1))])
    assert fake_cuda.log == [("record", side.name)]
    mark.wait()  # on another thread's current stream, here the fake's
    assert fake_cuda.log[-1] == ("wait", "current", f"event@{side.name}")


# -- on a GPU ---------------------------------------------------------------------------------------
@cuda
@pytest.mark.parametrize("codec", ["host", "device"])
async def test_cuda_a_step_on_a_side_stream_is_what_the_patch_carries(codec: str) -> None:
    """The trainer's step, queued on a side stream behind a long sleep, is not done when
    ``sync()`` is called: the patch must carry it whole, and the receiver hold it."""
    config = {"weight_syncer": {"type": "patch", "patch": {"codec": codec}}}
    model = build(seed=0).cuda()
    async with Sender("tcp://127.0.0.1:0", config) as sender:
        await sender.start(model, version=0)
        async with Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, config) as receiver:
            await receiver.start()
            torch.cuda.synchronize()
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU clock: the step lands long after sync() starts
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.25)
                await sender.sync(model, 1)
            await sender.flush()
            await receiver.wait_for_version(1, timeout=60)
            torch.cuda.synchronize()
            held = receiver.model.state_dict()  # type: ignore[union-attr]
            for key, t in model.state_dict().items():
                assert torch.equal(held[key].cpu(), t.to(held[key].dtype).cpu()), key


@cuda
def test_cuda_a_part_copy_does_not_queue_behind_a_write_back() -> None:
    """A long write-back on ``fetch`` and a part's copy on ``out``: the copy's event completes
    while the write-back is still running."""
    copies = CopyStream(GPU)
    big = torch.ones(1 << 28, device=GPU, dtype=torch.uint8)
    stored = torch.empty(big.shape, dtype=big.dtype, pin_memory=True)
    with torch.cuda.stream(copies.fetch):
        torch.cuda._sleep(500_000_000)  # the fetch stream busy, as behind a large write-back
    back = copies.write_back(big, stored)
    part = torch.arange(1024, device=GPU)
    host, event = copies.to_host(part)
    assert event is not None and back is not None
    event.synchronize()
    assert not back.query()  # the write-back still waits behind the sleep
    assert torch.equal(host, part.cpu())
    back.synchronize()
    assert bool(stored.all())


@cuda
def test_cuda_fetch_then_write_back_on_one_stream_round_trips() -> None:
    copies = CopyStream(GPU)
    stored = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    working, event = copies.to_device(stored)
    working = copies.use(working, event)
    working += 1
    back = copies.write_back(working, stored, after=streams.record(GPU))
    assert back is not None
    back.synchronize()
    assert torch.equal(stored, torch.arange(1 << 20, dtype=torch.float32) + 1)
