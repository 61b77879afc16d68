"""The peers weightsync is compared with, run for real: a safetensors file and a gloo broadcast.

``PeerGroup`` starts two worker processes (``python -m benchmarks.peers --rank R ...``)
that stand in for two rollouts, and joins them as rank 0 of a 3-process gloo group over
``tcp://127.0.0.1:PORT``. Per workload, ``setup`` gives the workers the state dict's keys,
shapes and dtypes; each builds a module with exactly those entries. Then:

* ``safetensors``: the trainer writes the state dict (already at the receivers' dtype)
  with ``safetensors.torch.save_file``; both workers, in parallel, ``load_file`` it and
  ``load_state_dict`` it into their module. Timed from the start of the write until both
  have loaded.
* ``gloo``: the trainer packs the state dict into one flat byte buffer (outside the
  timing, like the cast), ``dist.broadcast``s it to both workers, which copy it into their
  module; then a barrier. Timed from the start of the broadcast until the barrier, i.e.
  until both received and loaded.

Commands and answers travel as JSON lines on the workers' stdin/stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def maxrss_bytes() -> int:
    """This process's peak RSS in bytes: VmHWM from /proc (Linux), else ru_maxrss.

    Not ru_maxrss first: Linux keeps it across exec, so a child started from a large
    parent reports the parent's RSS at fork time.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # macOS: bytes; Linux: KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0: ``5`` into clear_refs), so a
    later ``maxrss_bytes`` is the peak of what follows; False where unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def module_with(specs: list[tuple[str, list[int], str]]) -> nn.Module:
    """A module whose state dict has exactly ``specs``' keys (dotted names become submodules)."""
    root = nn.Module()
    for key, shape, dtype in specs:
        *path, leaf = key.split(".")
        mod = root
        for part in path:
            child = getattr(mod, part, None)
            if not isinstance(child, nn.Module):
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        t = torch.zeros(shape, dtype=DTYPES[dtype])
        if t.is_floating_point():
            mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))
        else:
            mod.register_buffer(leaf, t)
    return root


def flat_nbytes(specs: list[tuple[str, list[int], str]]) -> int:
    return sum(math.prod(shape) * torch.empty((), dtype=DTYPES[dtype]).element_size() for _, shape, dtype in specs)


def pack(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One flat uint8 buffer holding every tensor's bytes, in order."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()])


def unpack_into(flat: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    offset = 0
    with torch.no_grad():
        for t in tensors.values():
            n = t.numel() * t.element_size()
            t.view(-1).view(torch.uint8).copy_(flat[offset : offset + n])
            offset += n


# -- the worker ------------------------------------------------------------------------------
def worker(rank: int, port: int, world: int, master: str = "127.0.0.1") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    out = sys.stdout
    model: nn.Module | None = None
    flat: torch.Tensor | None = None
    state: dict[str, torch.Tensor] = {}

    def answer(**kw: Any) -> None:
        out.write(json.dumps({"ok": True, **kw}) + "\n")
        out.flush()

    answer(ready=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "setup":
            model = flat = None
            model = module_with(cmd["specs"])
            state = dict(model.state_dict(keep_vars=True))
            flat = torch.empty(flat_nbytes(cmd["specs"]), dtype=torch.uint8)
            answer()
        elif op == "safetensors":
            from safetensors.torch import load_file

            assert model is not None
            started = time.perf_counter()
            model.load_state_dict(load_file(cmd["path"]), strict=True)
            answer(seconds=time.perf_counter() - started)
        elif op == "safetensors_fetch":  # the file over the network: read it whole from a socket, then load
            import socket

            from safetensors.torch import load

            assert model is not None
            started = time.perf_counter()
            data = bytearray()
            with socket.create_connection((cmd["host"], cmd["port"]), timeout=300) as conn:
                while chunk := conn.recv(1 << 20):
                    data += chunk
            fetched = time.perf_counter()
            model.load_state_dict(load(bytes(data)), strict=True)
            answer(seconds=time.perf_counter() - started, fetch_s=fetched - started, received=len(data))
        elif op == "gloo":
            assert flat is not None
            dist.broadcast(flat, src=0)
            unpack_into(flat, state)
            dist.barrier()
            answer()
        elif op == "check":  # digest of the module, to prove the bytes arrived
            answer(digest=digest(state))
        elif op == "stop":
            answer(maxrss=maxrss_bytes())
            break
    dist.destroy_process_group()


def digest(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for t in tensors.values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# -- the trainer's side ------------------------------------------------------------------------
@dataclass(frozen=True)
class PeerLink:
    """Where the workers run when they are not on this host's loopback (``benchmarks.lowbw``):
    ``ip netns exec ns``, gloo on ``ns_if`` there and ``host_if`` here (rank 0 and the
    rendezvous at ``host_ip``), and the safetensors file fetched over TCP from ``host_ip``
    through ``fetch`` (host, port as the workers reach it: a delaying proxy)."""

    ns: str
    host_ip: str
    host_if: str
    ns_if: str
    file_port: int  # this side serves the file here, on host_ip
    fetch: tuple[str, int]


class PeerGroup:
    """Two worker processes and this process as rank 0 of a gloo group."""

    def __init__(self, port: int, workers: int = 2, link: PeerLink | None = None, listener: Any = None) -> None:
        self.port, self.world, self.link, self.listener = port, workers + 1, link, listener
        master = link.host_ip if link else "127.0.0.1"
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
        if link:
            env["GLOO_SOCKET_IFNAME"] = link.ns_if
        self.procs = [
            subprocess.Popen(
                [*(["ip", "netns", "exec", link.ns] if link else []), sys.executable, "-m", "benchmarks.peers", "--rank", str(r),
                 "--port", str(port), "--world", str(self.world), "--master", master],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env,
            )
            for r in range(1, self.world)
        ]
        saved = os.environ.get("GLOO_SOCKET_IFNAME")
        if link:
            os.environ["GLOO_SOCKET_IFNAME"] = link.host_if  # read when the group is made
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}", rank=0, world_size=self.world, timeout=timedelta(seconds=300))
        finally:
            if link:
                if saved is None:
                    os.environ.pop("GLOO_SOCKET_IFNAME", None)
                else:
                    os.environ["GLOO_SOCKET_IFNAME"] = saved
        self._answers()
        self.directory = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))
        self.flat: torch.Tensor | None = None

    def _send(self, **cmd: Any) -> None:
        for p in self.procs:
            stdin: IO[str] | None = p.stdin
            assert stdin is not None
            stdin.write(json.dumps(cmd) + "\n")
            stdin.flush()

    def _answers(self) -> list[dict[str, Any]]:
        out = []
        for p in self.procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"peer worker {p.pid} exited with {p.wait()}")
            out.append(json.loads(line))
        return out

    def setup(self, tensors: dict[str, torch.Tensor]) -> None:
        specs = [(k, list(t.shape), dtype_name(t.dtype)) for k, t in tensors.items()]
        self._send(op="setup", specs=specs)
        self._answers()
        self.flat = None

    def safetensors(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """Write, then both workers load in parallel. Returns the e2e time and the file size."""
        from safetensors.torch import save_file

        path = self.directory / f"weightsync-bench-{os.getpid()}.safetensors"
        try:
            started = time.perf_counter()
            save_file(tensors, str(path))
            written = time.perf_counter()
            if self.link is None:
                self._send(op="safetensors", path=str(path))
                loads = self._answers()
            else:  # each worker downloads the file over the link, as from a file server, then loads it
                server = self._serve(path)
                self._send(op="safetensors_fetch", host=self.link.fetch[0], port=self.link.fetch[1])
                loads = self._answers()
                server.join(60)
            ended = time.perf_counter()
            return {
                "e2e_s": ended - started, "write_s": written - started,
                "load_s": max(a["seconds"] for a in loads), "bytes": path.stat().st_size,
            }
        finally:
            path.unlink(missing_ok=True)

    def _serve(self, path: Path) -> Any:
        """A thread that sends ``path`` whole to each of the workers' connections, in parallel."""
        import threading

        def send(conn: Any) -> None:
            with conn, open(path, "rb") as f:
                conn.sendfile(f)

        def serve() -> None:
            senders = []
            for _ in self.procs:
                conn, _addr = self.listener.accept()
                senders.append(threading.Thread(target=send, args=(conn,), daemon=True))
                senders[-1].start()
            for t in senders:
                t.join()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        return thread

    def gloo(self, tensors: dict[str, torch.Tensor]) -> dict[str, float]:
        """Broadcast the packed state dict to both workers; until both copied it in."""
        self._send(op="gloo")  # the workers enter the broadcast while this side packs
        started = time.perf_counter()
        flat = pack(tensors)
        packed = began = time.perf_counter()
        dist.broadcast(flat, src=0)
        dist.barrier()
        ended = time.perf_counter()
        self._answers()
        return {"e2e_s": ended - began, "pack_s": packed - started, "bytes": flat.numel()}

    def digests(self) -> list[str]:
        self._send(op="check")
        return [a["digest"] for a in self._answers()]

    def close(self) -> list[int]:
        rss: list[int] = []
        try:
            self._send(op="stop")
            rss = [a.get("maxrss", 0) for a in self._answers()]
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            if dist.is_initialized():
                dist.destroy_process_group()
        return rss


CPUS_ENV = "WEIGHTSYNC_BENCH_CPUS"  # python -m benchmarks --split-cores: the cores receivers and peer workers get


def pin_to_bench_cpus() -> None:
    """Run this worker on the cores ``CPUS_ENV`` names (comma-separated), if it is set."""
    cpus = os.environ.get(CPUS_ENV)
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def main() -> None:
    p = argparse.ArgumentParser(description="a peer worker (started by PeerGroup)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--master", default="127.0.0.1", help="rank 0's address (the gloo rendezvous)")
    args = p.parse_args()
    pin_to_bench_cpus()
    worker(args.rank, args.port, args.world, args.master)


if __name__ == "__main__":
    main()
