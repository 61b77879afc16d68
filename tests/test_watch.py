"""``python -m sender --watch DIR`` serving the files trainers write themselves.

The sender is a real process (``python -m sender --watch``); the receiver a real ``Receiver``
(bf16, other initial weights) connected to it over TCP. Each version is a file written the way
a trainer writes one, under a temporary name and renamed into place: ``safetensors.torch``'s
``save_file`` and ``save_model`` (which leaves out a tied name), ``torch.save``, a Hugging Face
``save_pretrained``'s ``model.safetensors``, and ``sender.write_snapshot``. After each, the
receiver must hold that file's tensors cast to bf16, bit for bit. Then the files it must not
serve: torn at several byte offsets, read while still being written, named without a version,
of another model's shapes, a ``write_snapshot`` file renamed to another version. Each is
refused with a ``refused`` line whose error names the fix, the receiver keeps the version
before, and a good file goes on to be served. The property below it: a file cut short at any
byte offset is refused, never served.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from daemon_helpers import CONFIGS, DAEMON_KW, YAML, Proc, Processes, T, Trainer, bf16_state, mismatches, receiver_model, wait_until

from examples.tiny_model import build
from protocol.errors import CheckpointError
from receiver import Receiver
from sender import write_snapshot
from sender.checkpoints import Checkpoints, read_checkpoint

safetensors_torch = pytest.importorskip("safetensors.torch")

TINY = "examples.tiny_model:build"
TIMING = ["--heartbeat", str(DAEMON_KW["heartbeat_interval"]), "--peer-timeout", str(DAEMON_KW["peer_timeout"]), "--poll", "0.05"]
RENAME_FIX = "rename it into place"
Writer = Callable[[torch.nn.Module, Path], None]


def save_file(model: torch.nn.Module, path: Path) -> None:
    # save_file refuses tensors that share memory (the tied head): a copy each, as trainers do
    safetensors_torch.save_file({k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}, str(path))


def save_model(model: torch.nn.Module, path: Path) -> None:
    safetensors_torch.save_model(model, str(path))  # writes one name of each tied group


def torch_save(model: torch.nn.Module, path: Path) -> None:
    torch.save(model.state_dict(), path)


WRITERS: dict[str, tuple[Writer, str]] = {
    "save_file": (save_file, ".safetensors"),
    "save_model": (save_model, ".safetensors"),
    "torch.save": (torch_save, ".pt"),
}


def put(watch: Path, version: int, data: bytes, suffix: str) -> Path:
    """``data`` as ``step_<version><suffix>``, written under a temporary name and renamed."""
    final = watch / f"step_{version}{suffix}"
    partial = watch / f"step_{version}{suffix}.tmp"  # not step_<v>.*: the sender does not look at it
    partial.write_bytes(data)
    os.rename(partial, final)
    return final


def encoded(writer: Writer, model: torch.nn.Module, scratch: Path, suffix: str) -> bytes:
    """The bytes ``writer`` writes for ``model``."""
    path = scratch / f"encoded{suffix}"
    writer(model, path)
    data = path.read_bytes()
    path.unlink()
    return data


def file_state(path: Path) -> dict[str, torch.Tensor]:
    """The tensors in ``path``, read back by the library that wrote them, not by weightsync."""
    if path.suffix == ".safetensors":
        state: dict[str, torch.Tensor] = safetensors_torch.load_file(str(path))
        return state
    return dict(torch.load(path, map_location="cpu", weights_only=True))


async def holds(receiver: Receiver, version: int, expected: Mapping[str, torch.Tensor]) -> None:
    """``receiver`` is at ``version`` and holds ``expected`` (a file's tensors) cast to bf16,
    bit for bit; a name the file left out is tied to one it has."""

    async def check() -> None:
        async with receiver.reading():
            assert receiver.version == version, f"at v{receiver.version}, expected v{version}"
            state = receiver.model.state_dict()
            bad = mismatches(bf16_state(expected), {k: state[k] for k in expected})
            assert not bad, f"differs from the v{version} file at {bad[:5]}"
            for k in set(state) - set(expected):
                twin = next(n for n in expected if state[n].data_ptr() == state[k].data_ptr())
                assert torch.equal(state[k], state[twin]), k

    await wait_until(lambda: receiver.version == version)
    await asyncio.wait_for(check(), T)


def refusals(sender: Proc, version: int | None) -> list[dict[str, Any]]:
    return [e for e in sender.events if e.get("event") == "refused" and e.get("version") == version]


async def refused(sender: Proc, version: int | None, nth: int, *needles: str) -> dict[str, Any]:
    """The ``nth`` refusal (1-based) of ``version``; its error contains every needle."""
    await sender.wait_event(lambda e: len(refusals(sender, version)) >= nth)
    event = refusals(sender, version)[nth - 1]
    for needle in needles:
        assert needle in event["error"], event
    return event


def synced(sender: Proc) -> list[int]:
    return [e["version"] for e in sender.events if e.get("event") == "synced"]


class Watched:
    """A ``python -m sender --watch`` process and one in-process ``Receiver`` following it."""

    def __init__(self, procs: Processes, tmp_path: Path) -> None:
        self.procs, self.tmp = procs, tmp_path
        self.watch = tmp_path / "ckpt"
        self.watch.mkdir()
        self.config = tmp_path / "patch.yaml"
        self.config.write_text(YAML["patch"])
        self.sender: Proc | None = None
        self.receiver: Receiver | None = None

    async def start(self, model: str | None, receiver: torch.nn.Module, version: int) -> tuple[Proc, Receiver]:
        extra = ["--model", model] if model else []
        self.sender = await self.procs.spawn(
            "sender", "sender", "--watch", str(self.watch), *extra, "--endpoint", "tcp://127.0.0.1:0",
            "--config", str(self.config), *TIMING,
        )
        listening = await self.sender.wait_event(lambda e: e.get("event") == "listening")
        assert listening["version"] == version, listening
        self.receiver = Receiver(receiver, listening["endpoint"], CONFIGS["patch"], identity="r0", **DAEMON_KW)
        await self.receiver.start(timeout=T)
        return self.sender, self.receiver

    async def __aenter__(self) -> Watched:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        if self.sender is not None and self.sender.process.returncode is None:
            assert await self.sender.terminate() == 0, self.sender.tail()  # a clean exit, refusals and all


@pytest.fixture
async def watched(procs: Processes, tmp_path: Path) -> AsyncIterator[Watched]:
    async with Watched(procs, tmp_path) as w:
        yield w


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("writer", "model"), [
    ("save_file", TINY), ("save_model", TINY), ("torch.save", TINY), ("torch.save", None),
])
async def test_trainers_own_files_are_served_and_bad_ones_refused(writer: str, model: str | None, watched: Watched) -> None:
    write, suffix = WRITERS[writer]
    watch, scratch = watched.watch, watched.tmp
    trainer = Trainer(seed=7)  # real AdamW steps on the tiny transformer (its head tied to its embedding)
    put(watch, 0, encoded(write, trainer.model, scratch, suffix), suffix)
    sender, receiver = await watched.start(model, receiver_model(), 0)
    await holds(receiver, 0, file_state(watch / f"step_0{suffix}"))
    trainer.step()
    await holds(receiver, 1, file_state(put(watch, 1, encoded(write, trainer.model, scratch, suffix), suffix)))

    # v2 torn: the file cut short at several offsets (each a file changed: refused again), never served
    trainer.step()
    whole = encoded(write, trainer.model, scratch, suffix)
    cuts = [1, 9, len(whole) // 3, len(whole) - 1]
    for i, cut in enumerate(cuts, 1):
        put(watch, 2, whole[:cut], suffix)
        await refused(sender, 2, i, RENAME_FIX, "step_2")
    # still being written: in place, half of it, then the rest; refused, then served once whole
    with open(watch / f"step_2{suffix}", "wb") as f:
        f.write(whole[: len(whole) // 2])
        f.flush()
        await refused(sender, 2, len(cuts) + 1, "torn, or", RENAME_FIX)
        assert receiver.version == 1 and 2 not in synced(sender)
        f.write(whole[len(whole) // 2:])
    await holds(receiver, 2, file_state(watch / f"step_2{suffix}"))

    # a name without a version; another model's shapes: refused, v2 stays
    (scratch / f"model{suffix}").write_bytes(whole)
    os.rename(scratch / f"model{suffix}", watch / f"model{suffix}")  # whole at once: one refusal
    await refused(sender, None, 1, f"model{suffix}", "step_<version>.safetensors", RENAME_FIX)
    put(watch, 3, encoded(write, build(seed=7, dim=32), scratch, suffix), suffix)
    await refused(sender, 3, 1, "has shape", "same architecture")
    await asyncio.sleep(0.3)  # a few polls: each refused once, not on every scan
    assert len(refusals(sender, None)) == 1 and len(refusals(sender, 3)) == 1
    await holds(receiver, 2, file_state(watch / f"step_2{suffix}"))

    # the trainer's v3 renamed over the bad one: read again and served; then a write_snapshot file
    trainer.step()
    await holds(receiver, 3, file_state(put(watch, 3, encoded(write, trainer.model, scratch, suffix), suffix)))
    trainer.step()
    await holds(receiver, 4, file_state(write_snapshot(trainer.model.state_dict(), watch, 4)))
    # a write_snapshot file keeps its checks: renamed to another version, refused
    trainer.step()
    snap = write_snapshot(trainer.model.state_dict(), scratch, 5)
    os.rename(snap, watch / "step_6.safetensors")
    await refused(sender, 6, 1, "does not say version 6", "keeps the name it was written under")
    await holds(receiver, 4, file_state(watch / "step_4.safetensors"))
    trainer.step()
    await holds(receiver, 7, file_state(put(watch, 7, encoded(write, trainer.model, scratch, suffix), suffix)))
    assert synced(sender) == [1, 2, 3, 4, 7]
    assert sender.process.returncode is None and "CheckpointError" in sender.log.read_text()


@pytest.mark.timeout(180)
async def test_a_save_pretrained_model_safetensors_renamed_into_place_is_served(watched: Watched) -> None:
    """A Hugging Face trainer's ``save_pretrained`` (a tiny Qwen2 from a config, its LM head
    tied and so left out of the file): ``model.safetensors`` renamed to
    ``step_<v>.safetensors``. Saved into the watched folder as it is, it is refused (no
    version in the name); torn, refused; each renamed whole version served bit for bit."""
    pytest.importorskip("transformers")
    from examples.hf_rollout import build_rollout, tiny_config

    config = tiny_config()
    trainer = build_rollout(config, seed=0).float().train()  # fp32, its weights unlike the receiver's
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(5)
    watch, scratch = watched.watch, watched.tmp

    def saved(version: int) -> Path:
        out = scratch / f"hf-{version}"
        trainer.save_pretrained(out)
        final = watch / f"step_{version}.safetensors"
        os.rename(out / "model.safetensors", final)
        return final

    def step() -> None:
        ids = torch.randint(3, config.vocab_size, (4, 16), generator=generator)
        trainer(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    first = saved(0)
    assert "lm_head.weight" not in file_state(first)  # tied: save_pretrained writes the embedding alone
    sender, receiver = await watched.start("tests.watch_models:qwen2", build_rollout(config, seed=1234), 0)
    await holds(receiver, 0, file_state(first))
    step()
    await holds(receiver, 1, file_state(saved(1)))
    trainer.save_pretrained(watch)  # into the folder as it is: model.safetensors (and config.json, ignored)
    await refused(sender, None, 1, "model.safetensors", "no version in its name", "step_<version>.safetensors")
    (watch / "model.safetensors").unlink()
    step()
    whole = saved(2).read_bytes()
    (watch / "step_2.safetensors").unlink()
    put(watch, 2, whole[: len(whole) - 100], ".safetensors")
    await refused(sender, 2, 1, "torn, or still being written", RENAME_FIX)
    await holds(receiver, 1, file_state(watch / "step_1.safetensors"))
    put(watch, 2, whole, ".safetensors")
    await holds(receiver, 2, file_state(watch / "step_2.safetensors"))
    assert synced(sender) == [1, 2]


# -- the property, in one process: a file cut short is never served ----------------------------
def small_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16), "n": torch.arange(4)}


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_file_cut_short_at_any_byte_is_refused_never_served(suffix: str, tmp_path: Path) -> None:
    """Every proper prefix of a checkpoint, at every byte offset, is refused by what the
    daemon runs (``Checkpoints.next``) with a ``CheckpointError`` naming the fix; the whole
    file is served, equal to what was saved."""
    state = small_state()
    whole = tmp_path / f"whole{suffix}"
    if suffix == ".safetensors":
        safetensors_torch.save_file(state, str(whole))
    else:
        torch.save(state, whole)
    data = whole.read_bytes()
    watch = tmp_path / "w"
    watch.mkdir()
    path = watch / f"step_1{suffix}"
    for cut in range(len(data)):
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=RENAME_FIX):
            read_checkpoint(path, state)
        assert Checkpoints(watch).next(0, state) is None, f"served a file cut at byte {cut} of {len(data)}"
    path.write_bytes(data)
    found = Checkpoints(watch).next(0, state)
    assert found is not None and found[0] == 1 and not mismatches(state, found[2])


def test_a_file_changed_while_read_is_refused_and_one_renamed_over_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """A writer still appending while the daemon reads (the file's size changes in place)
    is refused as still being written; a file renamed over while read is not refused, and
    the new one is read at the next scan."""
    import sender.checkpoints as checkpoints

    state = small_state()
    newer = {k: v + 1 for k, v in state.items()}
    path = tmp_path / "step_1.safetensors"
    safetensors_torch.save_file(state, str(path))
    real = checkpoints.load

    def appended_meanwhile(p: Path) -> dict[str, torch.Tensor]:
        got = real(p)
        with open(p, "ab") as f:
            f.write(b"\0")
        return got

    monkeypatch.setattr(checkpoints, "load", appended_meanwhile)
    watched = Checkpoints(tmp_path)
    assert watched.next(0, state) is None
    assert "changed while it was read, so it is still being written" in capsys.readouterr().out
    monkeypatch.setattr(checkpoints, "load", real)
    assert watched.next(0, state) is None  # as it is now: a byte past its last tensor
    assert "bytes past its last tensor" in capsys.readouterr().out

    def renamed_over_meanwhile(p: Path) -> dict[str, torch.Tensor]:
        got = real(p)
        safetensors_torch.save_file(newer, str(tmp_path / "next.tmp"))
        os.rename(tmp_path / "next.tmp", p)
        return got

    safetensors_torch.save_file(state, str(tmp_path / "whole.tmp"))
    os.rename(tmp_path / "whole.tmp", path)
    monkeypatch.setattr(checkpoints, "load", renamed_over_meanwhile)
    assert watched.next(0, state) is None  # what it read is not the file there now
    assert "refused" not in capsys.readouterr().out
    monkeypatch.setattr(checkpoints, "load", real)
    found = watched.next(0, state)
    assert found is not None and not mismatches(newer, found[2])
