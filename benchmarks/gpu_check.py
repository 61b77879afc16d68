"""GPU checks: the kernel checks, and the end-to-end daemon scenario (``e2e``).

Without a subcommand (CUDA only): for a real fp32 model trained with AdamW and synced to a
bf16 receiver on the GPU, every version lands bit for bit with the default snapshot place
(``auto``), the snapshot on the GPU, a pinned CPU snapshot, and with nvcomp_lz4 (when nvidia-nvcomp-cu12/-cu13 is installed). Then
it times the patch build for 1-8 GB of bf16 state against the device's copy bandwidth (a
build must read the state and the snapshot). Prints a short table.

    python benchmarks/gpu_check.py [--sizes-gb 1 2 4 8] [--density 0.01]

``e2e`` (any device; issue 35's scenario): a Qwen2-1.5B-shaped model (``benchmarks/qwen2.py``)
on ``--device``, an fp32 master trained by real AdamW steps; the ``Sender`` daemon in this
process beside it; ``--receivers`` bf16 rollouts (``benchmarks/rollout.py``: a ``Receiver``
daemon each, in their own processes, their models on the same device) over TCP loopback.
One run per lr, strategy and (patch) codec, each from the same seed, bootstrapped afresh.
Per version it prints and records ``sync()`` (what blocks the trainer), end to end (from
``sync()``'s start until both receivers' own reports say they applied it), receiver decode
and commit, wire and dense bytes, the changed fraction, and the trainer's bf16 digest
against each receiver's; writes every figure (``SyncStats.as_dict()``, each receiver's
``ApplyStats.as_dict()``) and their medians to ``--json``. Exits 1 if a digest differs.

    python benchmarks/gpu_check.py e2e --json OUT.json [--device cuda] [--lrs 1e-6 1e-5]
        [--strategies patch bucket] [--codec auto|host|device ...] [--versions 5]
        [--layers 28 --hidden 1536 --intermediate 8960 --heads 12 --kv-heads 2 --vocab 151936]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import fmt_bytes
from protocol.config import load_config
from protocol.errors import ConfigError
from protocol.state import resolve_state
from protocol.wire.checksum import state_digest
from protocol.wire.metadata import ModelMetadata
from receiver import PatchReceiver
from sender import PatchSender
from sender.plan import SyncPlan
from sender.version.patch import PatchBuilder

if TYPE_CHECKING:
    from benchmarks.rollout import RemoteReceivers
    from sender import Sender


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
        await builder.message(state, version, version - 1)
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
        "snapshot auto (default)": {},
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
    ratios = {}
    for gb in args.sizes_gb:
        for snapshot in ("cuda", "cpu"):
            build, floor = await build_time(gb, args.density, snapshot)
            ratios[(gb, snapshot)] = build / floor
            print(f"  {gb:>6.0f}GB {snapshot:>9} {build * 1e3:>8.1f}ms {floor * 1e3:>9.1f}ms {build / floor:>5.1f}x")
    top = max(args.sizes_gb)
    print(verdict(f"{top:g} GB build at {args.density:.0%} <= 3x the read floor (snapshot on the GPU)", ratios[(top, "cuda")], 3.0, "x")["line"])
    return 0


def verdict(target: str, measured: float | None, limit: float, unit: str) -> dict[str, Any]:
    """One target's verdict: its line (``VERDICT PASS|FAIL|NONE target: measured (limit)``) and its figures."""
    ok = measured is not None and measured <= limit
    shown = "-" if measured is None else (f"{measured * 1e3:.1f} ms" if unit == "s" and measured < 1 else f"{measured:.3g} {unit}")
    word = "NONE" if measured is None else "PASS" if ok else "FAIL"
    return {"target": target, "measured": measured, "limit": limit, "unit": unit, "pass": ok,
            "line": f"VERDICT {word} {target}: {shown} (limit {limit:g} {unit})"}


def e2e_verdicts(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The device path's end-to-end targets, from the runs that measure them: the default patch
    run at lr 1e-6 (snapshot auto, codec auto unless only another ran), the bucket run, the first bootstrap, every digest."""
    default = [r for r in runs if r["strategy"] == "patch" and r["lr"] == 1e-6 and r["snapshot"] == "auto"]
    patch = next((r for r in default if r["codec"] in (None, "auto")), default[0] if default else None)
    bucket = next((r for r in runs if r["strategy"] == "bucket"), None)
    m = patch["median"] if patch else {}
    apply = m["decode_s"] + m["commit_s"] if m.get("decode_s") is not None and m.get("commit_s") is not None else None
    dense = bucket["median"]["dense_bytes"] if bucket else None
    out = [
        verdict("patch lr 1e-6 end to end <= 50 ms", m.get("e2e_s"), 0.050, "s"),
        verdict("patch lr 1e-6 sync() <= 10 ms", m.get("sync_s"), 0.010, "s"),
        verdict("patch lr 1e-6 receiver decode + commit <= 10 ms", apply, 0.010, "s"),
        verdict(f"bucket sync() of {fmt_bytes(dense) if dense else '?'} <= 0.5 s", bucket["median"]["sync_s"] if bucket else None, 0.5, "s"),
        verdict("bootstrap of the receivers <= 5 s", runs[0]["bootstrap"]["s"] if runs else None, 5.0, "s"),
        verdict("digests equal (every run, version and receiver)", 0.0 if all(r["digests_equal"] for r in runs) else 1.0, 0.0, "differing"),
    ]
    return out


# -- e2e: the daemons, a Qwen2-1.5B-shaped model, receivers in their own processes -----------
TIMEOUT = 600.0  # a bootstrap or a version, acknowledged


def device_info(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device, "platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if device.startswith("cuda"):
        d = torch.device(device)
        props = torch.cuda.get_device_properties(d)
        info.update(name=torch.cuda.get_device_name(d), memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                    cuda=torch.version.cuda)
    else:
        info["name"] = f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return info


def git_info() -> dict[str, Any]:
    import subprocess

    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        status = subprocess.run([*git, "status", "--porcelain", "--", "protocol", "sender", "receiver"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    return {"commit": commit, "uncommitted": [line[3:] for line in status.stdout.splitlines()]}


def snapshot_place(sender: Sender) -> str | None:
    """Where the patch builder's snapshot went (``patch.snapshot_device``, ``auto`` by
    default: the GPU or pinned host memory, settled at the first receiver); None for buckets."""
    source = sender._trainer
    snapshot = getattr(None if source is None else source.builder, "snapshot", None)
    return None if snapshot is None else str(snapshot.device)


def sync_config(strategy: str, codec: str | None, snapshot: str = "auto") -> dict[str, Any]:
    if strategy == "patch":
        return {"type": "patch", "patch": {"codec": codec, "snapshot_device": snapshot}}
    return {"type": "bucket", "bucket": {"bucket_dtype": "bfloat16"}}


def bf16_view(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's tracked tensors (each storage once) as the receivers hold them."""
    state = resolve_state(model)
    return {k: state.tensors[k].detach().to(torch.bfloat16) if state.tensors[k].is_floating_point() else state.tensors[k].detach()
            for k in state.tracked if k not in state.aliases}


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return float(statistics.median(xs)) if xs else None


def _numeric_medians(dicts: list[dict[str, Any]]) -> dict[str, float | None]:
    """Each numeric key's median over ``dicts`` (new stats fields appear by themselves)."""
    keys = dict.fromkeys(k for d in dicts for k, v in d.items() if k != "version" and isinstance(v, (int, float)) and not isinstance(v, bool))
    return {k: _median([d.get(k) for d in dicts]) for k in keys}


def _slowest(stats: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Per numeric key, the largest over the receivers (the one the version waited for)."""
    present = [s for s in stats if s]
    keys = dict.fromkeys(k for s in present for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool))
    return {k: max(s[k] for s in present if isinstance(s.get(k), (int, float))) for k in keys}


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.1f}ms"


def _s(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}s"


async def digests(model: torch.nn.Module, receivers: RemoteReceivers, version: int) -> dict[str, Any]:
    """The trainer's bf16 digest and each receiver's (``state_digest``, xxh3 of names, dtypes,
    shapes and bytes); untimed."""
    trainer = await asyncio.to_thread(lambda: state_digest(bf16_view(model)))
    replies = await receivers.state_digests()
    theirs = [r["digest"] for r in replies]
    return {"trainer": trainer, "receivers": theirs, "receiver_versions": [r["version"] for r in replies],
            "equal": all(d == trainer for d in theirs) and all(r["version"] == version for r in replies)}


async def e2e_run(args: argparse.Namespace, shape: Any, lr: float, strategy: str, codec: str | None, snapshot: str = "auto") -> dict[str, Any]:
    """One lr, strategy, codec and snapshot place: a fresh trainer (same seed), sender and receivers."""
    from benchmarks import qwen2
    from benchmarks.rollout import RemoteReceivers
    from sender import Sender

    device = args.device
    cuda = device.startswith("cuda")
    model = qwen2.build(shape, device, torch.float32, seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator(device=device).manual_seed(args.seed + 1)
    config = sync_config(strategy, codec, snapshot)
    name = f"lr{lr:g}-{strategy}" + (f"-{codec}" if codec else "") + (f"-snap-{snapshot}" if strategy == "patch" and snapshot != "auto" else "")
    run: dict[str, Any] = {"name": name, "lr": lr, "strategy": strategy, "codec": codec, "snapshot": snapshot, "config": config}
    spec = {"kind": "qwen2", "shape": {k: getattr(shape, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "tied")},
            "dtype": "bfloat16", "device": device}
    sender = Sender("tcp://127.0.0.1:0", config, peer_timeout=300.0)
    receivers: RemoteReceivers | None = None
    try:
        await sender.start(model, version=0)
        spawned = time.perf_counter()
        receivers = await RemoteReceivers.start(spec, sender.endpoint, config, f"gpu-check-{name}", args.receivers)
        await sender.wait_for_receivers(args.receivers, timeout=TIMEOUT)
        await sender.wait_acked(0, timeout=TIMEOUT)
        wall = time.perf_counter() - spawned
        boot = await receivers.reports(0)
        own = [(b["applied_ns"] - r["started_ns"]) / 1e9 if b else None for b, r in zip(boot, receivers.ready)]
        check = await digests(model, receivers, 0)
        run["bootstrap"] = {
            "s": max((x for x in own if x is not None), default=None),  # the slower receiver: its start() to its bootstrap applied
            "per_receiver_s": own,
            "span_s": (max(b["applied_ns"] for b in boot if b) - min(r["started_ns"] for r in receivers.ready)) / 1e9 if all(boot) else None,
            "wall_s": wall,  # processes spawned (interpreter, imports, model built on the device) until both acknowledged
            "prepare_s": [r.get("prepare_s") for r in receivers.ready],  # before start(): kernels compiled or loaded (not in s)
            "receivers": [b["stats"] if b else None for b in boot],
            "digests": check,
        }
        place = run["snapshot_device"] = snapshot_place(sender)
        print(f"  {name}: bootstrap of {args.receivers} receivers {_s(run['bootstrap']['s'])} (start() to applied, the slower; "
              f"{wall:.2f}s from spawning them)  digests {'equal' if check['equal'] else 'DIFFER'}"
              f"{'' if place is None else '  snapshot on ' + place}", flush=True)
        run["warmup"], run["versions"] = [], []
        for version in range(1, args.warmup + args.versions + 1):
            loss = qwen2.train_step(model, optimizer, generator, args.batch, args.seq)
            if cuda:
                torch.cuda.synchronize()
            incidents = sum(int(p["resyncs"]) for p in sender.receivers.values()) + sum(receivers.reconnects)  # type: ignore[call-overload]
            started_ns, started = time.monotonic_ns(), time.perf_counter()
            stats = await sender.sync(model, version)
            sync_s = time.perf_counter() - started
            await sender.wait_acked(version, timeout=TIMEOUT)
            acked_s = time.perf_counter() - started
            await sender.flush()
            reports = await receivers.reports(version, timeout=60.0)
            incidents = sum(int(p["resyncs"]) for p in sender.receivers.values()) + sum(receivers.reconnects) - incidents  # type: ignore[call-overload]
            rstats = [r["stats"] if r else None for r in reports]
            slowest = _slowest(rstats)
            check = await digests(model, receivers, version)
            s = stats.as_dict()
            row = {
                "version": version, "loss": loss,
                "sync_s": sync_s,  # the awaited sync(): what blocks the trainer
                "e2e_s": (max(r["applied_ns"] for r in reports if r) - started_ns) / 1e9 if all(reports) else None,
                "e2e_acked_s": acked_s,  # until the sender had both acknowledgements
                "decode_s": slowest.get("decode_seconds"), "commit_s": slowest.get("apply_seconds"), "receive_s": slowest.get("receive_seconds"),
                "wire_bytes": s["wire_bytes"], "dense_bytes": s["dense_bytes"], "changed_fraction": s["changed_fraction"],
                "applied_as": sorted({(r["kind"] or "missing") if r else "missing" for r in reports}),
                "incidents": incidents,
                "sender": s, "receivers": rstats, "digests": check,
            }
            measured = version > args.warmup
            (run["versions"] if measured else run["warmup"]).append(row)
            print(f"  {name} v{version}{'' if measured else ' (warmup)'}: sync {_ms(sync_s)}  e2e {_ms(row['e2e_s'])} "
                  f"(acked {_ms(acked_s)})  decode {_ms(row['decode_s'])}  commit {_ms(row['commit_s'])}  "
                  f"wire {fmt_bytes(row['wire_bytes'])} of {fmt_bytes(row['dense_bytes'])} dense  "
                  f"changed {100 * row['changed_fraction']:.3g}%  as {'/'.join(row['applied_as'])}"
                  f"{f'  incidents {incidents}' if incidents else ''}  digests {'equal' if check['equal'] else 'DIFFER'}", flush=True)
    finally:
        if receivers is not None:
            await receivers.stop()
        await sender.close()
        del model, optimizer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    rows = run["versions"]
    run["median"] = {k: _median([r[k] for r in rows]) for k in
                     ("sync_s", "e2e_s", "e2e_acked_s", "decode_s", "commit_s", "receive_s", "wire_bytes", "dense_bytes", "changed_fraction")}
    run["median_sender_stats"] = _numeric_medians([r["sender"] for r in rows])
    run["median_receiver_stats"] = _numeric_medians([_slowest(r["receivers"]) for r in rows])  # the slower receiver's, per version
    run["digests_equal"] = run["bootstrap"]["digests"]["equal"] and all(r["digests"]["equal"] for r in run["warmup"] + rows)
    run["incidents"] = sum(r["incidents"] for r in rows)
    return run


async def e2e(args: argparse.Namespace) -> int:
    from benchmarks import qwen2

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"gpu_check e2e: --device {args.device}, but torch {torch.__version__} sees no CUDA device", file=sys.stderr)
        return 2
    shape = qwen2.Shape(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, heads=args.heads,
                        kv_heads=args.kv_heads, vocab=args.vocab, tied=not args.untied)
    info = device_info(args.device)
    started = time.perf_counter()
    print(f"gpu_check e2e on {info['name']}, torch {torch.__version__}: Qwen2-shaped {shape.parameters() / 1e9:.3g}B parameters "
          f"({shape.layers} layers, hidden {shape.hidden}, vocab {shape.vocab}), fp32 AdamW master -> {args.receivers} bf16 "
          f"receiver processes over tcp loopback; {args.warmup} warmup + {args.versions} measured versions a run", flush=True)
    runs = []
    for lr in args.lrs:
        for strategy in args.strategies:
            for codec in (args.codec if strategy == "patch" else [None]):
                for snapshot in (args.snapshot if strategy == "patch" else ["auto"]):
                    runs.append(await e2e_run(args, shape, lr, strategy, codec, snapshot))
    doc = {
        "benchmark": "gpu_check e2e",
        "device": info,
        "torch": torch.__version__,
        "command": "python benchmarks/gpu_check.py " + shlex.join(sys.argv[1:]),
        "argv": sys.argv,
        "config": {
            "model": shape.as_dict(), "trainer_dtype": "float32", "receiver_dtype": "bfloat16", "optimizer": "AdamW",
            "loss": "next-token cross entropy on random tokens", "batch": args.batch, "seq": args.seq, "seed": args.seed,
            "lrs": args.lrs, "strategies": args.strategies, "codecs": args.codec, "snapshots": args.snapshot,
            "versions": args.versions, "warmup": args.warmup,
            "receivers": args.receivers, "transport": "tcp loopback", "receiver_processes": "python -m benchmarks.rollout, one each",
        },
        "library": git_info(),
        "runs": runs,
        "first_bootstrap": runs[0]["bootstrap"] if runs else None,
        "digests_equal": all(r["digests_equal"] for r in runs),
        "notes": [
            "sync_s: the awaited Sender.sync() (what blocks the trainer); e2e_s: from sync()'s start until the later of the "
            "receivers' on_update hooks ran (their own report, time.monotonic_ns() in their processes, after a "
            "torch.cuda.synchronize() on CUDA); e2e_acked_s: until the sender held both acknowledgements",
            "decode_s / commit_s / receive_s: ApplyStats decode_seconds / apply_seconds / receive_seconds, the larger of the "
            "receivers'; sender and receivers: every field of SyncStats.as_dict() / ApplyStats.as_dict()",
            "bootstrap.s: per receiver from its Receiver.start() call to its bootstrap applied, the slower of them; span_s: "
            "the first start() to the last applied; wall_s: from spawning the processes to both acknowledged; prepare_s: "
            "each receiver's kernels compiled or loaded from numba's cache, before start() (in wall_s, not in s)",
            "median: over the measured versions (warmup apart); median_receiver_stats: of the slower receiver's figure each version",
            "digests: protocol.wire.checksum.state_digest of the trainer's tracked tensors cast to bf16 and of each receiver's",
        ],
        "wall_s": time.perf_counter() - started,
    }
    print(f"\n{'run':<30} {'sync':>9} {'e2e':>9} {'decode':>9} {'commit':>9} {'wire':>9} {'dense':>9} {'changed':>8} {'boot':>7}  digests")
    for r in runs:
        m = r["median"]
        changed = f"{100 * m['changed_fraction']:.3g}%" if m["changed_fraction"] is not None else "-"
        print(f"{r['name']:<30} {_ms(m['sync_s']):>9} {_ms(m['e2e_s']):>9} {_ms(m['decode_s']):>9} {_ms(m['commit_s']):>9} "
              f"{fmt_bytes(m['wire_bytes']):>9} {fmt_bytes(m['dense_bytes']):>9} {changed:>8} {_s(r['bootstrap']['s']):>7}  "
              f"{'equal' if r['digests_equal'] else 'DIFFER'}")
    print(f"(medians of {args.versions} measured versions; wall {doc['wall_s']:.1f}s)")
    doc["verdicts"] = e2e_verdicts(runs)
    for v in doc["verdicts"]:
        print(v["line"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        print(f"JSON: {args.json}")
    if not doc["digests_equal"]:
        print("gpu_check e2e: a receiver's weights differ from the trainer's", file=sys.stderr)
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    from benchmarks import qwen2

    default = qwen2.Shape()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--density", type=float, default=0.01)
    sub = p.add_subparsers(dest="command")
    e = sub.add_parser("e2e", help="the end-to-end daemon scenario (issue 35)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the trainer's and the receivers' models live (default: cuda when available, else cpu)")
    e.add_argument("--layers", type=int, default=default.layers)
    e.add_argument("--hidden", type=int, default=default.hidden)
    e.add_argument("--intermediate", type=int, default=default.intermediate)
    e.add_argument("--heads", type=int, default=default.heads)
    e.add_argument("--kv-heads", type=int, default=default.kv_heads)
    e.add_argument("--vocab", type=int, default=default.vocab)
    e.add_argument("--untied", action="store_true", help="an output head of its own (1.78B at Qwen2-1.5B's widths: the earlier H200 baseline)")
    e.add_argument("--snapshot", nargs="+", choices=["auto", "cuda", "cpu"], default=["auto"],
                   help="patch.snapshot_device for the patch runs; several: a patch run each")
    e.add_argument("--lrs", type=float, nargs="+", default=[1e-6, 1e-5])
    e.add_argument("--strategies", nargs="+", choices=["patch", "bucket"], default=["patch", "bucket"])
    e.add_argument("--codec", nargs="+", choices=["auto", "host", "device"], default=["auto"],
                   help="patch.codec for the patch runs; several: a patch run each")
    e.add_argument("--versions", type=int, default=5, help="measured versions per run")
    e.add_argument("--warmup", type=int, default=1, help="versions synced first, recorded apart (AdamW's first step moves "
                   "every weight; one-time costs)")
    e.add_argument("--receivers", type=int, default=2)
    e.add_argument("--batch", type=int, default=2)
    e.add_argument("--seq", type=int, default=64)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", type=Path, help="write every figure here")
    return p


if __name__ == "__main__":
    args = parser().parse_args()
    if args.command == "e2e":
        sys.exit(asyncio.run(e2e(args)))
    sys.exit(asyncio.run(main(args)))
