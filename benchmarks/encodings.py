"""Patch encodings against each other, a dense copy and the entropy floor, in one run.

For a bf16 tensor where a fraction ``p`` of elements moved by one ulp (the typical RL
step), each encoding's wire bytes are compared with the dense tensor and with the
information floor ``n*H(p)/8 + nnz/8`` bytes (positions, plus one sign bit per change);
encode and decode times are compared with a plain copy of the dense tensor (memory
bandwidth) measured in the same run. Absolute times are noisy; the ratios are the result.

    python benchmarks/encodings.py [--rows 2048 --cols 2048] [--out results.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse
from protocol.wire.framing import Encoding, Message, MessageType, ValueEncoding, decode_message, encode_message

CONFIGS = {
    "seed (coo+delta, raw, none)": PatchOptions(Encoding.COO_DELTA, ValueEncoding.RAW, Codec.NONE),
    "seed + lz4": PatchOptions(Encoding.COO_DELTA, ValueEncoding.RAW, Codec.LZ4),
    "coo+delta, xor, zstd": PatchOptions(Encoding.COO_DELTA, ValueEncoding.XOR, Codec.ZSTD),
    "gaps, xor, lz4": PatchOptions(Encoding.GAPS, ValueEncoding.XOR, Codec.LZ4),
    "gaps, xor, zstd": PatchOptions(Encoding.GAPS, ValueEncoding.XOR, Codec.ZSTD),
    "bitmap, xor, zstd": PatchOptions(Encoding.BITMAP, ValueEncoding.XOR, Codec.ZSTD),
    "auto, xor, zstd": PatchOptions(None, ValueEncoding.XOR, Codec.ZSTD),
    "ans, ulp (default)": PatchOptions(Encoding.ANS_GAPS, ValueEncoding.ULP, Codec.ZSTD),
}


def best_of(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def step(old: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    """``old`` with a fraction ``p`` of elements moved by +-1 ulp (bf16 bit pattern +-1)."""
    bits = old.view(torch.int16).clone()
    mask = torch.rand(old.shape, generator=generator) < p
    sign = torch.where(torch.rand(old.shape, generator=generator) < 0.5, 1, -1).to(torch.int16)
    bits[mask] += sign[mask]
    return bits.view(torch.bfloat16)


def encode(old: torch.Tensor, new: torch.Tensor, flat: torch.Tensor, options: PatchOptions) -> list[bytes]:
    """The PATCH message of one tensor, as the bytes that go on the wire."""
    entry = encode_sparse(0, flat, new.view(-1)[flat], old.view(-1)[flat], tuple(old.shape), options)
    tensors, frames = assemble([entry])
    msg = Message(MessageType.PATCH, version=1, base_version=0, tensors=tensors, frames=frames)
    return [bytes(f) for f in encode_message(msg)]


def decode(old: torch.Tensor, new: torch.Tensor, wire: list[bytes]) -> None:
    """Validate, decode and apply the message onto a copy of ``old``; checks the result."""
    msg = decode_message(wire)
    d = decode_entry(msg.tensors[0], msg.frames, tuple(old.shape), torch.bfloat16, torch.device("cpu"))
    target = old.clone()
    target.view(-1)[d.flat] = d.new_values(target.view(-1)[d.flat])
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))


def run(rows: int, cols: int, densities: list[float], repeat: int) -> dict[str, object]:
    generator = torch.Generator().manual_seed(0)
    old = (torch.randn(rows, cols, generator=generator) * 0.02).to(torch.bfloat16)
    dense_bytes = old.numel() * old.element_size()
    copy_seconds = best_of(lambda: old.clone(), repeat)
    results = []
    for p in densities:
        new = step(old, p, generator)
        flat = torch.nonzero((new.view(torch.int16) != old.view(torch.int16)).reshape(-1)).squeeze(1)
        h = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
        floor = old.numel() * h / 8 + flat.numel() / 8
        for name, options in CONFIGS.items():
            wire = encode(old, new, flat, options)
            wire_bytes = sum(len(f) for f in wire)
            results.append({
                "density": p,
                "encoding": name,
                "changed": flat.numel(),
                "wire_bytes": wire_bytes,
                "dense_over_wire": dense_bytes / wire_bytes,
                "wire_over_floor": wire_bytes / floor,
                "encode_over_copy": best_of(functools.partial(encode, old, new, flat, options), repeat) / copy_seconds,
                "decode_over_copy": best_of(functools.partial(decode, old, new, wire), repeat) / copy_seconds,
            })
    return {
        "benchmark": "encodings",
        "command": "python " + " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(), "torch": torch.__version__},
        "tensor": {"shape": [rows, cols], "dtype": "bfloat16", "dense_bytes": dense_bytes},
        "copy_seconds": copy_seconds,
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05, 0.2])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--out", type=Path, help="write the JSON here (default: stdout only)")
    args = p.parse_args()
    report = run(args.rows, args.cols, args.densities, args.repeat)
    print(f"{'density':>8} {'encoding':<28} {'wire':>10} {'dense/wire':>10} {'wire/floor':>10} {'enc/copy':>9} {'dec/copy':>9}")
    for r in report["results"]:  # type: ignore[attr-defined]
        print(f"{r['density']:>8.2f} {r['encoding']:<28} {r['wire_bytes']:>10} {r['dense_over_wire']:>10.1f} "
              f"{r['wire_over_floor']:>10.2f} {r['encode_over_copy']:>9.1f} {r['decode_over_copy']:>9.1f}")
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
