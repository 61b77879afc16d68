"""The receiver's apply against a plain ``index_put_``, on a real patch, in one run.

    python -m benchmarks.apply [--lr 1e-6 1e-5] [--repeat 7] [--json OUT.json]

A TinyLM of ~24M parameters (vocab 16384, dim 512, 5 layers; fp32 master, AdamW) syncs to a
bf16 receiver through the real strategies (``sender.make_sender`` / ``receiver.make_receiver``
over an in-memory channel). After a warm-up step, one step's PATCH (its parts) is captured and
applied again and again to the receiver's state of the version before it, timing:

* ``weightsync``: ``decode_message`` of each part's frames, then per tensor ``decode_entry``
  and ``StagedUpdate.stage`` (the receiver's ``_decode``, on its codec pool) and ``commit``:
  what a receiver does from the frames to written weights;
* ``weightsync_serial``: the same on one thread (``WEIGHTSYNC_CODEC_THREADS=1``'s path);
* ``weightsync_commit``: the commit alone, of updates staged beforehand: the only step that
  holds the model (readers wait for it); decoding and staging run before, beside them;
* ``index_put``: what a sender of raw indices and values (RLinf's ``sparse_nccl`` format)
  leaves its receiver to do: ``target.view(-1).index_put_((flat,), values)`` per tensor, with
  the int64 indices and bf16 values already in memory (nothing decoded, nothing checked);
* ``seed``: RLinf's patch apply from its own format (``benchmarks.floor``'s
  ``seed_format_bytes``: the 2-D COO view, rows and cols delta-encoded, each in the smallest
  unsigned dtype that holds it, raw bf16 values): widen to int64, undo the deltas in a few
  torch passes (``seed_positions``: cumsums, no checks), then ``index_put_`` per tensor.

Every path ends bit-identical to the trainer (checked). ``ratio`` is weightsync / index_put
(``ratio_serial``, ``ratio_commit`` likewise), ``ratio_seed`` weightsync / seed.
Times are medians of ``--repeat``, each from a restored copy of the state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.floor import unsigned_width
from examples.tiny_model import TinyLM, train_step
from protocol.codec.coo import coo_shape, delta_encode, split_rows_cols

MODEL = {"vocab": 16384, "dim": 512, "heads": 8, "layers": 5, "context": 64}


class _Pipe:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self.sent: list[list[bytes]] = []

    async def send(self, frames: Sequence[Any]) -> None:
        copied = [bytes(f) for f in frames]
        self.sent.append(copied)
        await self.queue.put(copied)

    async def recv(self) -> list[bytes]:
        return await self.queue.get()


def _timed(fn: Callable[[], Any], restore: Callable[[], Any], repeat: int) -> dict[str, float]:
    restore()
    fn()  # JIT, first touch
    times = []
    for _ in range(repeat):
        restore()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) * 1e-9)
    return {"median_s": statistics.median(times), "best_s": min(times)}


def seed_buffers(flat: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """RLinf's rows and cols of sorted ``flat``: delta-encoded, each in the smallest unsigned
    dtype that holds its largest entry (what its sender puts on the wire, ``floor.seed_format_bytes``)."""
    drows, dcols = delta_encode(*split_rows_cols(flat, tuple(shape)))
    return _narrowest(drows), _narrowest(dcols)


def seed_positions(drows: torch.Tensor, dcols: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Flat int64 positions from RLinf's delta-encoded rows and cols, in as few torch passes
    as it takes (``coo.delta_decode`` less its checks): a row's cols are deltas after its first,
    so each col is the cumsum less that sum at its row's start; the starts' sums never
    decrease (the deltas are unsigned), so a running max carries each row's forward."""
    rows, dc = torch.cumsum(drows.long(), 0), dcols.long()
    csum = torch.cumsum(dc, 0)
    starts = drows != 0
    starts[0] = True
    base = torch.cummax(torch.where(starts, csum - dc, 0), 0).values
    return rows * coo_shape(tuple(shape))[1] + csum - base


def _narrowest(t: torch.Tensor) -> torch.Tensor:
    return t.to({1: torch.uint8, 2: torch.uint16, 4: torch.uint32, 8: torch.int64}[unsigned_width(int(t.max()))])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]) if t.is_floating_point() else t


async def case(lr: float, repeat: int, config: dict[str, Any], shape: dict[str, int] = MODEL) -> dict[str, Any]:
    import receiver
    import sender
    from protocol.codec import parallel
    from protocol.wire.framing import MessageType, decode_message
    from receiver.apply.commit import commit

    torch.manual_seed(0)
    model = TinyLM(**shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(1234)
    rmodel = TinyLM(**shape).to(torch.bfloat16)
    s, r = sender.make_sender(config), receiver.make_receiver(config)
    to_r, to_s = _Pipe(), _Pipe()
    await asyncio.gather(s.init_sender(model, to_r.send, to_s.recv), r.init_receiver(rmodel, to_r.recv, to_s.send))
    version = 0
    for _ in range(2):  # AdamW's first step moves every weight; the second is the first typical one
        train_step(model, optimizer, generator)
        version += 1
        await s.sync(model, to_r.send, version)
        await r.apply(rmodel, to_r.recv)
    before = {k: v.detach().clone() for k, v in rmodel.state_dict().items()}
    train_step(model, optimizer, generator)
    start = len(to_r.sent)
    await s.sync(model, to_r.send, version + 1)
    parts = to_r.sent[start:]  # the version's PATCH parts (patch.part_bytes)
    wanted = {k: v.detach().to(before[k].dtype) for k, v in model.state_dict().items()}
    targets = r.targets(rmodel)
    keys = r.metadata.keys
    by_name = dict(zip(keys, targets))

    def restore() -> None:
        with torch.no_grad():
            for k, t in by_name.items():
                t.copy_(before[k])

    def stage() -> list[Any]:
        updates = []
        for frames in parts:
            msg = decode_message(frames)
            assert msg.type is MessageType.PATCH
            updates += r._decode(msg, targets)
        return updates

    def weightsync() -> None:
        commit(targets, stage(), r.aliases)

    # index_put_'s inputs: the same changes, as raw int64 indices and new values
    raw = []
    for k, t in by_name.items():
        flat = torch.nonzero(bits(before[k]).reshape(-1) != bits(wanted[k]).reshape(-1)).squeeze(1)
        if flat.numel():
            raw.append((t, flat, wanted[k].reshape(-1)[flat].clone()))

    def index_put() -> None:
        with torch.no_grad():
            for t, flat, values in raw:
                t.view(-1).index_put_((flat,), values)

    seeded = [(t, *seed_buffers(flat, t.shape), values) for t, flat, values in raw]

    def seed() -> None:
        with torch.no_grad():
            for t, drows, dcols, values in seeded:
                t.view(-1).index_put_((seed_positions(drows, dcols, t.shape),), values)

    def exact() -> bool:
        return all(torch.equal(bits(t), bits(wanted[k])) for k, t in by_name.items())

    out: dict[str, Any] = {"lr": lr, "changed": sum(f.numel() for _, f, _ in raw),
                           "elements": sum(t.numel() for t in by_name.values()), "tensors_changed": len(raw),
                           "wire_bytes": sum(len(f) for frames in parts for f in frames), "parts": len(parts)}
    out["dense_tensors"] = sum(e.encoding.name == "DENSE" for frames in parts for e in decode_message(frames).tensors)
    out["weightsync"] = _timed(weightsync, restore, repeat)
    assert exact(), "weightsync's apply is not bit-exact"
    restore()
    staged = stage()  # of the version before, as restore leaves it: what a receiver holds before its commit
    out["weightsync_commit"] = _timed(lambda: commit(targets, staged, r.aliases), restore, repeat)
    assert exact(), "weightsync's commit is not bit-exact"
    saved = parallel.WORKERS
    parallel.WORKERS = 1
    try:
        out["weightsync_serial"] = _timed(weightsync, restore, repeat)
    finally:
        parallel.WORKERS = saved
    assert exact()
    out["index_put"] = _timed(index_put, restore, repeat)
    assert exact(), "index_put's apply is not bit-exact"
    out["seed"] = _timed(seed, restore, repeat)
    assert exact(), "RLinf's apply is not bit-exact"
    out["seed_bytes"] = sum(sum(b.numel() * b.element_size() for b in bufs) for _, *bufs in seeded)
    out["ratio"] = out["weightsync"]["median_s"] / out["index_put"]["median_s"]
    out["ratio_seed"] = out["weightsync"]["median_s"] / out["seed"]["median_s"]
    out["ratio_serial"] = out["weightsync_serial"]["median_s"] / out["index_put"]["median_s"]
    out["ratio_commit"] = out["weightsync_commit"]["median_s"] / out["index_put"]["median_s"]
    out["ns_per_change"] = out["weightsync_serial"]["median_s"] * 1e9 / max(1, out["changed"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.apply", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--dense-above", default="auto", help="patch.dense_above: auto, a share, or JSON")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    dense = args.dense_above if args.dense_above == "auto" else json.loads(args.dense_above)
    config: dict[str, Any] = {"type": "patch", "patch": {"dense_above": dense}}
    results = [asyncio.run(case(lr, args.repeat, config)) for lr in args.lr]
    for r in results:
        print(f"lr {r['lr']:g}: {r['changed']:,} of {r['elements']:,} changed ({r['tensors_changed']} tensors, {r['dense_tensors']} dense), "
              f"wire {r['wire_bytes']:,} B; weightsync {r['weightsync']['median_s'] * 1e3:.1f} ms "
              f"(serial {r['weightsync_serial']['median_s'] * 1e3:.1f} ms, {r['ns_per_change']:.1f} ns/change), "
              f"index_put {r['index_put']['median_s'] * 1e3:.1f} ms: ratio {r['ratio']:.2f} (serial {r['ratio_serial']:.2f}); "
              f"RLinf's apply ({r['seed_bytes']:,} B) {r['seed']['median_s'] * 1e3:.1f} ms: {r['ratio_seed']:.2f}x; "
              f"the commit alone (what holds the model) {r['weightsync_commit']['median_s'] * 1e3:.1f} ms: {r['ratio_commit']:.2f}x")
    if args.json:
        doc = {"command": "python -m benchmarks.apply " + " ".join(sys.argv[1:] if argv is None else argv), "model": MODEL,
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_average": os.getloadavg(), "results": results}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
