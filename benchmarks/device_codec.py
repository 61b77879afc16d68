"""The device codec's bytes against the entropy floor and the host codec, per workload.

    python -m benchmarks.device_codec --json OUT.json [--suite quick] [--repeat 3]

Workloads (``benchmarks.workloads``, the suite's sizes): real steps of its TinyLM, an fp32
AdamW master whose bf16 snapshot the rollouts hold, at lr 1e-6 and 1e-5 (the first step,
which moves every weight, is excluded); and synthetic bf16 tensors with a share of 0.1%,
0.3%, 1%, 3% and 10% of their elements moved by +-1..3 ulp. For each one step's changes
(found by a bitwise compare, as the library finds them):

* ``floor_bytes``: ``benchmarks.floor.entropy_floor_bits`` summed over the tensors;
* ``device_bytes``: ``protocol.codec.devicecodec`` payloads, one a changed tensor;
  ``device_run_bytes``: one payload a dtype, all its tensors' positions in one flat space
  (how a device sender codes a run of tensors);
* ``host_bytes``: the host codec's buffers (``tensorcodec.encode_sparse``, entropy coded:
  the packed ANS entry from 32 changes a tensor);
* each one's ratio to the floor, and encode / decode seconds on this machine (best of
  ``--repeat``; the device codec runs here on CPU tensors, where it need not win).

``scale`` times the device codec on 1M changes of a bf16 run (encode, decode with its
verdict). The issue-35 target is ``device_over_floor <= 1.4`` at every density.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import report
from benchmarks.encodings import best_of
from benchmarks.floor import entropy_floor_bits, tensor_change
from benchmarks.workloads import SUITES, RealWorkload, SyntheticWorkload, Workload, ulp_steps
from protocol.codec import devicecodec
from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse

TARGET = 1.4
DENSITIES = (0.001, 0.003, 0.01, 0.03, 0.10)
HOST_OPTIONS = PatchOptions(dense_above=1.0)  # entropy coded, never whole nor plain: the host codec's fewest bytes


@dataclass
class Change:
    """One tensor's step: positions and the old and new values there."""

    key: str
    shape: tuple[int, ...]
    flat: torch.Tensor
    old: torch.Tensor
    new: torch.Tensor
    floor_bits: float


def step_changes(workload: Workload) -> tuple[list[Change], int]:
    """The changes of one measured step of ``workload`` at the receivers' dtype, and its elements."""
    workload.setup()
    try:
        workload.step()  # AdamW's first step moves every weight by about lr: not a typical step
        old = workload.receiver_view()
        workload.step()
        new = workload.receiver_view()
    finally:
        workload.teardown()
    out = []
    for key, before in old.items():
        change = tensor_change(before, new[key])
        if change.changed:
            flat = change.flat
            out.append(Change(key, tuple(before.shape), flat, before.reshape(-1)[flat], new[key].reshape(-1)[flat], entropy_floor_bits(change)))
    return out, sum(t.numel() for t in old.values())


def device_roundtrip(flat: torch.Tensor, new: torch.Tensor, old: torch.Tensor, numel: int) -> int:
    """Payload bytes of the changes; checks the decode is bit-exact."""
    payload = devicecodec.encode(flat, new, old).payload
    decoded = devicecodec.decode(payload, flat.numel(), numel, new.dtype)
    if not (bool(decoded.ok) and torch.equal(decoded.flat, flat) and torch.equal(devicecodec.apply_differences(old, decoded.diffs), new)):
        raise AssertionError("device codec round trip is not exact")
    return payload.numel()


def runs(changes: list[Change]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """One (flat, new, old, numel) a dtype: its tensors' changes in one flat space, in order."""
    by_dtype: dict[torch.dtype, list[Change]] = {}
    for c in changes:
        by_dtype.setdefault(c.new.dtype, []).append(c)
    out = []
    for group in by_dtype.values():
        offsets, numel = [], 0
        for c in group:
            offsets.append(numel)
            numel += math.prod(c.shape)
        flat = torch.cat([c.flat + o for c, o in zip(group, offsets)])
        out.append((flat, torch.cat([c.new for c in group]), torch.cat([c.old for c in group]), numel))
    return out


def host_encode(c: Change) -> Any:
    return encode_sparse(0, c.flat, c.new, c.old, c.shape, HOST_OPTIONS)


def host_decode(c: Change, encoded: Any) -> None:
    tensors, frames = assemble([encoded])
    decoded = decode_entry(tensors[0], frames, c.shape, c.new.dtype, torch.device("cpu"))
    decoded.new_values(c.old)


def measure(name: str, kind: str, changes: list[Change], elements: int, repeat: int) -> dict[str, Any]:
    """Bytes and times of one workload's step."""
    floor = sum(c.floor_bits for c in changes) / 8
    numels = [math.prod(c.shape) for c in changes]
    device = sum(device_roundtrip(c.flat, c.new, c.old, n) for c, n in zip(changes, numels))
    run_list = runs(changes)
    run_bytes = sum(device_roundtrip(*r) for r in run_list)
    encoded = [host_encode(c) for c in changes]  # also compiles the host codec's kernels
    host = sum(e.wire_nbytes for e in encoded)
    payloads = [devicecodec.encode(c.flat, c.new, c.old).payload for c in changes]
    run_payloads = [devicecodec.encode(f, n, o).payload for f, n, o, _ in run_list]
    changed = sum(c.flat.numel() for c in changes)
    return {
        "workload": name,
        "kind": kind,
        "tensors": len(changes),
        "elements": elements,
        "changed": changed,
        "density": changed / elements,
        "floor_bytes": floor,
        "device_bytes": device,
        "device_over_floor": device / floor,
        "device_run_bytes": run_bytes,
        "device_run_over_floor": run_bytes / floor,
        "host_bytes": host,
        "host_over_floor": host / floor,
        "meets_target": device / floor <= TARGET and run_bytes / floor <= TARGET,
        "device_encode_s": best_of(lambda: [devicecodec.encode(c.flat, c.new, c.old) for c in changes], repeat),
        "device_decode_s": best_of(lambda: [bool(devicecodec.decode(p, c.flat.numel(), n, c.new.dtype).ok)
                                         for p, c, n in zip(payloads, changes, numels)], repeat),
        "device_run_encode_s": best_of(lambda: [devicecodec.encode(f, n, o) for f, n, o, _ in run_list], repeat),
        "device_run_decode_s": best_of(lambda: [bool(devicecodec.decode(p, f.numel(), m, n.dtype).ok)
                                             for p, (f, n, _, m) in zip(run_payloads, run_list)], repeat),
        "host_encode_s": best_of(lambda: [host_encode(c) for c in changes], repeat),
        "host_decode_s": best_of(lambda: [host_decode(c, e) for c, e in zip(changes, encoded)], repeat),
    }


def scale(changes: int, numel: int, repeat: int) -> dict[str, Any]:
    """Device encode and decode seconds of ``changes`` bf16 changes spread over ``numel`` elements."""
    gen = torch.Generator().manual_seed(0)
    flat = torch.randint(0, numel, (changes + changes // 20,), generator=gen).unique()[:changes]
    old = (torch.randn(flat.numel(), generator=gen) * 0.02).to(torch.bfloat16)
    new = (old.view(torch.int16) + ulp_steps(flat.numel(), gen)).view(torch.bfloat16)
    payload = devicecodec.encode(flat, new, old).payload
    device_roundtrip(flat, new, old, numel)
    return {
        "changes": flat.numel(),
        "elements": numel,
        "payload_bytes": payload.numel(),
        "bits_per_change": 8 * payload.numel() / flat.numel(),
        "encode_s": best_of(lambda: devicecodec.encode(flat, new, old), repeat),
        "decode_s": best_of(lambda: bool(devicecodec.decode(payload, flat.numel(), numel, torch.bfloat16).ok), repeat),
    }


def workloads(suite_name: str, densities: tuple[float, ...]) -> list[Workload]:
    suite = SUITES[suite_name]
    out: list[Workload] = [
        RealWorkload(f"real-bf16-lr{lr:g}", torch.bfloat16, lr, suite.model, measured_steps=1) for lr in (1e-6, 1e-5)
    ]
    out += [SyntheticWorkload(f"synthetic-{100 * d:g}%", d, suite.synthetic_shapes, measured_steps=1) for d in densities]
    return out


def run(suite: str, densities: tuple[float, ...], repeat: int, scale_changes: int) -> dict[str, Any]:
    started, load = time.perf_counter(), os.getloadavg()[0]
    results = []
    for w in workloads(suite, densities):
        changes, elements = step_changes(w)
        results.append(measure(w.name, w.kind, changes, elements, repeat))
        print(f"  {w.name}: {time.perf_counter() - started:.0f}s", file=sys.stderr, flush=True)
    return {
        "benchmark": "device_codec",
        "command": report.command("-m benchmarks.device_codec"),
        "machine": report.machine(load, device="cpu"),
        "suite": suite,
        "block": devicecodec.BLOCK,
        "target_device_over_floor": TARGET,
        "results": results,
        "all_meet_target": all(r["meets_target"] for r in results),
        "scale": scale(scale_changes, 50 * scale_changes, repeat) if scale_changes else None,
        "wall_s": time.perf_counter() - started,
    }


def table(doc: dict[str, Any]) -> str:
    rows = [f"{'workload':<20} {'density':>8} {'changed':>9} {'floor B':>10} {'device B':>10} {'/floor':>6} {'run/fl':>6} "
            f"{'host B':>10} {'/floor':>6} {'dev enc':>8} {'dev dec':>8} {'host enc':>8} {'host dec':>8}"]
    for r in doc["results"]:
        rows.append(
            f"{r['workload']:<20} {r['density']:>8.4f} {r['changed']:>9} {r['floor_bytes']:>10.0f} {r['device_bytes']:>10} "
            f"{r['device_over_floor']:>6.3f} {r['device_run_over_floor']:>6.3f} {r['host_bytes']:>10} {r['host_over_floor']:>6.3f} "
            f"{r['device_encode_s'] * 1e3:>6.1f}ms {r['device_decode_s'] * 1e3:>6.1f}ms "
            f"{r['host_encode_s'] * 1e3:>6.1f}ms {r['host_decode_s'] * 1e3:>6.1f}ms"
        )
    if s := doc["scale"]:
        rows.append(f"scale: {s['changes']} changes, {s['bits_per_change']:.2f} bits a change, "
                    f"encode {s['encode_s'] * 1e3:.0f} ms, decode {s['decode_s'] * 1e3:.0f} ms")
    rows.append(f"every workload within {doc['target_device_over_floor']}x of the floor: {doc['all_meet_target']}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_codec", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, help="write the result here")
    p.add_argument("--suite", choices=sorted(SUITES), default="quick")
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--scale", type=int, default=1_000_000, help="changes of the scale check (0: skip it)")
    args = p.parse_args(argv)
    doc = run(args.suite, tuple(args.densities), args.repeat, args.scale)
    print(table(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if doc["all_meet_target"] else 1


if __name__ == "__main__":
    sys.exit(main())
