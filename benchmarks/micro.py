"""Micro-benchmarks of the codec's hot kernels, one process, no sockets.

    python -m benchmarks.micro [--only mark collect ...] [--repeat 30] [--json OUT.json]

Each case reports the median and the best of ``--repeat`` timed calls (after one
untimed call that compiles or loads the kernels). ``mark_serial`` / ``mark_parallel``
call the compare kernel of ``sender.diff.fastdiff`` directly (it does not write the
snapshot); ``diff`` is ``diff_and_update`` on a fresh snapshot copy (mark, collect and
the snapshot update); ``build`` the sender's whole compare of the suites' real models, against
the read floor; ``encode_tensor`` / ``decode_tensor`` are one entropy-coded
tensor's full codec path (``encode_sparse`` / ``decode_entry``), ``scaling`` the same at
1 to 300k changes (per change: the slope at the top; per tensor: at 1 change; each against
issue 14's 20 us a tensor + 10 ns a change), ``packed_encode`` / ``packed_decode`` the
one-call kernels an entropy-coded tensor goes through (``protocol.codec.packed``;
``packed_decode_onto`` decodes straight to the new values, as the receiver stages them, against
``packed_decode+gather_add``, the differences and then a pass adding them; ``onto`` the two ways
it adds them, for the density it chooses by), and
``rice_parameter``, ``pack_entry`` and the rANS kernels their parts. ``header`` is ``decode_message`` and
``peek_type`` of a 300-tensor patch; ``recv`` receives such a message (~2,100 frames) over
TCP loopback with ``DealerSocket.recv`` (one await a message) and with one await a frame
(``protocol.wire.limits.read_bounded``, as the receiver did before), timed from when the whole
message is queued. Absolute times depend on the machine and its load; compare figures
taken in the same run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def timed(fn: Callable[[], Any], repeat: int, setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Median and best wall time of ``fn`` in seconds; ``setup`` runs untimed before each call."""
    if setup is not None:
        setup()
    fn()  # compile / load from numba's cache, fault the pages in
    times = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) * 1e-9)
    return {"median_s": statistics.median(times), "best_s": min(times)}


def ulp_step(old: torch.Tensor, density: float, seed: int = 0) -> torch.Tensor:
    """``old`` (bf16) with a fraction ``density`` of its elements moved by +-1 ulp."""
    g = torch.Generator().manual_seed(seed)
    bits = old.view(torch.int16).clone()
    mask = torch.rand(old.shape, generator=g) < density
    sign = torch.where(torch.rand(old.shape, generator=g) < 0.5, 1, -1).to(torch.int16)
    bits[mask] += sign[mask]
    return bits.view(torch.bfloat16)


def mark_cases(n: int, repeat: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {}
    for label, cur in (("fp32->bf16", torch.randn(n, generator=g)), ("bf16->bf16", torch.randn(n, generator=g).to(torch.bfloat16))):
        out.update(_mark_case(label, cur, repeat))
    return out


def _mark_case(label: str, cur: torch.Tensor, repeat: int) -> dict[str, Any]:
    from sender.diff import fastdiff

    n = cur.numel()
    snapshot = ulp_step(cur.to(torch.bfloat16), 0.02)
    rounding = cur.dtype != snapshot.dtype
    cur_u, snap_u = fastdiff._bits(cur), fastdiff._bits(snapshot)
    marks = np.empty(-(-n // 64), dtype=np.uint64)
    counts = np.empty(-(-marks.size // fastdiff.CHUNK_WORDS), dtype=np.int64)
    out: dict[str, Any] = {}
    for parallel in (False, True):
        mark = fastdiff._KERNELS[parallel].mark
        r = timed(functools.partial(mark, cur_u, snap_u, rounding, marks, counts), repeat)
        r["ns_per_element"] = r["median_s"] * 1e9 / n
        out[f"mark_{'parallel' if parallel else 'serial'} {label} n={n}"] = r
    # the whole diff (mark, collect, snapshot update) through the public entry point
    work = snapshot.clone()
    r = timed(lambda: fastdiff.diff_and_update(cur, work), repeat, setup=lambda: work.copy_(snapshot))
    r["ns_per_element"] = r["median_s"] * 1e9 / n
    out[f"diff {label} n={n} (dispatch {'parallel' if n >= fastdiff.PARALLEL_MIN else 'serial'})"] = r
    return out


def codec_cases(n: int, density: float, repeat: int) -> dict[str, Any]:
    from protocol.codec import entropy, packed, rans
    from protocol.codec.positions import gaps_of
    from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse, pack_entry, sparse_buffers
    from protocol.wire.framing import Message, MessageType, decode_message, encode_message
    from receiver.apply import kernels

    g = torch.Generator().manual_seed(2)
    old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    new = ulp_step(old, density, seed=3)
    flat = torch.nonzero(new.view(torch.int16) != old.view(torch.int16)).squeeze(1)
    nnz = flat.numel()
    newv, oldv = new[flat], old[flat]
    options = PatchOptions()
    shape = (n,)
    out: dict[str, Any] = {}

    def case(name: str, fn: Callable[[], Any]) -> None:
        r = timed(fn, repeat)
        r["nnz"] = nnz
        out[f"{name} n={n} nnz={nnz}"] = r

    gaps = gaps_of(flat)
    case("rice_parameter", lambda: entropy.rice_parameter(gaps))
    case("encode_gaps", lambda: entropy.encode_gaps(gaps))
    diffs = entropy.ulp_differences(newv, oldv)
    case("encode_values", lambda: entropy.encode_values(diffs))
    enc, vals, buffers = sparse_buffers(flat, newv, oldv, shape, options)
    case("sparse_buffers", lambda: sparse_buffers(flat, newv, oldv, shape, options))
    case("pack_entry", lambda: pack_entry(0, enc, vals, nnz, buffers, options.codec))
    case("encode_tensor", lambda: encode_sparse(0, flat, newv, oldv, shape, options))
    case("packed_encode", lambda: packed.encode(flat, newv, oldv))
    buf = packed.encode(flat, newv, oldv).numpy()
    case("packed_decode", lambda: packed.decode(buf, nnz, n))
    # the new values as the receiver stages them: the differences then a gather-add pass, or decoded onto the target
    case("packed_decode+gather_add", lambda: kernels.gather_add(old, *packed.decode(buf, nnz, n)))
    case("packed_decode_onto", lambda: packed.decode_onto(buf, nnz, old))
    symbols = np.random.default_rng(4).integers(0, 3, nnz).astype(np.uint8)
    counts = np.bincount(symbols, minlength=3).astype(np.int64)
    words = rans.encode(symbols, counts)
    case("rans_encode", lambda: rans.encode(symbols, counts))
    freq = rans.quantize(counts)
    cum, lut = rans.tables(freq)
    dec = np.empty(nnz, dtype=np.uint8)
    case("rans_decode_into", lambda: rans.decode_into(words, freq, cum, lut, dec))
    entry = encode_sparse(0, flat, newv, oldv, shape, options)
    specs, frames = assemble([entry])
    wire = encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames))
    msg = decode_message(wire)
    case("decode_tensor", lambda: decode_entry(msg.tensors[0], msg.frames, shape, torch.bfloat16, torch.device("cpu")))
    return out


def scaling_cases(repeat: int, n: int = 1 << 20, changes: tuple[int, ...] = (1, 1000, 10_000, 30_000, 100_000, 300_000)) -> dict[str, Any]:
    """One bf16 tensor of ``n`` elements with each count of +-1-ulp changes in ``changes``
    (random positions), encoded (``encode_sparse``) and decoded (``decode_entry``) with the
    default options. The cost is not one line (small counts take other encodings), so per
    change is the slope between the two largest counts, per tensor the time at the smallest,
    and each count's time is also given as a multiple of issue 14's budget, 20 us + 10 ns a change."""
    from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse
    from protocol.wire.framing import Message, MessageType, decode_message, encode_message

    g = torch.Generator().manual_seed(8)
    old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    options, cpu = PatchOptions(), torch.device("cpu")
    out: dict[str, Any] = {}
    points: dict[str, list[tuple[int, float]]] = {"encode": [], "decode": []}
    for k in changes:
        flat = torch.randperm(n, generator=g)[:k].sort().values
        bits = old.view(torch.int16).clone()
        bits[flat] += (torch.randint(0, 2, (k,), generator=g) * 2 - 1).to(torch.int16)
        new = bits.view(torch.bfloat16)
        newv, oldv = new[flat], old[flat]
        r = timed(functools.partial(encode_sparse, 0, flat, newv, oldv, (n,), options), repeat)
        out[f"scaling encode_tensor n={n} changes={k}"] = {**r, "changes": k}
        points["encode"].append((k, r["median_s"]))
        entry = encode_sparse(0, flat, newv, oldv, (n,), options)
        specs, frames = assemble([entry])
        msg = decode_message(encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames)))
        r = timed(functools.partial(decode_entry, msg.tensors[0], msg.frames, (n,), torch.bfloat16, cpu), repeat)
        out[f"scaling decode_tensor n={n} changes={k}"] = {**r, "changes": k}
        points["decode"].append((k, r["median_s"]))
    for side, pts in points.items():
        (k1, t1), (k2, t2) = pts[-2], pts[-1]
        out[f"scaling {side} n={n}"] = {
            "median_s": pts[0][1], "best_s": pts[0][1],
            "per_change_ns": (t2 - t1) / (k2 - k1) * 1e9, "per_tensor_us": pts[0][1] * 1e6,
            "how": f"per change: the slope between {k1} and {k2} changes; per tensor: the time at {pts[0][0]} change",
            # issue 14's budget: 20 us a tensor + 10 ns a change, at each count measured
            "over_budget": {str(k): t / (20e-6 + 10e-9 * k) for k, t in pts},
        }
    return out


def compress_cases(repeat: int) -> dict[str, Any]:
    from protocol.codec.compress import Codec, compress

    out: dict[str, Any] = {}
    rng = np.random.default_rng(5)
    for size in (256, 4096, 1 << 16):
        data = torch.from_numpy(rng.integers(0, 4, size).astype(np.uint8))
        out[f"zstd_compress {size}B"] = timed(functools.partial(compress, data, Codec.ZSTD), repeat)
    return out


def pool_cases(n_tensors: int, n: int, density: float, repeat: int) -> dict[str, Any]:
    """The per-tensor codec pool over one message's worth of entropy-coded tensors."""
    from protocol.codec import parallel
    from protocol.codec.tensorcodec import PatchOptions, assemble, decode_entry, encode_sparse
    from protocol.wire.framing import Message, MessageType, decode_message, encode_message

    g = torch.Generator().manual_seed(6)
    options = PatchOptions()
    items = []
    for i in range(n_tensors):
        old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        new = ulp_step(old, density, seed=10 + i)
        flat = torch.nonzero(new.view(torch.int16) != old.view(torch.int16)).squeeze(1)
        items.append((i, flat, new[flat], old[flat]))
    entries = [encode_sparse(k, f, nv, ov, (n,), options) for k, f, nv, ov in items]
    specs, frames = assemble(entries)
    msg = decode_message(encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames)))
    cpu = torch.device("cpu")
    out: dict[str, Any] = {}
    saved = parallel.WORKERS
    try:
        for workers in sorted({1, 2, saved}):
            parallel.WORKERS = workers
            out[f"encode {n_tensors} tensors n={n} workers={workers}"] = timed(
                lambda: parallel.map_ordered(lambda it: encode_sparse(it[0], it[1], it[2], it[3], (n,), options), items), repeat)
            out[f"decode {n_tensors} tensors n={n} workers={workers}"] = timed(
                lambda: parallel.map_ordered(lambda e: decode_entry(e, msg.frames, (n,), torch.bfloat16, cpu), msg.tensors), repeat)
    finally:
        parallel.WORKERS = saved
    return out


def _many_tensor_patch(n_tensors: int = 300, n: int = 20000) -> list[Any]:
    from protocol.codec.tensorcodec import PatchOptions, assemble, encode_sparse
    from protocol.wire.framing import Message, MessageType, encode_message

    g = torch.Generator().manual_seed(7)
    entries = []
    for k in range(n_tensors):
        old = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        new = ulp_step(old, 0.05, seed=20 + k)
        flat = torch.nonzero(new.view(torch.int16) != old.view(torch.int16)).squeeze(1)
        entries.append(encode_sparse(k, flat, new[flat], old[flat], (n,), PatchOptions()))
    specs, frames = assemble(entries)
    return encode_message(Message(MessageType.PATCH, version=1, base_version=0, tensors=specs, frames=frames))


def header_cases(repeat: int) -> dict[str, Any]:
    from protocol.wire.framing import decode_message, peek_type

    wire = _many_tensor_patch()
    label = f"300 tensors, {len(wire)} frames, header {len(wire[0])} B"
    return {f"decode_message {label}": timed(lambda: decode_message(wire), repeat),
            f"peek_type {label}": timed(lambda: peek_type(wire), repeat)}


def recv_cases(repeat: int) -> dict[str, Any]:
    import asyncio

    import zmq
    import zmq.asyncio

    from protocol.net.sockets import DealerSocket
    from protocol.wire.limits import read_bounded

    wire = [bytes(f) for f in _many_tensor_patch()]

    async def run() -> dict[str, Any]:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.linger = 0
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = DealerSocket(context, f"tcp://127.0.0.1:{port}", b"bench")
        out: dict[str, Any] = {}
        try:
            await dealer.send([b"hi"])
            identity, _ = await router.recv_multipart()
            readers = {"per_frame": lambda: read_bounded(lambda: dealer.sock.recv(copy=False), dealer.limits), "message": dealer.recv}
            for name, read in readers.items():
                times = []
                for i in range(repeat + 1):
                    await router.send_multipart([identity, *wire])
                    while not dealer.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # queued whole (atomic delivery)
                        await asyncio.sleep(0.001)
                    t0 = time.perf_counter_ns()
                    frames = await read()
                    if i:
                        times.append((time.perf_counter_ns() - t0) * 1e-9)
                    assert len(frames) == len(wire)
                out[f"recv {name} {len(wire)} frames"] = {"median_s": statistics.median(times), "best_s": min(times)}
        finally:
            dealer.close()
            router.close(linger=0)
            context.destroy(linger=0)
        return out

    return asyncio.run(run())


def onto_cases(repeat: int, sizes: tuple[int, ...] = (1 << 20, 1 << 23), densities: tuple[float, ...] = (0.01, 0.03, 0.1)) -> dict[str, Any]:
    """``packed.decode_onto`` with the differences added as they decode (``fused``) and in
    a pass after, on bf16 tensors of each size at each share of changed elements: what
    ``packed.FUSED_FROM`` chooses between."""
    from protocol.codec import packed

    g = torch.Generator().manual_seed(9)
    out: dict[str, Any] = {}
    for n in sizes:
        base = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
        for density in densities:
            flat = torch.randperm(n, generator=g)[: int(n * density)].sort().values
            old = base[flat]
            new = (old.view(torch.int16) + torch.randint(-3, 4, (flat.numel(),), generator=g).to(torch.int16)).view(torch.bfloat16)
            buf = packed.encode(flat, new, old).numpy()
            for how, fused in (("fused", True), ("after", False)):
                r = timed(functools.partial(packed.decode_onto, buf, flat.numel(), base, fused=fused), repeat)
                out[f"onto {how} n={n} density={density}"] = {**r, "ns_per_change": r["best_s"] / flat.numel() * 1e9}
    return out

def build_cases(repeat: int) -> dict[str, Any]:
    """The sender's build (``PatchBuilder.collect``: compare, collect, snapshot update; the
    encoder thread running beside it as in a sync) of the suites' real models, fp32 master to
    bf16 receiver after real AdamW steps, with the fused diff's kernels timed inside it
    (``benchmarks.phases``: one-pass time counts as ``mark``). ``read_floor`` is the bytes the
    compare reads at this run's copy bandwidth (what issue 14's build target is against).
    ``encode_version``: every tensor of the last version with changes, through
    ``packed.encode`` (the entropy-coded layout) in turn on one thread."""
    import asyncio

    from benchmarks import phases
    from benchmarks.bandwidth import copy_bandwidth
    from benchmarks.workloads import SUITES
    from examples.tiny_model import TinyLM, train_step
    from protocol.codec import packed
    from protocol.config import load_config
    from protocol.state import resolve_state
    from protocol.wire.metadata import ModelMetadata
    from sender.plan import SyncPlan
    from sender.version.patch import PatchBuilder

    copy_bps = copy_bandwidth(256 << 20)
    out: dict[str, Any] = {}

    async def run(suite: str, lr: float) -> None:
        torch.manual_seed(0)
        model = TinyLM(**SUITES[suite].model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(1234)
        config = load_config({"type": "patch"})
        metadata = ModelMetadata.of(TinyLM(**SUITES[suite].model).to(torch.bfloat16).state_dict())
        builder = PatchBuilder(SyncPlan(resolve_state(model), metadata, config.init_sync), config.patch)
        builder.capture(dict(model.state_dict()))
        times: list[float] = []
        kernels: list[tuple[float, float]] = []
        last: list[Any] = []
        encode = builder.encoding._encode

        def kept(changes: Any) -> Any:
            last.append(changes)
            return encode(changes)

        builder.encoding._encode = kept  # type: ignore[method-assign]
        with phases.sender_timers():
            for version in range(1, repeat + 3):  # two untimed: AdamW's first step, and the first one-pass compare
                last.clear()
                train_step(model, opt, g)
                tensors = dict(model.state_dict())
                phases.RECORDER.take()
                started = time.perf_counter()
                captured, stats = await builder.collect(tensors, version)
                elapsed = time.perf_counter() - started
                sums = phases.RECORDER.take()["sums_ns"]
                await builder.encode(captured, version, version - 1, stats)
                if version > 2:
                    times.append(elapsed)
                    kernels.append((sums.get("mark", 0) * 1e-9, sums.get("collect", 0) * 1e-9))
        read_floor = builder.collector.read_bytes / copy_bps
        median = statistics.median(times)
        out[f"build {suite} real lr={lr:g}"] = {
            "median_s": median, "best_s": min(times), "read_floor_s": read_floor, "vs_read_floor": median / read_floor,
            "mark_s": statistics.median(k[0] for k in kernels), "collect_s": statistics.median(k[1] for k in kernels),
            "changed": stats.changed_elements, "copy_Bps": copy_bps,
        }
        sparse = [c for c in last if c.flat is not None]
        changes = sum(c.flat.numel() for c in sparse)
        r = timed(lambda: [packed.encode(c.flat, c.new, c.old) for c in sparse], max(5, repeat))
        name = f"encode_version {suite} real lr={lr:g} ({len(sparse)} tensors)"
        out[name] = {**r, "ns_per_change": r["best_s"] / changes * 1e9, "changes": changes}

    for suite in ("quick", "full"):
        for lr in (1e-6, 1e-5):
            asyncio.run(run(suite, lr))
    return out


CASES = ("mark", "build", "codec", "scaling", "onto", "compress", "pool", "header", "recv")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.micro", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--mark-n", type=int, default=1 << 23, help="elements of the compared tensor (default 8M)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    results: dict[str, Any] = {}
    if "mark" in args.only:
        results.update(mark_cases(args.mark_n, args.repeat))
        results.update(mark_cases(1 << 20, args.repeat))
    if "build" in args.only:
        results.update(build_cases(min(args.repeat, 8)))
    if "codec" in args.only:
        results.update(codec_cases(1 << 20, 0.024, args.repeat))
        results.update(codec_cases(1 << 16, 0.024, args.repeat))
    if "scaling" in args.only:
        results.update(scaling_cases(args.repeat))
    if "onto" in args.only:
        results.update(onto_cases(args.repeat))
    if "compress" in args.only:
        results.update(compress_cases(args.repeat))
    if "pool" in args.only:
        results.update(pool_cases(24, 1 << 16, 0.024, max(5, args.repeat // 3)))
        results.update(pool_cases(8, 1 << 20, 0.024, max(5, args.repeat // 3)))
    if "header" in args.only:
        results.update(header_cases(args.repeat))
    if "recv" in args.only:
        results.update(recv_cases(max(5, args.repeat // 3)))
    for name, r in results.items():
        extra = f"  {r['ns_per_element']:.3f} ns/elem" if "ns_per_element" in r else ""
        if "vs_read_floor" in r:
            extra = (f"  {r['vs_read_floor']:.2f}x the read floor ({r['read_floor_s'] * 1e3:.1f} ms); mark {r['mark_s'] * 1e3:.1f} ms,"
                     f" collect {r['collect_s'] * 1e3:.1f} ms; {r['changed']:,} changes")
        if "ns_per_change" in r:
            extra = f"  {r['ns_per_change']:.2f} ns a change (best)"
        if "per_change_ns" in r:
            budget = ", ".join(f"{k}: {x:.2f}x" for k, x in r["over_budget"].items())
            extra = f"  -> {r['per_change_ns']:.2f} ns a change, {r['per_tensor_us']:.1f} us a tensor; vs 20 us + 10 ns/change: {budget}"
        print(f"{name:70s} median {r['median_s'] * 1e6:10.1f} us  best {r['best_s'] * 1e6:10.1f} us{extra}")
    if args.json:
        doc = {"command": "python -m benchmarks.micro " + " ".join(sys.argv[1:] if argv is None else argv),
               "cpus": os.cpu_count(), "load_average": os.getloadavg(), "results": results}
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
