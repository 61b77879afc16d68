"""``Sender.close()`` stops everything the sender started (issue 38, *Shutdown*).

A real Sender serves a real Receiver over real sockets for a few versions of a real model
stepped by its optimizer, then closes: no thread the sender started (its builder's compare
and encoder threads; with CURVE, its socket's ZAP handler) is alive and no task it created
(pumps, heartbeat, the patch being served, the metrics endpoint's) is pending. The receiver runs on its own event loop, in its own thread, so the
sender's loop holds only the sender's tasks; each loop's default executor has threads named
for it (a loop's executor is the loop's, shut down by ``asyncio.run``). Not the sender's:
the process-wide codec pool (``protocol/codec/parallel.py``, ``weightsync-codec``), shared
by every sender and receiver of the process, and pyzmq's garbage collector thread (it
frees the zero-copy frames sent, one for the process, started by the first such send).
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
import torch
from zmq.utils.garbage import GarbageCollectorThread

from examples.tiny_model import build, train_step
from protocol.errors import WeightSyncError
from protocol.net.security import CurveClient, CurveServer, KeyPair
from receiver import Receiver
from sender import Sender
from sender.diff.compare_host import HostCompare
from sender.version.collector import Collector

T = TypeVar("T")
PATCH_HOST = {"type": "patch", "patch": {"codec": "host", "part_bytes": 4096}}
CASES: dict[str, dict[str, Any]] = {
    "patch-host": PATCH_HOST,
    "patch-device": {"type": "patch", "patch": {"codec": "device", "part_bytes": 4096}},  # the device codec, on CPU tensors
    "bucket": {"type": "bucket"},
    "patch-host-curve": PATCH_HOST,  # encrypted: the socket's ZAP handler thread too
}
# The threads of its own each runs (by name): the host codec's tensors are encoded on encoder
# threads beside the compare; the device codec codes a part at once, when it is cut.
OWN_THREADS = {
    "patch-host": ["weightsync-compare", "weightsync-encode"],
    "patch-device": ["weightsync-compare"],
    "bucket": [],
    "patch-host-curve": ["weightsync-compare", "weightsync-encode", "weightsync-zap"],
}
NOT_THE_SENDERS = ("rx-", "weightsync-codec")  # the receiver's thread and loop executor; the shared codec pool
SENDER_LOOP = "tx-loop"  # the sender's loop's default executor (asyncio.to_thread)
JOIN_S = 10.0  # the most a thread may take to end once close returned (it ends at once when all is well)


class ReceiverThread:
    """A Receiver of a bf16 model on its own event loop, in its own thread."""

    def __init__(self, config: dict[str, Any], curve: CurveClient | None = None) -> None:
        self.config, self.curve = config, curve
        self.loop = asyncio.new_event_loop()
        self.loop.set_default_executor(ThreadPoolExecutor(thread_name_prefix="rx-loop"))
        self.thread = threading.Thread(target=self.loop.run_forever, name="rx-thread", daemon=True)
        self.thread.start()
        self.receiver: Receiver | None = None

    async def call(self, make: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``make()`` run on the receiver's loop, awaited from the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), self.loop))

    async def join(self, endpoint: str) -> None:
        async def start() -> None:
            self.receiver = Receiver(build(seed=3).to(torch.bfloat16), endpoint, self.config, curve=self.curve)
            await self.receiver.start(timeout=30)

        await self.call(start)

    async def at(self, version: int) -> None:
        assert self.receiver is not None
        receiver = self.receiver
        await self.call(lambda: receiver.wait_for_version(version, timeout=30))

    async def close(self) -> None:
        if self.receiver is not None:
            receiver = self.receiver
            await self.call(receiver.close)
        await self.call(self.loop.shutdown_default_executor)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(JOIN_S)
        self.loop.close()


def alive(before: set[threading.Thread], excluded: tuple[str, ...]) -> list[threading.Thread]:
    """Threads started since ``before``, but those whose names start with ``excluded`` and pyzmq's."""
    new = [t for t in threading.enumerate() if t not in before and not isinstance(t, GarbageCollectorThread)]
    return [t for t in new if not t.name.startswith(excluded)]


def joined(threads: list[threading.Thread]) -> list[str]:
    """The names of ``threads`` still alive after a bounded join of each."""
    for t in threads:
        t.join(JOIN_S)
    return [t.name for t in threads if t.is_alive()]


def run_in_fresh_loop(main: Callable[[], Awaitable[T]]) -> T:
    """``main()`` in a new event loop whose default executor's threads are named ``tx-loop``;
    ``asyncio.run`` shuts that executor down at the end."""

    async def wrapped() -> T:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(thread_name_prefix=SENDER_LOOP))
        return await main()

    return asyncio.run(wrapped())


@pytest.fixture(autouse=True)
def compare_on_its_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The patch builder's compare on its own thread (a small CPU state would be compared on
    the event loop's), and its changes on the encoder threads: every thread it owns runs."""
    monkeypatch.setattr(Collector, "_inline", lambda self, tensors: False)
    yield


@pytest.mark.parametrize("case", list(CASES))
def test_close_leaves_no_thread_or_task_of_the_sender(case: str) -> None:
    config = CASES[case]
    before = set(threading.enumerate())
    tx_keys, rx_keys = KeyPair.generate(), KeyPair.generate()
    curve = case.endswith("-curve")

    async def main() -> dict[str, Any]:
        rx = ReceiverThread(config, CurveClient(rx_keys, tx_keys.public) if curve else None)
        model = build(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        server = CurveServer(tx_keys, frozenset({rx_keys.public})) if curve else None
        sender = Sender("tcp://127.0.0.1:0", config, metrics_address="127.0.0.1:0", curve=server)
        try:
            await sender.start(model, version=0)
            await rx.join(sender.endpoint)
            for version in (1, 2, 3):
                train_step(model, optimizer, generator)
                await sender.sync(model, version)
                await rx.at(version)
            running = [t.name for t in alive(before, (*NOT_THE_SENDERS, SENDER_LOOP))]
        finally:
            await sender.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        left = joined(alive(before, (*NOT_THE_SENDERS, SENDER_LOOP)))
        await rx.close()
        return {"running": running, "left": left, "tasks": tasks}

    out = run_in_fresh_loop(main)
    assert sorted({re.sub(r"_\d+$", "", name) for name in out["running"]}) == OWN_THREADS[case], out["running"]
    assert out["tasks"] == []  # the pumps, the heartbeat, the patch being served, the metrics endpoint's
    assert out["left"] == []
    assert joined(alive(before, NOT_THE_SENDERS)) == []  # the sender loop's executor, shut down with its loop


def test_close_twice_or_during_a_sync_is_defined(monkeypatch: pytest.MonkeyPatch) -> None:
    """``close`` while a sync compares waits for it: the sync returns its version, which
    moved; a sync called once close began raises; a second close waits for the first."""
    entered, gate = threading.Event(), threading.Event()
    collect = HostCompare.collect

    def held(self: HostCompare, *args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(JOIN_S)
        return collect(self, *args, **kwargs)

    config = CASES["patch-host"]
    before = set(threading.enumerate())

    async def main() -> None:
        rx = ReceiverThread(config)
        model = build(seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(0)
        sender = Sender("tcp://127.0.0.1:0", config)
        await sender.start(model, version=0)
        await rx.join(sender.endpoint)
        train_step(model, optimizer, generator)
        await sender.sync(model, 1)
        await rx.at(1)
        monkeypatch.setattr(HostCompare, "collect", held)
        train_step(model, optimizer, generator)
        syncing = asyncio.ensure_future(sender.sync(model, 2))
        await asyncio.to_thread(entered.wait, JOIN_S)  # v2's compare runs on its thread
        closing, again = asyncio.ensure_future(sender.close()), asyncio.ensure_future(sender.close())
        await asyncio.sleep(0)  # close has begun (and waits for the sync's version lock)
        with pytest.raises(WeightSyncError, match="closed"):
            await sender.sync(model, 3)
        assert not syncing.done() and not closing.done() and not again.done()  # both wait for the compare
        gate.set()
        stats = await syncing
        await closing
        await again
        assert stats.version == 2 and sender.version == 2
        await sender.close()  # once closed: returns at once
        with pytest.raises(WeightSyncError, match="closed"):
            await sender.start(model)
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        await rx.close()

    run_in_fresh_loop(main)
    assert joined(alive(before, NOT_THE_SENDERS)) == []
