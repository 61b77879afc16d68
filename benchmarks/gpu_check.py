"""GPU check: CUDA patch build and apply are bit-exact, and how fast the build is.

On a CUDA machine this checks, for a real fp32 model trained with AdamW and synced to a
bf16 receiver on the GPU, that every version lands bit for bit with the snapshot on the
GPU, with a pinned CPU snapshot, and with nvcomp_lz4 (when nvidia-nvcomp-cu12 is
installed). Then it times the patch build for 1-8 GB of bf16 state against the device's
copy bandwidth (a build must read the state and the snapshot). Prints a short table.

    python benchmarks/gpu_check.py [--sizes-gb 1 2 4 8] [--density 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.config import load_config
from protocol.errors import ConfigError
from protocol.state import resolve_state
from protocol.wire.metadata import ModelMetadata
from receiver import PatchReceiver
from sender import PatchSender
from sender.patch import PatchBuilder
from sender.plan import SyncPlan


class _Pipe:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue()

    async def send(self, frames: list) -> None:  # type: ignore[type-arg]
        await self.queue.put([bytes(f) for f in frames])

    async def recv(self) -> list[bytes]:
        return await self.queue.get()


async def exactness(config: dict, steps: int = 5) -> str:  # type: ignore[type-arg]
    """Train a small model on the GPU, sync every step, compare bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
    rollout = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    s, r = PatchSender(config), PatchReceiver(config)
    down, up = _Pipe(), _Pipe()
    await asyncio.gather(s.init_sender(model, down.send, up.recv), r.init_receiver(rollout, down.recv, up.send))
    worst = 0
    for step in range(1, steps + 1):
        loss = model(torch.randn(64, 1024, device="cuda")).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        await s.sync(model, down.send, step)
        await r.apply(rollout, down.recv)
        for a, b in zip(model.state_dict().values(), rollout.state_dict().values()):
            bad = int((a.to(torch.bfloat16).view(torch.int16) != b.view(torch.int16)).sum())
            worst = max(worst, bad)
    return "bit-exact" if worst == 0 else f"{worst} elements differ"


def copy_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return nbytes / best  # bytes read per second


async def build_time(gb: float, density: float, snapshot: str) -> tuple[float, float]:
    """Seconds to build one patch over ``gb`` GB of bf16 state, and the read floor."""
    n = int(gb * 2**30 / 2)
    rows = 8192
    state = {"w": (torch.randn(rows, n // rows, device="cuda") * 0.02).to(torch.bfloat16)}
    metadata = ModelMetadata.of(state)
    config = load_config({"patch": {"snapshot_device": snapshot}})
    builder = PatchBuilder(SyncPlan(resolve_state(state), metadata, config.init_sync), config.patch)
    builder.capture(state)
    best = float("inf")
    for version in range(1, 4):
        bits = state["w"].view(torch.int16)
        mask = torch.rand(bits.shape, device="cuda") < density
        bits += mask.to(torch.int16)
        torch.cuda.synchronize()
        started = time.perf_counter()
        await builder.build(state, version, version - 1)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    read_floor = 2 * n * 2 / copy_bandwidth(min(n * 2, 2**31))
    del state, builder
    torch.cuda.empty_cache()
    return best, read_floor


async def main(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    configs = {
        "snapshot cuda": {"patch": {"snapshot_device": "cuda"}},
        "snapshot cpu (pinned)": {"patch": {"snapshot_device": "cpu"}},
        "nvcomp_lz4": {"patch": {"snapshot_device": "cuda", "transport_device": "cuda", "compression": "nvcomp_lz4",
                                 "position_encoding": "gaps", "value_encoding": "xor"}},
    }
    print("\nbit-exactness (fp32 AdamW on the GPU -> bf16 receiver on the GPU, 5 steps)")
    for name, config in configs.items():
        try:
            result = await exactness(config)
        except ConfigError as e:
            result = f"skipped: {e}"
        print(f"  {name:<24} {result}")
    print(f"\npatch build, {args.density:.1%} of elements changed (best of 3)")
    print(f"  {'state':>8} {'snapshot':>9} {'build':>10} {'read floor':>11} {'ratio':>6}")
    for gb in args.sizes_gb:
        for snapshot in ("cuda", "cpu"):
            build, floor = await build_time(gb, args.density, snapshot)
            print(f"  {gb:>6.0f}GB {snapshot:>9} {build * 1e3:>8.1f}ms {floor * 1e3:>9.1f}ms {build / floor:>5.1f}x")
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--density", type=float, default=0.01)
    sys.exit(asyncio.run(main(p.parse_args())))
