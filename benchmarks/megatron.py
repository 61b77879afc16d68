"""A Megatron trainer's sync: ``ShardedSync(MegatronLayout)`` against gather-and-export (issue 59).

    .venv-megatron/bin/python -m benchmarks.megatron --json OUT.json [--layouts tp2 pp2 --hidden 768 --layers 4
        --vocab 32000 --intermediate 2048 --heads 12 --kv-heads 2 --seq 64 --versions 3]

Runs in the Megatron environment (``make megatron-env``; its shims and the bridge-built model:
``tests/megatron_env.py``, ``tests/megatron_ranks.py``). For each layout one spawn of gloo ranks (TP x PP)
builds a Qwen2 through Megatron-Bridge (fp32 parameters, weights loaded from a random
checkpoint) and trains it (real forward/backward and AdamW, ``train_step``). After each
step the same weights go out three ways, each from rank 0 over its own Sender to its own
receiver (a bf16 dict in Hugging Face names; the three live in one process of their own, so
the ranks' memory is the trainer's and the senders' alone):

* **ours**: ``ShardedSync(MegatronLayout(bridge, model)).sync``: every rank compares its own
  shard, the encoded changes move to rank 0, which publishes them; no export in a patch
  version (``exports`` counts the tensors the bridge yielded to the sync that version).
* **gather-and-export** (what verl and slime do): every rank runs
  ``bridge.export_hf_weights(model, cpu=True)`` (the all-gathers and the conversion) and
  rank 0 keeps the whole Hugging Face state dict, then (a) **dense**: sends it through an
  unsharded bucket Sender, and (b) **patch of export**: sends it through an unsharded patch
  Sender (``sender.sync(exported, version)``). One export serves both sends.

Per version: each rank's wall time (the ranks enter each phase together, after a barrier;
``*_slowest_s`` is the slowest rank, ``*_leader_s`` rank 0), each send's end to end (until
the receiver acknowledged), ``SyncStats.wire_bytes`` of each Sender, ``PartStats.group_bytes``
(what moved between ranks for ours; the export's all-gathers are not counted by anything
here), and each rank's peak resident memory above the phase's start (psutil, a thread
sampling every 2 ms): ours over its sync; dense over the export and the bucket send; patch
over the export and the patch send (the exported dict is live across both sends; rank 0's
figures for the sends, the other ranks' for the export alone, as they drop it at once).
``ru_maxrss_bytes_per_rank`` is each rank's ``ru_maxrss`` over the whole spawn (training
included). After each lr's last version every receiver must equal the bridge's export cast to
bf16 bit for bit (``equal``). Medians over the measured versions of each lr; the ranks share
this machine's cores with each other and with other work: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LRS = (1e-5, 1e-4)
WARMUP = 2  # versions before measuring: our receiver's bootstrap, then a first patch
RECEIVER_DTYPE = torch.bfloat16  # the receivers' (tests.megatron_sync's)
PATHS = ("ours", "dense", "patch")


def _ru_maxrss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class RssPeaks:
    """This process's resident set sampled by a thread every ``interval`` s; ``mark`` closes a
    segment and returns its peak (the sample at the mark included)."""

    def __init__(self, interval: float = 0.002) -> None:
        import psutil

        self._process, self._interval = psutil.Process(), interval
        self._lock = threading.Lock()
        self.start = self._rss()
        self._peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            rss = self._rss()
            with self._lock:
                self._peak = max(self._peak, rss)

    def mark(self) -> int:
        rss = self._rss()
        with self._lock:
            peak, self._peak = max(self._peak, rss), rss
        return peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@contextlib.contextmanager
def sampling() -> Iterator[RssPeaks]:
    peaks = RssPeaks()
    try:
        yield peaks
    finally:
        peaks.stop()


CONFIGS: dict[str, dict[str, Any]] = {
    "ours": {"weight_syncer": {"type": "patch"}},
    "dense": {"weight_syncer": {"type": "bucket", "bucket": {"bucket_dtype": "bfloat16"}}},  # bf16 on the wire, as verl sends
    "patch": {"weight_syncer": {"type": "patch"}},
}


def _receivers_main(endpoints: dict[str, str], names: dict[str, tuple[int, ...]], conn: Any) -> None:
    """The three rollouts, one process apart from the ranks (their memory is not the ranks'):
    each a bf16 dict in Hugging Face names, randomly initialised. ``conn`` receives the path of
    a saved expected state to compare against (answered with each path's differing keys), or
    None to stop."""
    sys.path.insert(0, str(ROOT))
    torch.set_num_threads(1)
    asyncio.run(_receivers(endpoints, names, conn))


async def _receivers(endpoints: dict[str, str], names: dict[str, tuple[int, ...]], conn: Any) -> None:
    from receiver import Receiver
    from tests.megatron_sync import differing

    async with contextlib.AsyncExitStack() as stack:
        held: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        starts = []
        for i, (path, endpoint) in enumerate(endpoints.items()):
            torch.manual_seed(100 + i)
            weights = {n: torch.randn(shape).to(RECEIVER_DTYPE) for n, shape in names.items()}
            receiver = Receiver(weights, endpoint, CONFIGS[path], identity=f"rollout-{path}")
            await stack.enter_async_context(receiver)
            held[path] = (receiver, weights)
            starts.append(asyncio.ensure_future(receiver.start(timeout=600)))
        while (command := await asyncio.to_thread(conn.recv)) is not None:
            await asyncio.gather(*starts)  # a start that failed says why here
            expected = torch.load(command)
            found = {}
            for path, (receiver, weights) in held.items():
                async with receiver.reading():
                    found[path] = differing(weights, expected)
            conn.send(found)


async def _run(
    rank: int, world: int, hf_dir: str, hidden: int, tokens: torch.Tensor, versions: int, layout_: Any, scratch: str,
) -> dict[str, Any] | None:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from sender import Sender
    from sender.sharded.megatron import MegatronLayout
    from sender.sharded.sync import ShardedSync
    from tests.megatron_ranks import build, train_step
    from tests.megatron_sync import exported as export_bf16

    bridge, model = build(hf_dir, layout_, False)
    layout = MegatronLayout(bridge, model)
    sharded = ShardedSync(layout, timeout=600)
    leader = rank == 0
    records: list[dict[str, Any]] = []
    checks: dict[str, Any] = {}
    exported0 = {n: t.detach().clone() for n, t in bridge.export_hf_weights(model, cpu=True, show_progress=False)}
    names = {n: tuple(t.shape) for n, t in exported0.items()}
    dense_bf16_bytes = sum(t.numel() * 2 for t in exported0.values())
    rollouts: Any = None
    async with contextlib.AsyncExitStack() as stack:
        senders: dict[str, Any] = {}
        if leader:
            senders["ours"] = Sender("tcp://127.0.0.1:0", CONFIGS["ours"], trainable_keys=sharded.trainable_keys)
            senders["dense"] = Sender("tcp://127.0.0.1:0", CONFIGS["dense"])
            senders["patch"] = Sender("tcp://127.0.0.1:0", CONFIGS["patch"])
            for s in senders.values():
                await stack.enter_async_context(s)
        await sharded.start(senders.get("ours"), version=0)
        if leader:
            await senders["dense"].start(exported0, version=0)
            await senders["patch"].start(exported0, version=0)
            ctx = mp.get_context("spawn")
            conn, child = ctx.Pipe()
            rollouts = ctx.Process(target=_receivers_main, args=({p: senders[p].endpoint for p in PATHS}, names, child), daemon=True)
            rollouts.start()
            stack.callback(rollouts.kill)
            for path in ("dense", "patch"):
                await senders[path].wait_for_receivers(1, timeout=600)
            deadline = time.monotonic() + 600
            while not senders["ours"].bootstrap_wanted:  # ours bootstraps at the next version
                if not rollouts.is_alive() or time.monotonic() > deadline:
                    raise RuntimeError("our receiver never asked for a bootstrap")
                await asyncio.sleep(0.01)
        del exported0
        version = 0
        for lr_index, lr in enumerate(LRS):
            count = versions + (WARMUP if lr_index == 0 else 0)
            for i in range(count):
                version += 1
                train_step(model, tokens, hidden, lr=lr)
                row: dict[str, Any] = {"lr": lr, "version": version}
                # -- ours
                dist.barrier()
                with sampling() as mem:
                    started = time.perf_counter()
                    stats = await sharded.sync(senders.get("ours"), version)
                    sync_s = time.perf_counter() - started
                    if leader:
                        await senders["ours"].flush()
                        await senders["ours"].wait_acked(version, timeout=600)
                        row["ours_e2e_s"] = time.perf_counter() - started
                    ours_peak = mem.mark() - mem.start
                exports = len(sharded.stats.last)
                if leader:
                    assert stats is not None
                    part = sharded.part_stats
                    row.update(ours_wire_bytes=stats.wire_bytes, ours_changed_elements=stats.changed_elements,
                               ours_group_bytes=part.group_bytes if part is not None and part.version == version else None)
                # -- gather-and-export, then (a) dense and (b) patch of the export
                dist.barrier()
                with sampling() as mem:
                    started = time.perf_counter()
                    exported = dict(bridge.export_hf_weights(model, cpu=True, show_progress=False))
                    export_s = time.perf_counter() - started
                    export_peak = mem.mark()
                    if leader:
                        for path in ("dense", "patch"):
                            begun = time.perf_counter()
                            sent = await senders[path].sync(exported, version)
                            await senders[path].flush()
                            await senders[path].wait_acked(version, timeout=600)
                            row[f"{path}_send_s"] = time.perf_counter() - begun
                            row[f"{path}_wire_bytes"] = sent.wire_bytes
                            row[f"{path}_peak_bytes"] = max(export_peak, mem.mark()) - mem.start
                        row["patch_changed_elements"] = sent.changed_elements
                    del exported
                    export_only_peak = export_peak - mem.start
                per_rank: list[Any] = [None] * world
                dist.all_gather_object(per_rank, {"sync_s": sync_s, "export_s": export_s, "ours_peak": ours_peak,
                                                  "export_peak": export_only_peak, "exports": exports})
                if i == count - 1:  # the receivers against the bridge's export (every rank exports)
                    expected = export_bf16(bridge, model)
                    if leader:
                        saved = str(Path(scratch, "expected.pt"))
                        torch.save(expected, saved)
                        conn.send(saved)
                        if not await asyncio.to_thread(conn.poll, 600):
                            raise RuntimeError("the receivers' process did not answer")
                        checks[str(lr)] = conn.recv()
                    del expected
                if leader and i >= count - versions:
                    row.update(sync_s=[r["sync_s"] for r in per_rank], export_s=[r["export_s"] for r in per_rank],
                               ours_peak_bytes=[r["ours_peak"] for r in per_rank],
                               export_peak_bytes=[r["export_peak"] for r in per_rank],
                               exports=[r["exports"] for r in per_rank])
                    records.append(row)
                    print(json.dumps(row), flush=True)
        if leader:
            conn.send(None)
            await asyncio.to_thread(rollouts.join, 60)
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, _ru_maxrss_bytes())
    if not leader:
        return None
    return {"records": records, "checks": checks, "peak_rss": peaks, "dense_bf16_bytes": dense_bf16_bytes, "hf_tensors": len(names)}


def _worker(
    rank: int, world: int, port: int, hf_dir: str, hidden: int, tokens: torch.Tensor, versions: int, layout: Any, out: str,
) -> None:
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    from tests.megatron_ranks import init_rank

    init_rank(rank, world, port)
    try:
        result = asyncio.run(_run(rank, world, hf_dir, hidden, tokens, versions, layout, str(Path(out).parent)))
        if result is not None:
            Path(out).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def summarize(spawn: dict[str, Any], lr: float) -> dict[str, Any]:
    rows = [r for r in spawn["records"] if r["lr"] == lr]
    med = statistics.median
    found = spawn["checks"][str(lr)]
    out: dict[str, Any] = {
        "lr": lr, "versions": len(rows),
        "ours_slowest_s": med(max(r["sync_s"]) for r in rows), "ours_leader_s": med(r["sync_s"][0] for r in rows),
        "ours_e2e_s": med(r["ours_e2e_s"] for r in rows),
        "export_slowest_s": med(max(r["export_s"]) for r in rows), "export_leader_s": med(r["export_s"][0] for r in rows),
        "dense_e2e_s": med(r["export_s"][0] + r["dense_send_s"] for r in rows),
        "patch_e2e_s": med(r["export_s"][0] + r["patch_send_s"] for r in rows),
        "ours_wire_bytes": med(r["ours_wire_bytes"] for r in rows), "ours_group_bytes": med(r["ours_group_bytes"] for r in rows),
        "dense_wire_bytes": med(r["dense_wire_bytes"] for r in rows), "patch_wire_bytes": med(r["patch_wire_bytes"] for r in rows),
        "dense_bf16_bytes": spawn["dense_bf16_bytes"],
        "changed_elements": med(r["ours_changed_elements"] for r in rows),
        "ours_exports_per_version": max(max(r["exports"]) for r in rows),
        "ours_peak_bytes_per_rank": [max(r["ours_peak_bytes"][k] for r in rows) for k in range(len(rows[0]["sync_s"]))],
        "export_peak_bytes_per_rank": [max(r["export_peak_bytes"][k] for r in rows) for k in range(len(rows[0]["sync_s"]))],
        "dense_peak_bytes_leader": max(r["dense_peak_bytes"] for r in rows),
        "patch_peak_bytes_leader": max(r["patch_peak_bytes"] for r in rows),
        "equal": {path: not diff for path, diff in found.items()},
        "differing": found,
        "per_version": rows,
    }
    out["ratios"] = {
        "ours_slowest_over_export_slowest": out["ours_slowest_s"] / out["export_slowest_s"],
        "ours_e2e_over_dense_e2e": out["ours_e2e_s"] / out["dense_e2e_s"],
        "ours_e2e_over_patch_e2e": out["ours_e2e_s"] / out["patch_e2e_s"],
        "ours_wire_over_dense_bf16": out["ours_wire_bytes"] / out["dense_bf16_bytes"],
        "ours_wire_over_dense_wire": out["ours_wire_bytes"] / out["dense_wire_bytes"],
        "ours_wire_over_patch_wire": out["ours_wire_bytes"] / out["patch_wire_bytes"],
        "ours_group_over_ours_wire": out["ours_group_bytes"] / out["ours_wire_bytes"],
        "ours_leader_peak_over_dense_leader_peak": out["ours_peak_bytes_per_rank"][0] / max(out["dense_peak_bytes_leader"], 1),
        "ours_leader_peak_over_patch_leader_peak": out["ours_peak_bytes_per_rank"][0] / max(out["patch_peak_bytes_leader"], 1),
    }
    return out


def parse_layout(name: str, layout: Any) -> Any:
    """``tp2``, ``pp2``, ``tp2pp2`` as a ``tests.megatron_ranks.Layout``."""
    found = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?", name)
    if found is None or not name:
        raise SystemExit(f"a layout is tpN, ppN or tpNppM, got {name!r}")
    return layout(tp=int(found[1] or 1), pp=int(found[2] or 1))


def table(runs: list[dict[str, Any]]) -> str:
    mb, mib = 1e6, 2**20
    lines = ["| layout | lr | path | slowest rank s | leader s | e2e s | wire MB | between ranks MB | exports/version "
             "| peak RSS above start, MiB (rank 0, rank 1..) | bit-exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        ours_mem = ", ".join(f"{b / mib:.0f}" for b in r["ours_peak_bytes_per_rank"])
        others = ", ".join(f"{b / mib:.0f}" for b in r["export_peak_bytes_per_rank"][1:])
        lines.append(f"| {r['layout']} | {r['lr']:g} | ours | {r['ours_slowest_s']:.3f} | {r['ours_leader_s']:.3f} | {r['ours_e2e_s']:.3f} | "
                     f"{r['ours_wire_bytes'] / mb:.2f} | {r['ours_group_bytes'] / mb:.2f} | {r['ours_exports_per_version']} | "
                     f"{ours_mem} | {r['equal']['ours']} |")
        for path in ("dense", "patch"):
            lines.append(f"| {r['layout']} | {r['lr']:g} | export + {path} | {r['export_slowest_s']:.3f} (export) | "
                         f"{r['export_leader_s']:.3f} (export) | "
                         f"{r[path + '_e2e_s']:.3f} | {r[path + '_wire_bytes'] / mb:.2f} | (all-gathers) | all | "
                         f"{r[path + '_peak_bytes_leader'] / mib:.0f}, {others} | {r['equal'][path]} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.megatron", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--layouts", nargs="+", default=["tp2", "pp2"], help="parallel layouts, one spawn each: tpN, ppN or tpNppM")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens in each training step's one sequence")
    p.add_argument("--versions", type=int, default=3, help="measured versions per lr")
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from tests.megatron_ranks import Layout, Tiny, free_port, save_tiny_hf

    started = time.perf_counter()
    layouts = {name: parse_layout(name, Layout) for name in args.layouts}
    tiny = Tiny(layers=args.layers, vocab=args.vocab, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                intermediate=args.intermediate)
    tokens = torch.randint(0, args.vocab, (1, args.seq + 1), generator=torch.Generator().manual_seed(1))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    runs, peaks, hf_tensors = [], {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp, "hf")
        checkpoint = save_tiny_hf(hf_dir, tiny)
        params = sum(t.numel() for t in checkpoint.values())
        del checkpoint
        for name, layout in layouts.items():
            out = Path(tmp, name, "out.json")
            out.parent.mkdir()
            mp.start_processes(_worker, args=(layout.world, free_port(), str(hf_dir), args.hidden, tokens, args.versions, layout, str(out)),
                               nprocs=layout.world, start_method="spawn")
            spawn = json.loads(out.read_text())
            runs += [{"layout": name, "tp": layout.tp, "pp": layout.pp, "ranks": layout.world, **summarize(spawn, lr)} for lr in LRS]
            peaks[name], hf_tensors = spawn["peak_rss"], spawn["hf_tensors"]
    doc = {
        "benchmark": "megatron",
        "command": ".venv-megatron/bin/python -m benchmarks.megatron " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
                    "megatron_core": metadata.version("megatron-core"), "megatron_bridge": metadata.version("megatron-bridge"),
                    "note": "gloo ranks on CPU; this machine's cores are shared between the ranks and with other work"},
        "layouts": args.layouts, "params_dtype": "float32", "receivers": "bf16 dicts in HF names, one process beside the ranks",
        "model": {"family": "Qwen2", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "intermediate": args.intermediate,
                  "heads": args.heads, "kv_heads": args.kv_heads, "params": params, "hf_tensors": hf_tensors, "seq": args.seq},
        "lrs": list(LRS), "warmup_versions": WARMUP, "measured_versions_per_lr": args.versions,
        "ru_maxrss_bytes_per_rank": peaks, "runs": runs,
        "equal": all(all(r["equal"].values()) for r in runs), "wall_s": time.perf_counter() - started,
    }
    args.json.write_text(json.dumps(doc, indent=2))
    print(table(runs))
    for r in runs:
        print(f"{r['layout']} lr {r['lr']:g}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))
    print(f"every receiver equal to the bridge's export (bf16): {doc['equal']}; wall {doc['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
