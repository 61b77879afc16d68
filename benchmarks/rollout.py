"""Receivers in their own processes, as rollouts run them: ``python -m benchmarks.rollout``.

Each worker builds its state from a JSON spec (``Workload.receiver_spec``), runs a
``Receiver`` against the harness's sender and talks to the harness in JSON lines:
it reports ``ready`` after the handshake and ``applied`` (with the version's stats)
after each commit; on ``digest`` it replies with the digest of its state (``peers.digest``,
taken under the reading lock), on ``state_digest`` with ``protocol.wire.checksum.state_digest``
of it (xxh3, CUDA tensors too: ``benchmarks/gpu_check.py e2e``), on ``stop`` it closes and
reports its peak RSS. The harness times syncs by the sender's acknowledgements, so nothing
on this pipe is timed; ``ready`` carries ``started_ns`` (``time.monotonic_ns()`` as
``Receiver.start`` was called, after the strategy's ``prepare``: kernels compiled or loaded,
``prepare_s``) and ``applied`` carries ``applied_ns`` (as its hook ran, after
a ``torch.cuda.synchronize()`` where the model is on CUDA) and the whole ``ApplyStats`` as
``stats``, for harnesses that time by the receivers' own reports (one clock: CLOCK_MONOTONIC).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from protocol.state import resolve_state

from .peers import ROOT, digest, maxrss_bytes, pin_to_bench_cpus
from .workloads import build_receiver_state

TIMEOUT = 600.0


class RemoteReceivers:
    """``count`` worker processes following ``endpoint``; the harness's handle on them."""

    def __init__(self, procs: list[asyncio.subprocess.Process]) -> None:
        self.procs = procs
        self.applied: list[dict[int, dict[str, Any]]] = [{} for _ in procs]
        self.reconnects = [0] * len(procs)
        self._replies: list[asyncio.Queue[dict[str, Any]]] = [asyncio.Queue() for _ in procs]
        self._readers = [asyncio.ensure_future(self._read(i)) for i in range(len(procs))]
        self.ready: list[dict[str, Any]] = []

    @classmethod
    async def start(cls, spec: dict[str, Any], endpoint: str, config: dict[str, Any], name: str, count: int = 2,
                    prefix: tuple[str, ...] = ()) -> RemoteReceivers:
        """``prefix`` goes before each worker's command (``ip netns exec NS`` runs it in a namespace)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        procs = [
            await asyncio.create_subprocess_exec(
                *prefix, sys.executable, "-m", "benchmarks.rollout", "--endpoint", endpoint, "--config", json.dumps(config),
                "--spec", json.dumps(spec), "--identity", f"bench-{name}-{i}",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
            )
            for i in range(count)
        ]
        self = cls(procs)
        try:
            self.ready = [await self._reply(i, "ready") for i in range(count)]  # each with its started_ns
        except BaseException:
            await self.kill()
            raise
        return self

    async def _read(self, i: int) -> None:
        stdout = self.procs[i].stdout
        assert stdout is not None
        while line := await stdout.readline():
            event = json.loads(line)
            if event["event"] == "applied":
                self.applied[i][event["version"]] = event
                self.reconnects[i] = event["reconnects"]
            else:
                self._replies[i].put_nowait(event)
        self._replies[i].put_nowait({"event": "exited", "code": await self.procs[i].wait()})

    async def _reply(self, i: int, want: str) -> dict[str, Any]:
        event = await asyncio.wait_for(self._replies[i].get(), TIMEOUT)
        if event["event"] != want:
            raise RuntimeError(f"rollout worker {i}: expected {want!r}, got {event}")
        return event

    async def _ask(self, op: str) -> list[dict[str, Any]]:
        for p in self.procs:
            assert p.stdin is not None
            p.stdin.write(f"{op}\n".encode())
            await p.stdin.drain()
        return [await self._reply(i, op) for i in range(len(self.procs))]

    async def reports(self, version: int, timeout: float = 30.0) -> list[dict[str, Any] | None]:
        """Each worker's ``applied`` report of ``version`` (None for one that sent none in time)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline and not all(version in a for a in self.applied):
            await asyncio.sleep(0.005)
        return [a.get(version) for a in self.applied]

    async def digests(self) -> list[str]:
        return [r["digest"] for r in await self._ask("digest")]

    async def state_digests(self) -> list[dict[str, Any]]:
        """Each worker's ``state_digest`` reply: ``version`` and ``digest``."""
        return await self._ask("state_digest")

    async def stop(self) -> list[int]:
        """Close the workers; their peak RSS."""
        try:
            return [r["peak_rss"] for r in await self._ask("stop")]
        finally:
            for p in self.procs:
                if p.returncode is None:
                    try:
                        await asyncio.wait_for(p.wait(), 30)
                    except asyncio.TimeoutError:
                        p.kill()
            for r in self._readers:
                r.cancel()

    async def kill(self) -> None:
        """End the workers now (one failed to start): killed, reaped and their pipes read to
        the end here, so no process outlives the harness and no transport is left for the
        garbage collector to close after the event loop (an unraisable error in a later test)."""
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
            if p.returncode is None:
                p.kill()
        await asyncio.gather(*(p.wait() for p in self.procs))
        await asyncio.wait(self._readers, timeout=30)
        for r in self._readers:
            r.cancel()


# -- the worker -----------------------------------------------------------------------------
def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    from receiver import Receiver

    from . import phases

    phases.install_receiver()
    spec = json.loads(args.spec)
    state = build_receiver_state(spec)
    receiver = Receiver(state, args.endpoint, json.loads(args.config), identity=args.identity, peer_timeout=TIMEOUT)
    on_cuda = str(spec.get("device", "cpu")).startswith("cuda")

    def on_update(version: int | None) -> None:
        if on_cuda:
            import torch

            torch.cuda.synchronize()  # the commit's queued kernels count as applying it
        applied_ns = time.monotonic_ns()
        stats = receiver.stats.get(version) if version is not None else None
        emit(event="applied", version=version, kind=stats.kind if stats else None,
             decode_s=stats.decode_seconds if stats else None, apply_s=stats.apply_seconds if stats else None,
             reconnects=receiver.reconnects, phases=phases.RECORDER.take(), applied_ns=applied_ns,
             stats=stats.as_dict() if stats else None)

    receiver.on_update(on_update)
    prepared_ns = time.monotonic_ns()
    await receiver.strategy.prepare()  # kernels compiled or loaded from numba's cache: start() would do it first
    started_ns = time.monotonic_ns()
    await receiver.start(timeout=TIMEOUT)
    emit(event="ready", started_ns=started_ns, prepare_s=(started_ns - prepared_ns) / 1e9)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while op := (await reader.readline()).decode().strip():
            if op == "digest":
                async with receiver.reading():
                    tensors = resolve_state(receiver.model)
                    unique = {k: tensors.tensors[k] for k in tensors.tracked if k not in tensors.aliases}
                    emit(event="digest", version=receiver.version, digest=await asyncio.to_thread(digest, unique))
                phases.RECORDER.skip_cpu()  # the harness's check, not the next version's work
            elif op == "state_digest":
                from protocol.wire.checksum import state_digest

                async with receiver.reading():
                    tensors = resolve_state(receiver.model)
                    unique = {k: tensors.tensors[k] for k in tensors.tracked if k not in tensors.aliases}
                    emit(event="state_digest", version=receiver.version, digest=await asyncio.to_thread(state_digest, unique))
                phases.RECORDER.skip_cpu()
            elif op == "stop":
                break
    finally:
        await receiver.close()
    emit(event="stop", peak_rss=maxrss_bytes())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--config", required=True, help="the sync config as JSON")
    p.add_argument("--spec", required=True, help="the receiver state as JSON (Workload.receiver_spec)")
    p.add_argument("--identity", required=True)
    args = p.parse_args()
    pin_to_bench_cpus()
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
