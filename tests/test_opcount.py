"""The op counter behind ``benchmarks.device_ops``: every thread a sync uses is counted, once,
views are not, and host syncs are told apart; and the benchmark measures a small layout."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from benchmarks import device_ops
from benchmarks.opcount import OpCounter


def three_kernels() -> None:
    x = torch.ones(8)
    y = x + 1  # add
    y.view(2, 4)  # a view: no kernel
    (y * 2).sum()  # mul, sum


def test_every_thread_is_counted_once_and_views_are_not() -> None:
    pool = ThreadPoolExecutor(1)
    pool.submit(lambda: None).result()  # a worker started before the counter opens
    with OpCounter() as counter:
        three_kernels()
        pool.submit(three_kernels).result()
        thread = threading.Thread(target=three_kernels)
        thread.start()
        thread.join()

        async def in_a_task() -> None:
            await asyncio.to_thread(three_kernels)

        asyncio.run(in_a_task())
    pool.shutdown()
    ops, syncs = counter.take()
    for name in ("aten::add", "aten::mul", "aten::sum"):
        assert ops[name] == 4, (name, ops)
    assert not any("view" in name for name in ops)
    assert not syncs
    three_kernels()  # closed: nothing counted, on any thread
    assert counter.total == 0


def test_host_syncs_are_counted_apart() -> None:
    with OpCounter() as counter:
        x = torch.arange(10)
        int(x.sum())
        torch.nonzero(x > 3)
        x.to("cpu", copy=True)
    assert counter.syncs["aten::_local_scalar_dense"] == 1
    assert counter.syncs["aten::nonzero"] == 1
    assert counter.syncs["aten::_to_copy"] == 1


def test_the_benchmark_counts_both_sides_of_a_small_layout() -> None:
    row = asyncio.run(device_ops.measure("t48", versions=1))
    assert row["tensors"] == 48 and row["parts"] >= 1 and row["tensors_changed"] > 0
    assert row["sender_ops"] > 48 and row["receiver_ops"] > 48  # the device path launches at least one op a changed tensor
    assert row["sender_syncs"] >= 1 and row["receiver_syncs"] >= 1
    assert "t48" in device_ops.report([row])
