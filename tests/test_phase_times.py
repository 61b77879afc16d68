"""Phase timings of a version on both sides (SyncStats, ApplyStats): the figures issue 35's
GPU check reports. On CUDA they are CUDA-event times of asynchronous work; here, on CPU,
they are wall times where work was done and 0 where nothing crossed between devices."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from channel import Channel

import receiver
import sender
from protocol.codec.staging import StagingPool


def state_of(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(64, 256, generator=gen) for i in range(6)}


@pytest.mark.parametrize("kind,codec", [("patch", "device"), ("patch", "host"), ("bucket", "auto")])
async def test_a_version_reports_its_phases(kind: str, codec: str) -> None:
    config: dict[str, Any] = {"type": kind, "patch": {"codec": codec}}
    state = state_of(0)
    model = {k: v.to(torch.bfloat16) for k, v in state_of(1).items()}
    s, r = sender.make_sender(config), receiver.make_receiver(config)
    r.staging = StagingPool(cpu_too=True)  # the GPU's staged path, on CPU tensors
    ch = Channel()
    await asyncio.wait_for(
        asyncio.gather(s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv), r.init_receiver(model, ch.to_receiver.recv, ch.to_sender.send)),
        timeout=120,
    )
    for t in state.values():
        t[::3] += 0.01
    stats = await s.sync(state, ch.to_receiver.send, 1)
    assert await asyncio.wait_for(r.apply(model, ch.to_receiver.recv), timeout=60) == 1
    assert all(torch.equal(model[k], state[k].to(torch.bfloat16)) for k in state)
    assert stats.d2h_seconds == 0.0 and "d2h_seconds" in stats.as_dict()  # CPU tensors: nothing leaves a device
    assert stats.build_seconds > 0
    applied = r.last_stats
    assert applied is not None and applied.version == 1
    assert 0 < applied.apply_device_seconds <= applied.apply_seconds  # the commit's work, inside its wall time
    # every entry bound for a staged device is staged (the pool here stages CPU targets too, as a
    # GPU's would be): device-coded payloads, whole tensors (a bucket's), and what the host decoded
    # of host-coded entries
    assert 0 < applied.h2d_seconds <= applied.decode_seconds
    assert {"h2d_seconds", "apply_device_seconds"} <= set(applied.as_dict())
