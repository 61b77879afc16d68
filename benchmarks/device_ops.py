"""Ops a version costs each side on the device path, counted on CPU: ``python -m benchmarks.device_ops``.

On a GPU every non-view torch op is a kernel launch (5-10 us of host time each), so a
device path that launches per tensor or per change is bound by launches, not bytes. This
counts them without a GPU: the sender (``patch.codec: device``) in this process and one
receiver in its own, over tcp loopback, each under ``benchmarks.opcount.OpCounter`` (a
``TorchDispatchMode`` on every thread). The sender's window is ``sync()`` until the
version is acknowledged (compare, encode, staging); the receiver's is from its previous
version's report to this version's commit (decode, stage, commit). The next version is
synced only after the receiver has reported, so no work falls between windows.

Layouts: ``qwen2``, Qwen2-1.5B's 339 tensors (28 layers, biases and norms grouped, every
matrix its own entry) at small widths, stepped by AdamW on a next-token loss; ``t48`` and
``t480``, 48 and 480 tensors of the same elements in all, stepped by AdamW on random
gradients. Each row: ops a version a side (the median over the timed versions, after one
warm-up version), host syncs, parts, tensors changed, and the op names that dominate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .opcount import OpCounter, breakdown

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = ("qwen2", "t48", "t480")
TOTAL = 960_000  # elements of the t48 / t480 models
GROUP_NUMEL = 2048  # below the small qwen2's smallest matrix (64 x 128): biases and norms group, matrices do not
TIMEOUT = 300.0


# -- layouts ----------------------------------------------------------------------------------
def _qwen2() -> Any:
    from .qwen2 import Shape, build

    return build(Shape(layers=28, hidden=128, intermediate=384, heads=4, kv_heads=2, vocab=1024), "cpu", torch.float32)


def _flat(tensors: int) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(tensors)
    shapes = [(TOTAL // tensors // 40, 40) if i % 2 else (TOTAL // tensors,) for i in range(tensors)]
    return {f"w{i}": torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.02) for i, shape in enumerate(shapes)}


class Trainer:
    """A layout's fp32 weights and a real AdamW step on them."""

    def __init__(self, layout: str, lr: float) -> None:
        self.layout = layout
        self.gen = torch.Generator().manual_seed(1)
        if layout == "qwen2":
            self.model = _qwen2()
            params = list(self.model.parameters())
        else:
            self.model = None
            self.params = _flat(int(layout[1:]))
            params = list(self.params.values())
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def state(self) -> dict[str, torch.Tensor]:
        if self.model is not None:
            return {k: v for k, v in self.model.state_dict(keep_vars=True).items()}
        return dict(self.params)

    def step(self) -> None:
        if self.model is not None:
            from .qwen2 import train_step

            train_step(self.model, self.optimizer, self.gen, batch=2, seq=16)
            return
        for p in self.params.values():
            p.grad = torch.randn(p.shape, generator=self.gen)
        self.optimizer.step()


def receiver_spec(state: dict[str, torch.Tensor], fp8: bool = False) -> dict[str, Any]:
    """Each tensor's shape and dtype on the receiver (floats in bf16); with ``fp8``, every
    matrix in block fp8 (``float8_e4m3fn`` and a float32 ``_scale_inv``), as an fp8
    rollout holds the linear weights (the embeddings too here: every 2-D tensor)."""
    spec = {k: [list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in state.items()}
    if not fp8:
        return spec
    from protocol.quant import BlockFp8, scale_name, scale_shape

    out: dict[str, Any] = {}
    for k, t in state.items():
        if t.dim() != 2:
            out[k] = spec[k]
            continue
        out[k] = [list(t.shape), "float8_e4m3fn"]
        out[scale_name(k)] = [list(scale_shape(tuple(t.shape), BlockFp8().block)), "float32"]
    return out


def config(codec: str, fp8: bool = False) -> dict[str, Any]:
    return {"type": "patch", "patch": {"codec": codec, "group_numel": GROUP_NUMEL}, **({"fp8": {}} if fp8 else {})}


# -- the receiver's process ---------------------------------------------------------------------
def gpu_path(fused_kernels: bool = True) -> str:
    """Make this CPU receiver take the path a GPU receiver takes, so its ops are that path's
    launches: the commit's torch writes (not the numba kernels a CPU target gets), and, with
    ``fused_kernels``, the fused Triton kernels in Triton's interpreter where Triton imports
    (each launch counted as one op, ``launches``). Returns the path taken."""
    from receiver.apply import fused, kernels

    kernels.supported = lambda target: False  # type: ignore[assignment]
    try:
        import triton  # noqa: F401
    except ImportError:
        return "torch"
    fused.interpret(fused_kernels)
    return "fused" if fused_kernels else "torch"


def launches() -> Counter[str]:
    """Fused kernels launched since the last call, as ``triton::<kernel>`` ops."""
    from receiver.apply import fused

    with fused._lock:
        taken = Counter({f"triton::{name}": n for name, n in fused.LAUNCHES.items()})
        fused.LAUNCHES.clear()
    return taken



async def _receive(endpoint: str, spec: dict[str, Any], conf: dict[str, Any], versions: int, sites: bool = False, fused: bool = True) -> None:
    from receiver import Receiver

    def dtype(key: str, name: str) -> torch.dtype:
        d = getattr(torch, name)
        held_as_is = d == torch.float8_e4m3fn or key.endswith("_scale_inv")  # an fp8 rollout's
        return torch.bfloat16 if d.is_floating_point and not held_as_is else d

    model = {k: torch.zeros(shape, dtype=dtype(k, name)) for k, (shape, name) in spec.items()}
    path = gpu_path(fused)
    counter = OpCounter(sites)
    with counter:
        async with Receiver(model, endpoint, conf, identity="device-ops") as receiver:
            await receiver.start(timeout=TIMEOUT)
            await receiver.wait_for_version(0, timeout=TIMEOUT)
            counter.take()
            print(json.dumps({"event": "ready", "path": path}), flush=True)
            for v in range(1, versions + 1):
                await receiver.wait_for_version(v, timeout=TIMEOUT)
                where = counter.take_sites()
                ops, syncs = counter.take()
                ops.update(launches())
                print(json.dumps({"event": "applied", "version": v, "ops": dict(ops), "syncs": dict(syncs), "sites": dict(where)}), flush=True)


# -- the sender's side --------------------------------------------------------------------------
async def _lines(proc: asyncio.subprocess.Process) -> dict[str, Any]:
    assert proc.stdout is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
        if not raw:
            raise RuntimeError(f"the receiver exited ({await proc.wait()})")
        try:
            return dict(json.loads(raw))
        except json.JSONDecodeError:
            continue


async def measure(
    layout: str, versions: int = 3, codec: str = "device", lr: float = 1e-5, sites: bool = False, fused: bool = True,
    fp8: bool = False,
) -> dict[str, Any]:
    """One layout's counts: the first version is a warm-up, the rest are reported (medians);
    with ``sites``, the last version's ops by the weightsync function that dispatched them;
    with ``fp8``, the receiver holds every matrix in block fp8 (the sender quantizes each
    version, in its window)."""
    from sender import Sender

    trainer = Trainer(layout, lr)
    state = trainer.state()
    conf = config(codec, fp8)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    async with Sender("tcp://127.0.0.1:0", conf) as sender:
        await sender.start(state, version=0)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.device_ops", "--receive", sender.endpoint, "--spec", json.dumps(receiver_spec(state, fp8)),
            "--config", json.dumps(conf), "--versions", str(versions + 1), *(["--sites"] if sites else []), *([] if fused else ["--torch-only"]),
            stdout=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
        )
        try:
            ready = await _lines(proc)
            assert ready["event"] == "ready", ready
            rows = []
            counter = OpCounter(sites)
            for v in range(1, versions + 2):
                trainer.step()
                with counter:
                    stats = await sender.sync(state, v)
                    await sender.wait_acked(v, timeout=TIMEOUT)
                sent_sites = counter.take_sites()
                sent_ops, sent_syncs = counter.take()
                applied = await _lines(proc)
                assert applied["version"] == v, applied
                rows.append({
                    "sender_ops": sent_ops, "sender_syncs": sent_syncs,
                    "receiver_ops": Counter(applied["ops"]), "receiver_syncs": Counter(applied["syncs"]),
                    "sender_sites": sent_sites, "receiver_sites": Counter(applied.get("sites", {})),
                    "parts": stats.messages, "entries": stats.tensors_changed,
                    "changed_fraction": stats.changed_elements / max(stats.total_elements, 1),
                })
            await asyncio.wait_for(proc.wait(), TIMEOUT)
        finally:
            if proc.returncode is None:
                proc.kill()
    timed = rows[1:]

    def median(key: str) -> int:
        return int(statistics.median(sum(r[key].values()) for r in timed))

    last = timed[-1]
    return {
        "layout": layout, "fp8": fp8, "tensors": len(state), "elements": sum(t.numel() for t in state.values()), "codec": codec,
        "receiver_path": ready["path"],
        "versions": len(timed), "parts": last["parts"], "tensors_changed": last["entries"],
        "changed_fraction": round(statistics.mean(r["changed_fraction"] for r in timed), 4),
        "sender_ops": median("sender_ops"), "sender_syncs": median("sender_syncs"),
        "receiver_ops": median("receiver_ops"), "receiver_syncs": median("receiver_syncs"),
        "sender_top": breakdown(last["sender_ops"]), "receiver_top": breakdown(last["receiver_ops"]),
        **({"sender_sites": breakdown(last["sender_sites"], 20), "receiver_sites": breakdown(last["receiver_sites"], 20)} if sites else {}),
    }


def report(rows: list[dict[str, Any]]) -> str:
    head = f"{'layout':<7} {'tensors':>7} {'changed':>7} {'parts':>5} {'elements':>8}"
    lines = [f"{head} {'sender ops':>10} {'syncs':>5} {'receiver ops':>12} {'syncs':>5}  receiver path"]
    for r in rows:
        lines.append(
            f"{r['layout']:<7} {r['tensors']:>7} {r['tensors_changed']:>7} {r['parts']:>5} {100 * r['changed_fraction']:>7.2f}% "
            f"{r['sender_ops']:>10} {r['sender_syncs']:>5} {r['receiver_ops']:>12} {r['receiver_syncs']:>5}  {r.get('receiver_path', '?')}"
        )
    by = {r["layout"]: r for r in rows}
    if "t48" in by and "t480" in by:
        for side in ("sender_ops", "receiver_ops"):
            lines.append(f"{side}: 480 tensors / 48 tensors = {by['t480'][side] / max(by['t48'][side], 1):.2f}x")
    for r in rows:
        for side in ("sender", "receiver"):
            top = ", ".join(f"{name.removeprefix('aten::')} {n}" for name, n in r[f"{side}_top"])
            lines.append(f"{r['layout']} {side}: {top}")
            if f"{side}_sites" in r:
                lines += [f"    {n:>7}  {site}" for site, n in r[f"{side}_sites"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--versions", type=int, default=3, help="timed versions a layout (after one warm-up)")
    p.add_argument("--codec", default="device", choices=("device", "host"))
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--sites", action="store_true", help="also name the functions that dispatched the ops (slower)")
    p.add_argument("--torch-only", action="store_true", help="the receiver without the fused Triton kernels (a GPU without Triton)")
    p.add_argument("--fp8", action="store_true", help="receivers hold every matrix in block fp8 (the sender quantizes each version)")
    p.add_argument("--receive", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.receive:
        asyncio.run(_receive(args.receive, json.loads(args.spec), json.loads(args.config), args.versions, args.sites, not args.torch_only))
        return 0
    torch.set_num_threads(1)
    rows = [asyncio.run(measure(layout, args.versions, args.codec, sites=args.sites, fused=not args.torch_only, fp8=args.fp8))
            for layout in args.layouts]
    print(report(rows))
    if args.json:
        command = "python -m benchmarks.device_ops " + " ".join(argv or sys.argv[1:])
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
