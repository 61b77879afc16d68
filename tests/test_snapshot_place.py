"""Where the sender's snapshot lives (``patch.snapshot_device``, sender/diff/snapshot.py), on CPU.

``auto`` (the default) keeps a CUDA trainer's snapshot on its GPU when it fits
``SNAPSHOT_BUDGET`` of the free memory there, else on the host; a CPU trainer keeps it on the
host. The decision is a pure function, tested here on both sides of the budget; the trainer's
device and the free memory are faked where a GPU would give them. It is taken once, at the
first capture, and logged once.
"""

from __future__ import annotations

import logging

import pytest
import torch

from protocol.config import load_config
from protocol.errors import ConfigError, StateError
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from sender.diff import snapshot as snapshot_module
from sender.diff.snapshot import SNAPSHOT_BUDGET, Snapshot, choose_place, trainer_device
from sender.plan import SyncPlan
from sender.version.patch import PatchBuilder

CPU = torch.device("cpu")
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_a_gpu_trainer_keeps_the_snapshot_on_its_gpu_within_the_budget() -> None:
    assert SNAPSHOT_BUDGET == 0.5
    assert choose_place(GPU1, 500, 1000) == GPU1  # at the budget: fits
    assert choose_place(GPU1, 501, 1000) == CPU  # over it: pinned host memory
    assert choose_place(GPU0, 0, 0) == GPU0  # nothing tracked fits anywhere
    assert choose_place(GPU0, 900, 1000, budget=0.9) == GPU0
    assert choose_place(None, 1, 1 << 40) == CPU  # a CPU trainer: the host, whatever is free
    assert choose_place(GPU0, 1, None) == CPU


def test_only_a_trainer_on_one_gpu_has_a_device_to_keep_it_on() -> None:
    assert trainer_device([GPU1, GPU1]) == GPU1
    assert trainer_device([CPU]) is None
    assert trainer_device([]) is None
    assert trainer_device([GPU0, GPU1]) is None  # its tensors span devices: each fetches its own
    assert trainer_device([GPU0, CPU]) is None


def tensors() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(10, 100), "b": torch.randn(100)}


def bf16(key: str) -> torch.dtype:
    return torch.bfloat16


def test_auto_on_cpu_tensors_is_cpu_and_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    snapshot = Snapshot("auto")
    with pytest.raises(StateError, match="place"):
        snapshot.device  # noqa: B018 - not placed yet: nothing may be captured
    with caplog.at_level(logging.INFO, logger="sender.diff.snapshot"):
        assert snapshot.place(tensors(), bf16) == CPU
        assert snapshot.place(tensors(), bf16) == CPU
    assert snapshot.device == CPU
    records = [r for r in caplog.records if r.name == "sender.diff.snapshot"]
    assert len(records) == 1
    assert "auto: cpu" in records[0].getMessage()
    assert (records[0].snapshot_device, records[0].snapshot_bytes, records[0].free_bytes) == ("cpu", 1100 * 2, None)


@pytest.mark.parametrize(("free", "expected"), [(4400, GPU0), (4399, CPU)])
def test_auto_on_a_gpu_trainer_by_its_free_memory(
    free: int, expected: torch.device, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1,100 fp32 elements to bf16 receivers: a 2,200-byte snapshot (the receivers' dtype,
    not the trainer's), on the GPU from 4,400 bytes free."""
    asked: list[torch.device] = []

    def free_memory(device: torch.device) -> int:
        asked.append(device)
        return free

    monkeypatch.setattr(snapshot_module, "trainer_device", lambda devices: GPU0)
    monkeypatch.setattr(snapshot_module, "free_memory", free_memory)
    snapshot = Snapshot("auto")
    with caplog.at_level(logging.INFO, logger="sender.diff.snapshot"):
        assert snapshot.place(tensors(), bf16) == expected
        snapshot.place(tensors(), bf16)
    assert snapshot.device == expected and asked == [GPU0]  # decided once
    (record,) = [r for r in caplog.records if r.name == "sender.diff.snapshot"]
    assert (record.snapshot_device, record.snapshot_bytes, record.free_bytes) == (str(expected), 2200, free)
    message = record.getMessage()
    assert ("fits within" if expected == GPU0 else "exceeds") in message and "50%" in message


def test_a_set_device_is_kept_and_not_logged(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module, "trainer_device", lambda devices: GPU0)
    monkeypatch.setattr(snapshot_module, "free_memory", lambda device: 1 << 40)
    snapshot = Snapshot("cpu")
    with caplog.at_level(logging.INFO, logger="sender.diff.snapshot"):
        assert snapshot.place(tensors(), bf16) == CPU
    assert not [r for r in caplog.records if r.name == "sender.diff.snapshot"]
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="snapshot_device: cuda"):
            Snapshot("cuda")


@pytest.mark.parametrize("codec", ["host", "device"])
def test_the_default_is_auto_and_a_cpu_trainers_snapshot_is_on_the_host(codec: str) -> None:
    config = load_config({"type": "patch", "patch": {"codec": codec}})
    assert config.patch.snapshot_device == "auto"
    state = tensors()
    metadata = ModelMetadata.of({k: t.to(torch.bfloat16) for k, t in state.items()})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    builder.capture(state)
    assert builder.snapshot.device == CPU
    assert all(t.device == CPU for t in builder.snapshot.tensors.values())


def test_a_gpu_trainer_over_the_budget_captures_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Placed before the first capture, whichever compare takes it."""
    monkeypatch.setattr(snapshot_module, "trainer_device", lambda devices: GPU0)
    monkeypatch.setattr(snapshot_module, "free_memory", lambda device: 10)
    config = load_config({"type": "patch"})
    state = tensors()
    metadata = ModelMetadata.of({k: t.to(torch.bfloat16) for k, t in state.items()})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    builder.compare.capture(state)
    assert builder.snapshot.device == CPU and set(builder.snapshot.tensors) == set(state)


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda"])
def test_config_takes_auto_cpu_and_cuda(value: str) -> None:
    assert load_config({"patch": {"snapshot_device": value}}).patch.snapshot_device == value


def test_config_refuses_another_place() -> None:
    with pytest.raises(ConfigError, match=r"patch\.snapshot_device") as err:
        load_config({"patch": {"snapshot_device": "gpu"}})
    assert "'auto'" in str(err.value)
