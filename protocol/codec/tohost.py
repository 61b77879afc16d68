"""Whole tensors to host memory, a device's at once: how buckets and bootstraps leave a GPU.

Copied one by one (``t.to(dtype).cpu()``), each CUDA tensor is a cast kernel, a blocking
copy into pageable memory and a host sync: a bucket build ran at 0.7 GB/s that way on an H200
(``benchmarks/gpu_check.py e2e``; docs/performance.md, *Whole tensors leaving a GPU*).
Here the tensors of one device are cast into one device buffer (the cast is the copy into
it), and the buffer goes to pinned host memory in ONE asynchronous copy, waited for once.
The pinned block comes from torch's caching host allocator, so the next bucket or version
reuses what an earlier one freed once its frames were sent. CPU tensors are only cast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from protocol.state import materialize
from protocol.timing import DeviceSpan

ALIGN = 64  # each tensor's bytes start at a multiple of this in the buffer (any dtype's view)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def to_host(
    tensors: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], device: torch.device | None = None, *, copy: bool = True,
    copied: Callable[[float], None] | None = None,
) -> list[torch.Tensor]:
    """``tensors`` cast to ``dtypes`` (on ``device`` first, if given), in host memory.

    Tensors on CUDA: one buffer and one copy a device, the results views of one pinned
    block. CPU tensors: ``t.to(dtype)``, cloned where that is ``t`` itself and ``copy``
    (frames must not change under their checksum while queued). DTensors are gathered
    (``materialize``) one at a time, each dropped once it is in the buffer or cast: never
    two gathered full tensors alive at once (sender/sharded/gathers.py counts them). ``copied`` gets
    each device's copy to the host as device seconds (CUDA events)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    on_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        where = t.device if device is None else device
        if where.type == "cuda":
            on_device.setdefault(where, []).append(i)
            continue
        src = materialize(t).detach()
        host = (src if device is None else src.to(device)).to(dtypes[i])
        out[i] = host.clone() if copy and host.data_ptr() == src.data_ptr() else host
        del src, host
    for where, ids in on_device.items():
        at, starts = 0, []
        for i in ids:
            starts.append(at)
            at += _aligned(tensors[i].numel() * dtypes[i].itemsize)
        with torch.cuda.device(where):
            buffer = torch.empty(at, dtype=torch.uint8, device=where)
            for i, start in zip(ids, starts):
                src = materialize(tensors[i]).detach()
                _slot(buffer, start, src.shape, dtypes[i]).copy_(src, non_blocking=True)  # the cast (and a move), on the device
                del src
            host = torch.empty(at, dtype=torch.uint8, pin_memory=True)
            with DeviceSpan(where) as span:
                host.copy_(buffer, non_blocking=True)
            torch.cuda.current_stream(where).synchronize()  # the one wait, for the copy
            if copied is not None:
                copied(span.seconds())
        for i, start in zip(ids, starts):
            out[i] = _slot(host, start, tensors[i].shape, dtypes[i])
    return [t for t in out if t is not None]


def _slot(buffer: torch.Tensor, start: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    n = shape.numel() * dtype.itemsize
    return buffer[start : start + n].view(dtype).view(shape)
