"""``python -m sender compile`` and ``python -m receiver compile``: numba's kernels into its
cache ahead of the first start (an image build, ``make install``).

Run here against the cache the test session's start filled (tests/conftest.py), so each
loads rather than compiles; what a cold start costs is in docs/troubleshooting.md. After
both steps, a fresh process encodes and applies every encoding at each dtype pair it gave
them, and numba compiles nothing more: no dispatcher gains a signature."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
T = 120.0


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=T)


PAIRS = "bf16:bf16,float16:float32,int32:int32"


@pytest.mark.parametrize(
    "argv", [("sender", "compile"), ("sender", "compile", "--pairs", PAIRS), ("receiver", "compile"), ("receiver", "compile", "--pairs", PAIRS)]
)
def test_compile_reports_what_it_compiled(argv: tuple[str, ...]) -> None:
    done = _run(*argv)
    assert done.returncode == 0, done.stderr
    (line,) = done.stdout.splitlines()
    report = json.loads(line)
    assert report["event"] == "compiled" and report["side"] == argv[0] and report["seconds"] >= 0
    if "--pairs" in argv:
        assert report["pairs"] == argv[-1]


@pytest.mark.parametrize("side", ["sender", "receiver"])
@pytest.mark.parametrize("pairs, why", [("float32", "not enough values"), ("bogus:bfloat16", "unsupported float dtype 'bogus'")])
def test_compile_refuses_bad_dtype_pairs(side: str, pairs: str, why: str) -> None:
    done = _run(side, "compile", "--pairs", pairs)
    assert done.returncode == 2 and why in done.stderr and done.stdout == ""


# -- the compile steps cover what a sync reaches ------------------------------------------------
# Every pair a model and its rollouts commonly take, and integer buffers: the compile step
# is given these, then each encoding is encoded and applied at each of them.
COVERED = "float32:bfloat16,bfloat16:bfloat16,float32:float32,float16:float16,float32:float16,float64:float64,int64:int64,int32:int32"
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "ungrouped": {"group_numel": 0},
    "ans": {"position_encoding": "ans", "group_numel": 0},  # entropy-coded gaps and values in separate buffers
    "gaps": {"position_encoding": "gaps"},
    "bitmap": {"position_encoding": "bitmap"},
    "xor": {"value_encoding": "xor", "compression": "zstd"},
    "gaps-raw": {"position_encoding": "gaps", "value_encoding": "raw"},
    "coo": {"position_encoding": "coo", "delta_encoding": False, "value_encoding": "raw"},
    "coo-delta": {"position_encoding": "coo", "delta_encoding": True, "value_encoding": "raw", "compression": "lz4"},
    "plain": {"dense_above": {"link_gbps": 2.0}},  # plain gaps and values on a fast link
    "dense": {"dense_above": 0.25},
    "device": {"codec": "device"},  # the device codec (BLOCKS) on CPU tensors
}
SIZES = {"big": 100_000, "mid": 3000, "small": 40, "tiny": 5}


def _state(dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` of several sizes, one tied under two names, an int64 step counter
    and (on a receiver) a non-contiguous tensor, which is decoded without a base."""
    g = torch.Generator().manual_seed(seed)
    state = {k: _values((n,), dtype, g) for k, n in SIZES.items()}
    state["tied.a"] = state["tied.b"] = _values((64, 48), dtype, g)
    state["strided"] = _values((48, 64), dtype, g)
    state["steps"] = torch.zeros((), dtype=torch.int64)
    return state


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g).to(dtype)


def _step(state: dict[str, torch.Tensor], step: int, g: torch.Generator) -> None:
    """Changes to a share of each tensor that differs step to step (a few, a third, all)."""
    for i, (key, t) in enumerate(state.items()):
        if key in ("steps", "tied.b"):
            continue
        share = (0.03, 0.3, 1.0)[(i + step) % 3]
        flat = t.view(-1)
        picked = torch.rand(flat.numel(), generator=g) < share
        if t.dtype.is_floating_point:
            flat[picked] = (flat[picked].float() * (1 + 1e-2 * torch.randn(int(picked.sum()), generator=g))).to(t.dtype)
        else:
            flat[picked] += 1
    state["steps"] += 1


async def _sync_all(pairs: list[tuple[torch.dtype, torch.dtype]]) -> set[tuple[str, str]]:
    """Every config at every pair: a handshake and three versions encoded and applied, each
    bit for bit; the (encoding, values) of the entries that travelled."""
    from channel import Channel

    import receiver
    import sender
    from protocol.wire.framing import decode_message

    seen: set[tuple[str, str]] = set()
    for model_dtype, receiver_dtype in pairs:
        for name, patch in CONFIGS.items():
            config = {"type": "patch", "patch": patch}
            s, r = sender.make_sender(config), receiver.make_receiver(config)
            state, target = _state(model_dtype, 0), _state(receiver_dtype, 1)
            target["strided"] = target["strided"].t().contiguous().t()
            ch, g = Channel(), torch.Generator().manual_seed(2)
            await asyncio.gather(
                s.init_sender(state, ch.to_receiver.send, ch.to_sender.recv), r.init_receiver(target, ch.to_receiver.recv, ch.to_sender.send)
            )
            for version in range(1, 4):
                _step(state, version, g)
                await s.sync(state, ch.to_receiver.send, version)
                assert await r.apply(target, ch.to_receiver.recv) == version
                for key, t in state.items():
                    want = t.to(target[key].dtype)
                    assert torch.equal(want.view(-1).view(torch.uint8), target[key].contiguous().view(-1).view(torch.uint8)), (name, key)
            seen |= {(e.encoding.name, e.values.name) for frames in ch.to_receiver.sent for e in decode_message(frames).tensors}
    return seen


async def _over_sockets(model_dtype: torch.dtype, receiver_dtype: torch.dtype) -> None:
    """The daemons over TCP, as the report that found the gap ran them: the receiver decodes
    frames as ZeroMQ hands them over, not the copies ``tests/channel.py`` makes."""
    from receiver import Receiver
    from sender import Sender

    config = {"type": "patch", "patch": {}}
    state, target = _state(model_dtype, 0), _state(receiver_dtype, 1)
    s = Sender("tcp://127.0.0.1:0", config)
    await s.start(state, version=0)
    r = Receiver(target, s.endpoint, config, identity="compile")
    try:
        await r.start(timeout=60)
        g = torch.Generator().manual_seed(2)
        for version in range(1, 4):
            _step(state, version, g)
            await s.sync(state, version)
            await r.wait_for_version(version, timeout=60)
    finally:
        await r.close()
        await s.close()


def _spans_and_large(pairs: list[tuple[torch.dtype, torch.dtype]]) -> None:
    """What the syncs above do not reach on a small model: span entries (decoded onto a range
    of their target, written through the receiver's commit), and the compare of a tensor past
    ``fastdiff.PARALLEL_MIN`` elements, or whose changes overflow the room expected for them."""
    from protocol.codec.spans import encode_dense_span, encode_span
    from protocol.codec.tensorcodec import PatchOptions
    from protocol.wire.span import Span
    from sender.diff import fastdiff

    for model_dtype, receiver_dtype in pairs:
        g = torch.Generator().manual_seed(3)
        target = _values((6000,), receiver_dtype, g)
        for nnz in (3, 300):
            flat = torch.sort(torch.randperm(2000, generator=g)[:nnz]).values.to(torch.int32)
            old = target[1000:3000][flat.long()].clone()
            new = old + 1 if not receiver_dtype.is_floating_point else (old.float() * 1.01).to(receiver_dtype)
            _apply_span(encode_span(0, Span.range(1000, 3000), flat, new, old, PatchOptions()), target, receiver_dtype)
        _apply_span(encode_dense_span(0, Span.range(0, 1000), target[:1000] + 1, PatchOptions().codec), target, receiver_dtype)
        state = _values((fastdiff.PARALLEL_MIN + 5,), model_dtype, g)
        if not fastdiff.supported(state, state.to(receiver_dtype)):
            continue
        for expect in (None, 10, 100_000, 10_000_000):
            snapshot = state.to(receiver_dtype)
            state[:: 97] += 1
            fastdiff.diff_and_update(state, snapshot, 1.0, expect)
        snapshot = state[:3000].to(receiver_dtype)
        state[:3000:3] += 1
        fastdiff.diff_and_update(state[:3000], snapshot, lambda n, sample: bool(sample().numel() < 0), 1)  # the serial pass, overflowing


def _apply_span(entry: Any, target: torch.Tensor, dtype: torch.dtype) -> None:
    from protocol.codec.tensorcodec import assemble, at_span, decode_entry
    from receiver.apply.commit import StagedUpdate, write

    (spec,), frames = assemble([entry])
    frames = [bytes(f) for f in frames]
    span = spec.span
    decoded = at_span(decode_entry(spec, frames, (span.numel,), dtype, torch.device("cpu"), base=span.of(target)), span)
    write(target, StagedUpdate.stage(decoded, target))


def signatures() -> dict[str, set[str]]:
    """Every numba dispatcher's compiled signatures, by kernel."""
    import gc

    from numba.core.dispatcher import Dispatcher

    found = [d for d in gc.get_objects() if isinstance(d, Dispatcher)]
    return {f"{d.py_func.__module__}.{d.py_func.__qualname__}": {str(s) for s in d.signatures} for d in found}


def compile_then_sync(pairs_text: str) -> None:
    """In a fresh process: each side's compile step for ``pairs_text``, then every encoding
    at every pair. Exits 1 naming each signature numba compiled after the compile steps."""
    import receiver.apply.warmup
    import sender.diff.warmup
    from protocol.codec.aot import parse_pairs, receiver_dtypes

    torch.set_num_threads(1)
    pairs = parse_pairs(pairs_text)
    sender.diff.warmup.compile_kernels(pairs)
    receiver.apply.warmup.compile_kernels(receiver_dtypes(pairs))
    before = signatures()
    seen = asyncio.run(_sync_all(pairs))
    asyncio.run(_over_sockets(*pairs[0]))
    _spans_and_large(pairs)
    after = signatures()
    new = sorted(f"{k}{s}" for k, sigs in after.items() for s in sigs - before.get(k, set()))
    print(json.dumps({"seen": sorted(seen), "new": new}))
    sys.exit(1 if new else 0)


def test_after_the_compile_steps_no_encoding_compiles_anything() -> None:
    """The compile steps, given the pairs, leave nothing for numba to compile: every encoding
    encoded and applied at each pair (tied tensors, int64 buffers, spans, a strided target,
    a tensor the threaded compare takes; the daemons over TCP at the first pair, fp32 to
    bf16) keeps every dispatcher's signatures as they were."""
    root = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = f"from test_compile import compile_then_sync; compile_then_sync({COVERED!r})"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.stdout, done.stderr[-4000:]
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["new"], "compiled after the compile steps:\n" + "\n".join(report["new"])
    assert done.returncode == 0, done.stderr[-4000:]
    seen = {tuple(e) for e in report["seen"]}
    every = {("DENSE", "RAW"), ("COO", "RAW"), ("COO_DELTA", "RAW"), ("GAPS", "RAW"), ("GAPS", "XOR"), ("BITMAP", "XOR"),
             ("ANS_GAPS", "ULP"), ("ANS_GAPS", "XOR"), ("BLOCKS", "ULP")}
    assert every <= seen, every - seen


def test_the_compare_compiles_its_builds_for_huge_tensors_only_where_one_is_compared() -> None:
    """Positions past 2**31 elements are int64, which only the threaded kernels meet: the
    compile step builds those too, a sender whose tensors are all smaller does not."""
    from sender.diff import fastdiff

    pairs = [(torch.float32, torch.bfloat16), (torch.int64, torch.int64)]
    every, small = fastdiff.signatures(pairs), fastdiff.signatures(pairs, 1 << 30)
    assert set(small) < set(every) and fastdiff.signatures(pairs, 1 << 31) == every
    huge = {fastdiff._KERNELS[True].collect, fastdiff._THREADED_ONE_PASS.mark_collect, fastdiff._THREADED_ONE_PASS.compact}
    assert {row.kernel for row in set(every) - set(small)} == huge
