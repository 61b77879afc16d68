"""What an fp8 rollout's versions cost: the fp8 patch against the bf16 patch of the same steps
and against the dense fp8 checkpoint, per lr, with encode and apply times.

    python -m benchmarks.fp8 --json OUT.json [--hidden 512 --layers 4 --steps 4 --lr 1e-6 1e-5]

One Hugging Face Qwen2 trainer (fp32 masters, real AdamW steps, the same batch each step)
feeds two transport-free patch senders at once, each with its own receiver: a bf16 rollout
(plain torch state dict) and a block-fp8 one (128x128 blocks, scales from the bf16 cast:
``fp8.source: bf16``; ``--source master`` for the masters). One sender serves one format,
so a fleet with both runs two senders, as here. Per version and per rollout: the wire bytes
of its patch, the dense bytes of a full copy in its format (the fp8 checkpoint: fp8 bytes,
scales and the bf16 rest), the elements that changed, the sender's build and encode
seconds, the fp8 sender's seconds quantizing the version before its compare
(``SyncStats.quantize_seconds``), and the receiver's apply seconds. Then the share of fp8 bytes and of scales that
changed, read from the fp8 rollout itself. A guard: after every version the fp8 rollout
must equal the reference quantizer's output for the trainer's weights (``protocol.quant``),
bit for bit. Medians per lr on this machine; compare within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import receiver  # noqa: E402
import sender  # noqa: E402
from protocol.quant import FP8, SCALE_SUFFIX, BlockFp8, quantize_state  # noqa: E402


class Pipe:
    """An in-memory one-way channel: the frames as bytes, as a socket would carry them."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[bytes]] = asyncio.Queue()

    async def send(self, frames: Any) -> None:
        await self.queue.put([bytes(f) for f in frames])

    async def recv(self) -> list[bytes]:
        return await self.queue.get()


class Side:
    """One sender and its receiver over a pair of pipes."""

    def __init__(self, config: dict[str, Any], rollout: dict[str, torch.Tensor]) -> None:
        self.sender, self.receiver, self.rollout = sender.make_sender(config), receiver.make_receiver(config), rollout
        self.down, self.up = Pipe(), Pipe()

    async def start(self, model: torch.nn.Module) -> None:
        await asyncio.gather(
            self.sender.init_sender(model, self.down.send, self.up.recv),
            self.receiver.init_receiver(self.rollout, self.down.recv, self.up.send),
        )

    async def version(self, model: torch.nn.Module, version: int) -> dict[str, Any]:
        stats = await self.sender.sync(model, self.down.send, version)
        started = time.perf_counter()
        assert await self.receiver.apply(self.rollout, self.down.recv) == version
        apply_s = time.perf_counter() - started
        return {"wire_bytes": stats.wire_bytes, "dense_bytes": stats.dense_bytes, "changed_fraction": stats.changed_fraction,
                "tensors_dense": stats.tensors_dense, "quantize_s": stats.quantize_seconds, "build_s": stats.build_seconds,
                "encode_s": stats.encode_seconds, "apply_s": apply_s}


def bf16_rollout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.detach().bfloat16() if v.is_floating_point() else v.detach()).clone() for k, v in state.items()}


def fp8_rollout(state: dict[str, torch.Tensor], settings: BlockFp8) -> dict[str, torch.Tensor]:
    quantized = quantize_state({k: v.detach() for k, v in state.items()}, settings)
    return {k: (v.bfloat16() if v.is_floating_point() and v.dtype != FP8 and not k.endswith(SCALE_SUFFIX) else v).clone()
            for k, v in quantized.items()}


def changed_share(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], scales: bool) -> float:
    """The share of fp8 bytes (or of scales) that differ between two states of the fp8 rollout."""
    keys = [k for k in after if (k.endswith(SCALE_SUFFIX) if scales else after[k].dtype == FP8)]
    total = sum(after[k].numel() for k in keys)
    bits = (lambda t: t.view(torch.uint8)) if not scales else (lambda t: t.view(torch.int32))
    return sum(int((bits(before[k]) != bits(after[k])).sum()) for k in keys) / total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4, help="versions per lr")
    p.add_argument("--lr", type=float, nargs="+", default=[1e-6, 1e-5])
    p.add_argument("--source", choices=("bf16", "master"), default="bf16")
    args = p.parse_args(argv)
    started_run = time.perf_counter()
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=round(args.hidden * 2.75 / 128) * 128,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    model = transformers.Qwen2ForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr[0], weight_decay=0.0)
    batch = torch.randint(3, args.vocab, (4, 64), generator=torch.Generator().manual_seed(0))
    settings = BlockFp8(source=args.source)
    patch = {"type": "patch", "patch": {"compression": "zstd"}}
    bf16 = Side(patch, bf16_rollout(model.state_dict()))
    fp8 = Side({**patch, "fp8": {"source": args.source}}, fp8_rollout(model.state_dict(), settings))
    rows: list[dict[str, Any]] = []
    mismatched: list[int] = []

    async def run() -> None:
        await bf16.start(model)
        await fp8.start(model)
        version = 0
        for lr in args.lr:
            for group in opt.param_groups:
                group["lr"] = lr
            for _ in range(args.steps):
                model(input_ids=batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                version += 1
                before = {k: v.clone() for k, v in fp8.rollout.items()}
                row: dict[str, Any] = {"version": version, "lr": lr, "bf16": await bf16.version(model, version),
                                       "fp8": await fp8.version(model, version)}
                row["fp8"]["fp8_bytes_changed"] = changed_share(before, fp8.rollout, scales=False)
                row["fp8"]["scales_changed"] = changed_share(before, fp8.rollout, scales=True)
                reference = fp8_rollout(model.state_dict(), settings)
                if any(not torch.equal(reference[k].view(torch.uint8) if reference[k].dtype == FP8 else reference[k],
                                       fp8.rollout[k].view(torch.uint8) if fp8.rollout[k].dtype == FP8 else fp8.rollout[k])
                       for k in reference):
                    mismatched.append(version)
                rows.append(row)
                print({"version": version, "lr": lr, "bf16_wire": row["bf16"]["wire_bytes"], "fp8_wire": row["fp8"]["wire_bytes"]}, flush=True)
        await bf16.sender.close()
        await fp8.sender.close()

    asyncio.run(run())
    by_lr: dict[str, Any] = {}
    for lr in args.lr:
        mine = [r for r in rows if r["lr"] == lr]

        def med(side: str, key: str, mine: list[dict[str, Any]] = mine) -> float:
            return statistics.median(r[side][key] for r in mine)

        by_lr[str(lr)] = {
            "bf16_elements_changed": med("bf16", "changed_fraction"), "fp8_elements_changed": med("fp8", "changed_fraction"),
            "fp8_bytes_changed": med("fp8", "fp8_bytes_changed"), "scales_changed": med("fp8", "scales_changed"),
            "fp8_patch_bytes": med("fp8", "wire_bytes"), "bf16_patch_bytes": med("bf16", "wire_bytes"),
            "dense_fp8_bytes": med("fp8", "dense_bytes"), "dense_bf16_bytes": med("bf16", "dense_bytes"),
            "fp8_patch_over_bf16_patch": med("fp8", "wire_bytes") / med("bf16", "wire_bytes"),
            "fp8_patch_over_dense_fp8": med("fp8", "wire_bytes") / med("fp8", "dense_bytes"),
            "fp8_build_s": med("fp8", "build_s"), "fp8_encode_s": med("fp8", "encode_s"), "fp8_quantize_s": med("fp8", "quantize_s"),
            "fp8_apply_s": med("fp8", "apply_s"), "bf16_build_s": med("bf16", "build_s"), "bf16_encode_s": med("bf16", "encode_s"),
            "bf16_apply_s": med("bf16", "apply_s"),
        }
    doc = {
        "benchmark": "fp8", "command": "python -m benchmarks.fp8 " + " ".join(argv or sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__},
        "model": {"family": "qwen2", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "params": sum(p.numel() for p in model.parameters()), "fp8": {"block": [128, 128], "source": args.source}},
        "rows": rows, "by_lr": by_lr,
        "guard": {"what": "the fp8 rollout equals the reference quantizer's output of the trainer's weights after every version",
                  "equal": not mismatched, "mismatched_versions": mismatched},
        "wall_s": time.perf_counter() - started_run,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print({"by_lr": by_lr, "guard": doc["guard"]})
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
