"""Whole tensors to host memory (protocol/codec/tohost.py): what buckets and bootstraps send.

On CPU: exact casts of every dtype and shape, no frame sharing memory with a source that may
change (``copy``), and a bucket's tensors read once each. On CUDA (skipped here): one copy
to pinned memory a bucket, whatever its tensor count, with the same bytes as on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_device_codec import SyncCounter

from protocol.codec.tohost import ALIGN, to_host

CASES = [
    (torch.randn(3, 5), torch.bfloat16),
    (torch.randn(7), torch.float32),
    (torch.tensor(2.5), torch.float16),
    (torch.empty(0, 4), torch.bfloat16),
    (torch.arange(10, dtype=torch.int64), torch.int64),
    (torch.tensor([True, False, True]), torch.bool),
    (torch.randn(6, 4).t(), torch.bfloat16),  # not contiguous
    (torch.tensor([float("nan"), -0.0, float("inf"), 1e-40]), torch.bfloat16),
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("copy", [True, False])
def test_cpu_tensors_are_cast_exactly_and_copied_when_asked(copy: bool) -> None:
    tensors, dtypes = [t for t, _ in CASES], [d for _, d in CASES]
    hosts = to_host(tensors, dtypes, copy=copy)
    for t, dtype, host in zip(tensors, dtypes, hosts):
        assert host.device.type == "cpu" and host.dtype == dtype and host.shape == t.shape
        assert torch.equal(bits(host.contiguous()), bits(t.to(dtype).contiguous()))
        if t.numel():  # (empty tensors have no data to share)
            assert (host.data_ptr() == t.data_ptr()) == (t.dtype == dtype and not copy)


def test_a_device_given_casts_there() -> None:
    t = torch.randn(4, 4)
    (host,) = to_host([t], [torch.bfloat16], torch.device("cpu"))
    assert torch.equal(host, t.to(torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_bucket_is_one_copy_to_pinned_memory_whatever_its_tensors() -> None:
    for count in (4, 64):
        tensors = [t.cuda() for t, _ in CASES] * (count // 4)
        dtypes = [d for _, d in CASES] * (count // 4)
        with SyncCounter() as counter:
            hosts = to_host(tensors, dtypes)
        copies: dict[str, Any] = dict(counter.syncs)
        assert sum(copies.values()) <= 1, copies  # the pinned copy is non-blocking; the wait is a stream sync
        starts = {h.data_ptr() - hosts[0].data_ptr() for h in hosts if h.numel()}
        assert all(s % ALIGN == 0 for s in starts)
        for t, dtype, host in zip(tensors, dtypes, hosts):
            assert host.is_pinned() or host.numel() == 0
            assert torch.equal(bits(host.contiguous()), bits(t.cpu().to(dtype).contiguous()))


def test_a_device_span_is_wall_time_on_cpu() -> None:
    import time

    from protocol.timing import DeviceSpan

    with DeviceSpan(torch.device("cpu")) as span:
        time.sleep(0.01)
    assert 0.005 < span.seconds() < 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_copies_report_their_device_time() -> None:
    spent: list[float] = []
    to_host([torch.randn(1 << 20, device="cuda")], [torch.bfloat16], copied=spent.append)
    assert len(spent) == 1 and spent[0] > 0
