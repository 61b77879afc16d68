"""Shared helpers for the daemon integration tests (in-process and real processes).

A ``Trainer`` does real AdamW steps on ``examples.tiny_model`` (fp32) and records, for
every version, what a bf16 rollout must hold bit for bit and its state digest. Receivers
start from different weights (another seed, cast to bf16), so only the bootstrap can
make them equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from models import mismatches  # noqa: E402 - re-exported for the daemon tests

from examples.tiny_model import build, train_step  # noqa: E402
from protocol.wire.checksum import state_digest  # noqa: E402

T = 30.0  # the timeout of every single await: long enough never to fire on a healthy run
HEARTBEAT = 0.1
PEER_TIMEOUT = 2.0
DAEMON_KW: dict[str, Any] = {"heartbeat_interval": HEARTBEAT, "peer_timeout": PEER_TIMEOUT}

# Small buckets, so bootstraps and bucket versions are several messages each.
CONFIGS: dict[str, dict[str, Any]] = {
    "patch": {"type": "patch", "patch": {"init_sync": {"bucket_size": 96 << 10}}},
    "bucket": {"type": "bucket", "bucket": {"bucket_size": 96 << 10}},
    # patches coded by the device codec (Encoding.BLOCKS; on CPU tensors here, as auto does on CUDA)
    "patch-device": {"type": "patch", "patch": {"codec": "device", "init_sync": {"bucket_size": 96 << 10}}},
}
YAML = {
    "patch": "weight_syncer:\n  type: patch\n  patch:\n    init_sync: {bucket_size: 98304}\n",
    "bucket": "weight_syncer:\n  type: bucket\n  bucket: {bucket_size: 98304}\n",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bf16_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a bf16 rollout holds for ``state``: floating tensors cast (round to nearest)."""
    return {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).clone() for k, v in state.items()}


def receiver_model(seed: int = 1, **kwargs: int) -> torch.nn.Module:
    """A rollout's model: bf16, with initial weights unlike the trainer's."""
    return build(seed=seed, **kwargs).to(torch.bfloat16)


class Trainer:
    """Real AdamW steps on the tiny transformer; remembers every version's bf16 image."""

    def __init__(self, seed: int = 0, lr: float = 1e-3) -> None:
        self.model = build(seed=seed)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(1234)
        self.version = 0
        self.expected: dict[int, dict[str, torch.Tensor]] = {}
        self.digests: dict[int, str] = {}
        self._record()

    def _record(self) -> None:
        state = bf16_state(self.model.state_dict())
        self.expected[self.version] = state
        self.digests[self.version] = state_digest(state)

    def step(self) -> int:
        train_step(self.model, self.optimizer, self.generator)
        self.version += 1
        self._record()
        return self.version

    async def step_and_sync(self, sender: Any) -> int:
        """One training step, then ``sender.sync`` (which returns once the version is built)."""
        version = self.step()
        await asyncio.wait_for(sender.sync(self.model, version), T)
        return version

    def version_of(self, digest: str) -> int | None:
        for v, d in self.digests.items():
            if d == digest:
                return v
        return None

    def save(self, directory: Path) -> Path:
        """Write ``step_<version>.pt`` atomically, as the sender CLI expects."""
        final = directory / f"step_{self.version}.pt"
        partial = directory / f"step_{self.version}.pt.tmp"  # not step_<N>.pt: the sender ignores it
        torch.save(self.model.state_dict(), partial)
        os.rename(partial, final)
        return final


async def assert_matches(receiver: Any, trainer: Trainer, version: int) -> None:
    """``receiver`` holds exactly ``version``: bitwise, by digest and by its version."""

    async def check() -> None:
        async with receiver.reading():
            state = receiver.model.state_dict()
            assert receiver.version == version, f"{receiver.identity} is at v{receiver.version}, expected v{version}"
            bad = mismatches(trainer.expected[version], state)
            assert not bad, f"{receiver.identity} differs from the trainer's v{version} at {bad[:5]}"
            assert state_digest(state) == trainer.digests[version]

    await asyncio.wait_for(check(), T)


async def wait_until(predicate: Callable[[], bool], timeout: float = T, interval: float = 0.02) -> None:
    """Poll ``predicate`` until it holds; TimeoutError after ``timeout`` seconds."""

    async def poll() -> None:
        while not predicate():
            await asyncio.sleep(interval)

    await asyncio.wait_for(poll(), timeout)


# -- real processes ---------------------------------------------------------------------------
class Proc:
    """A daemon subprocess whose JSON stdout lines are collected as events."""

    def __init__(self, name: str, process: asyncio.subprocess.Process, log: Path) -> None:
        self.name, self.process, self.log = name, process, log
        self.events: list[dict[str, Any]] = []
        self.eof = False
        self._changed = asyncio.Condition()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            try:
                event = json.loads(raw)
            except json.JSONDecodeError:
                continue
            async with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        async with self._changed:
            self.eof = True
            self._changed.notify_all()

    async def wait_event(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = T) -> dict[str, Any]:
        """The first event (already seen or still to come) that satisfies ``predicate``."""

        def found() -> dict[str, Any] | None:
            return next((e for e in self.events if predicate(e)), None)

        async def wait() -> dict[str, Any]:
            async with self._changed:
                while (event := found()) is None:
                    if self.eof:
                        raise AssertionError(f"{self.name} exited (rc {self.process.returncode}) first; {self.tail()}")
                    await self._changed.wait()
                return event

        try:
            return await asyncio.wait_for(wait(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"{self.name}: no matching event within {timeout}s; {self.tail()}") from None

    def applied(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "applied"]

    def tail(self, n: int = 3000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            text = ""
        return f"events {self.events[-5:]}; stderr tail:\n{text[-n:]}"

    async def terminate(self, timeout: float = T) -> int:
        """SIGTERM, then wait for a clean exit."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(self.process.wait(), timeout)
        await asyncio.wait_for(self._reader, timeout)
        return rc

    async def kill(self) -> None:
        """SIGKILL (a crash): no goodbye, no saving."""
        if self.process.returncode is None:
            self.process.kill()
        with contextlib.suppress(asyncio.TimeoutError, ProcessLookupError):
            await asyncio.wait_for(self.process.wait(), T)
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(self._reader, T)


class Processes:
    """Starts daemon CLIs; ``cleanup`` kills whatever is still running."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: list[Proc] = []

    async def spawn(self, name: str, module: str, *args: str, stdin: int = asyncio.subprocess.DEVNULL) -> Proc:
        """``python -m module *args``; ``stdin=asyncio.subprocess.PIPE`` for a process the test drives by its stdin."""
        log = self.logs / f"{name}-{len(self.procs)}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", module, *args,
                cwd=ROOT, env=env, stdin=stdin, stdout=asyncio.subprocess.PIPE, stderr=err,
            )
        proc = Proc(name, process, log)
        self.procs.append(proc)
        return proc

    async def cleanup(self) -> None:
        for proc in self.procs:
            await proc.kill()


def record_whole(r: Any, trainer: Trainer) -> list[tuple[int | None, bool]]:
    """``r.on_update``: each version ``r`` publishes, and whether the weights it holds then,
    read under its read lock, are the trainer's image of the version held (that one, or a
    newer one already in: hooks run in their own task), bit for bit."""
    seen: list[tuple[int | None, bool]] = []

    async def check(version: int | None) -> None:
        async with r.reading() as held:
            whole = held is not None and version is not None and held >= version and state_digest(r.model.state_dict()) == trainer.digests[held]
        seen.append((version, whole))

    r.on_update(check)
    return seen
