"""How long a weight update holds an SGLang engine, and what it moves: weightsync vs SGLang's paths.

    .venv-sglang/bin/python -m benchmarks.sglang_hold --json OUT.json [--steps 5] [--lr 5e-7] [--tp 2]

One ``sglang.Engine`` (CPU, ``torch_native`` attention, TP=1 or ``--tp``) started from
``--load-format dummy`` with weightsync's custom weight loader (``receiver.sglang``), fed by
a Hugging Face Qwen2 trainer (fp32, real AdamW steps) through a Sender with
``commit="together"``: ``Trainer.step`` returns once the Sender has flipped the version,
i.e. once every worker reported it staged, so nothing runs inside a worker to find that
out. Per version, the same engine is then updated to that version four ways, each timed
in the driver as a caller sees it, each writing the same values (the engine holds them
after the first), so the order does not matter:

* ``weightsync``: ``SGLangWeights.update(version)``, the whole call (SGLang's
  ``begin_weight_update`` .. ``end_weight_update``, the workers' answers, the weight
  version label), and within it SGLang's window alone (begin called .. end returned). The
  workers' own ``commit_s`` / ``repack_s`` / ``check_s`` come from their answers (the
  slowest worker's). ``weightsync_status``: ``SGLangWeights.status()`` right after, one
  command through the same window that writes nothing and flushes no cache: the round
  trips' share of the update;
* ``sglang_tensor``: SGLang's own colocated path, what slime and verl run:
  ``begin_weight_update``, ``update_weights_from_tensor`` of the whole bf16 state (HF
  names, ``load_format=None``, ``flush_cache=True``), ``end_weight_update``;
* ``sglang_disk``: ``update_weights_from_disk`` of the trainer's bf16 checkpoint of that
  version (saving it is not in the hold; ``save_s`` reports it on its own; read from the
  page cache here, as it was just written);
* ``sglang_empty_window``: ``begin_weight_update`` then ``end_weight_update``, nothing
  written: SGLang's fixed cost of a window (two round trips to the scheduler, every layer's
  restore and post-load processing), which every path that writes inside one pays;
  ``sglang_tiny_tensor``: the same window with one ``update_weights_from_tensor`` of one
  small tensor (``model.norm.weight``, its own values, no cache flush): SGLang's floor for
  a window with one load in it, to set against ``weightsync_status``;
* ``full_copy``: one copy of every tensor of the bf16 state in the driver (a
  memory-bandwidth yardstick).

Bytes: weightsync's wire bytes for the version against the dense bf16 state's. Guard: after
each version's weightsync update and again after the disk reload of the same version the
engine's greedy tokens and their logprobs are taken; they must be equal (``guard`` in the
JSON; a mismatch fails the run after the JSON is written). Medians over ``--steps``
versions on this machine; compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [42, 43, 44, 45, 46]]


class _Windows:
    """Times SGLang's window as any caller opens it: ``begin_weight_update`` called ..
    ``end_weight_update`` returned, by wrapping the engine's two methods."""

    def __init__(self, engine: Any) -> None:
        self.opened: float | None = None
        self.last_s: float | None = None
        begin, end = engine.begin_weight_update, engine.end_weight_update

        def timed_begin(*a: Any, **kw: Any) -> Any:
            self.opened = time.perf_counter()
            return begin(*a, **kw)

        def timed_end(*a: Any, **kw: Any) -> Any:
            out = end(*a, **kw)
            if self.opened is not None:
                self.last_s, self.opened = time.perf_counter() - self.opened, None
            return out

        engine.begin_weight_update, engine.end_weight_update = timed_begin, timed_end

    def take(self) -> float:
        seconds, self.last_s = self.last_s, None
        if seconds is None:
            raise RuntimeError("no SGLang weight-update window was opened and closed")
        return seconds


def _ok(out: Any, what: str) -> None:
    success = out[0] if isinstance(out, tuple | list) else getattr(out, "success", True)
    if not success:
        raise RuntimeError(f"SGLang failed {what}: {out}")


def _generate(engine: Any) -> list[dict[str, Any]]:
    """Greedy tokens and their logprobs for ``PROMPTS`` (one batch)."""
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"temperature": 0.0, "max_new_tokens": 8}, return_logprob=True)
    return [{"tokens": list(o["output_ids"]), "logprobs": [float(lp[0]) for lp in o["meta_info"]["output_token_logprobs"]]} for o in outs]


def _slowest(answers: list[Any]) -> dict[str, float]:
    """The figures of the worker whose commit and re-pack took longest: the engine is held until it is done."""
    info = max((a.info for a in answers), key=lambda i: i.get("commit_s", 0.0) + i.get("repack_s", 0.0))
    return {f"weightsync_{k}": float(info[k]) for k in ("commit_s", "repack_s", "check_s") if k in info}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sglang_hold", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--steps", type=int, default=5, help="versions")
    p.add_argument("--lr", type=float, default=5e-7, help="the published vLLM hold runs' (about 2%% of bf16 elements change a step)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--tp", type=int, default=1, help="tensor parallelism (CPU: one core a rank, SGLANG_CPU_OMP_THREADS_BIND)")
    args = p.parse_args(argv)

    import sglang

    from benchmarks.vllm_hold import _config
    from examples.vllm_rollout import CONFIG, Trainer
    from receiver.sglang import LOADER
    from receiver.sglang.client import SGLangWeights

    started_run = time.perf_counter()
    config = _config(args.hidden, args.layers, args.vocab)
    config.architectures = ["Qwen2ForCausalLM"]  # SGLang picks its model class by this
    trainer = Trainer(tie=True, lr=args.lr, config=config, commit="together")
    workdir = tempfile.mkdtemp(prefix="weightsync-sglang-hold-")
    model_dir, ckpt_dir = os.path.join(workdir, "model"), os.path.join(workdir, "current")
    config.save_pretrained(model_dir)  # the engine starts from dummy weights: weightsync's init bootstraps it
    if args.tp > 1:
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp)))
    engine_started = time.perf_counter()
    engine = sglang.Engine(model_path=model_dir, device="cpu", attention_backend="torch_native", skip_tokenizer_init=True,
                           mem_fraction_static=0.05, max_total_tokens=512, log_level="error", custom_weight_loader=[LOADER],
                           load_format="dummy", tp_size=args.tp)
    engine_start_s = time.perf_counter() - engine_started
    rows: list[dict[str, Any]] = []
    mismatches: list[int] = []
    try:
        windows = _Windows(engine)
        client = SGLangWeights(engine)
        init_started = time.perf_counter()
        client.init(trainer.sender.endpoint, config=CONFIG, timeout=120)
        init_s = time.perf_counter() - init_started
        init_info = [{"rank": a.rank, **a.info} for a in client.last_answers]  # tensors mapped, layers reloaded whole
        windows.take()

        def checkpoint() -> dict[str, torch.Tensor]:
            return {k: v.detach().to(torch.bfloat16).clone() for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"}

        dense_bytes = sum(t.numel() * t.element_size() for t in checkpoint().values())
        before = _generate(engine)
        for _ in range(args.steps):
            step = trainer.step()  # returns once every worker staged it (the flip)
            version = step["version"]
            trainer.run(trainer.sender.flush())
            current = checkpoint()
            save_started = time.perf_counter()
            trainer.save(ckpt_dir)
            save_s = time.perf_counter() - save_started

            started = time.perf_counter()
            held = client.update(version)
            weightsync_s = time.perf_counter() - started
            weightsync_window = windows.take()
            if held != version:
                raise RuntimeError(f"weightsync's update to v{version} left the engine at v{held}")
            ours = _slowest(client.last_answers)
            after_weightsync = _generate(engine)

            started = time.perf_counter()
            client.status()
            status_s = time.perf_counter() - started
            status_window = windows.take()

            started = time.perf_counter()
            _ok(engine.begin_weight_update(), "begin_weight_update")
            _ok(engine.update_weights_from_tensor(list(current.items()), load_format=None, flush_cache=True), "update_weights_from_tensor")
            _ok(engine.end_weight_update(), "end_weight_update")
            tensor_s = time.perf_counter() - started
            windows.take()

            started = time.perf_counter()
            _ok(engine.update_weights_from_disk(ckpt_dir, load_format="auto"), "update_weights_from_disk")
            disk_s = time.perf_counter() - started
            after_disk = _generate(engine)

            started = time.perf_counter()
            _ok(engine.begin_weight_update(), "begin_weight_update")
            _ok(engine.end_weight_update(), "end_weight_update")
            empty_s = time.perf_counter() - started
            windows.take()

            started = time.perf_counter()  # SGLang's floor for a window with one small tensor, no flush (cf. status)
            _ok(engine.begin_weight_update(), "begin_weight_update")
            _ok(engine.update_weights_from_tensor([("model.norm.weight", current["model.norm.weight"])], load_format=None, flush_cache=False),
                "update_weights_from_tensor")
            _ok(engine.end_weight_update(), "end_weight_update")
            tiny_s = time.perf_counter() - started
            windows.take()

            started = time.perf_counter()
            copies = [t.clone() for t in current.values()]
            copy_s = time.perf_counter() - started
            del copies

            if after_weightsync != after_disk:
                mismatches.append(version)
            rows.append({
                "version": version, "changed_fraction": step["changed_fraction"], "flip_s": step.get("flip_s"),
                "flip_missing": step.get("flip_missing"), "weightsync_s": weightsync_s, "weightsync_window_s": weightsync_window, **ours,
                "weightsync_status_s": status_s, "weightsync_status_window_s": status_window,
                "sglang_tensor_s": tensor_s, "sglang_disk_s": disk_s, "sglang_empty_window_s": empty_s,
                "sglang_tiny_tensor_s": tiny_s, "save_s": save_s, "full_copy_s": copy_s,
                "weightsync_wire_bytes": trainer.last_stats.wire_bytes, "guard_equal": after_weightsync == after_disk,
                "tokens_changed_from_previous": after_weightsync != before,
            })
            print(json.dumps(rows[-1]), flush=True)
            before = after_weightsync
        client.shutdown()
        last_tokens = before
    finally:
        engine.shutdown()
    keys = ("weightsync_s", "weightsync_window_s", "weightsync_status_s", "weightsync_status_window_s",
            "weightsync_commit_s", "weightsync_repack_s", "weightsync_check_s",
            "sglang_tensor_s", "sglang_disk_s", "sglang_empty_window_s", "sglang_tiny_tensor_s",
            "save_s", "full_copy_s", "changed_fraction", "weightsync_wire_bytes")
    med: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    doc = {
        "benchmark": "sglang_hold", "command": "python -m benchmarks.sglang_hold " + " ".join(argv or sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__, "sglang": sglang.__version__},
        "model": {"family": "qwen2", "hidden": args.hidden, "layers": args.layers, "vocab": args.vocab, "tp": args.tp,
                  "dense_bf16_bytes": dense_bytes, "params": sum(p.numel() for p in trainer.model.parameters())},
        "engine_start_s": engine_start_s, "init_s": init_s, "init_workers": init_info, "tensors": len(checkpoint()), "rows": rows,
        "guard": {"what": "greedy tokens and logprobs after each weightsync update == after update_weights_from_disk of that version",
                  "equal": not mismatches, "mismatched_versions": mismatches, "last_tokens": [o["tokens"] for o in last_tokens]},
        "medians": {
            **med,
            "weightsync_over_sglang_tensor": med["weightsync_s"] / med["sglang_tensor_s"],
            "weightsync_over_sglang_disk": med["weightsync_s"] / med["sglang_disk_s"],
            "weightsync_over_full_copy": med["weightsync_s"] / med["full_copy_s"],
            "weightsync_window_over_sglang_tensor": med["weightsync_window_s"] / med["sglang_tensor_s"],
            "weightsync_window_over_sglang_empty_window": med["weightsync_window_s"] / med["sglang_empty_window_s"],
            "dense_bytes": dense_bytes,
            "wire_over_dense_bytes": med["weightsync_wire_bytes"] / dense_bytes,
        },
        "wall_s": time.perf_counter() - started_run,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2))
    print(json.dumps({"medians": doc["medians"], "guard": doc["guard"]}, indent=2))
    trainer.close()
    if mismatches:
        print(f"guard failed: versions {mismatches} generate differently after weightsync than after SGLang's disk reload", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
