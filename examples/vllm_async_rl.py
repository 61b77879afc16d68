"""Async RL on vLLM's AsyncLLM: rollouts never stop for long, versions stage meanwhile.

The trainer (examples/vllm_rollout.py's Qwen2, fp32, AdamW) steps on its own thread and
syncs every step through a Sender. The engine (``AsyncLLM``, backend ``weightsync``) keeps
``--concurrency`` sampling requests in flight at all times. Whenever the trainer has a
newer version, which has been staged in the engine's workers while they generated, the
driver takes it in vLLM's own window: ``pause_generation(mode="keep")`` (requests in flight
are frozen, not dropped), ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, ``resume_generation``. Each sample is tagged with the version it
started under and the one it finished under (a sample frozen across an update spans two),
and carries vLLM's own record of which version produced which of its tokens
(``CompletionOutput.weight_versions``). That record is the engine's label, so the driver
labels each update with the version the workers hold, asked of them by name through
vLLM's worker extension (``receiver.vllm.extension.WeightsyncWorker``), not with the one
it asked for (an update may land past it), and checks every span against the versions
the workers' engine steps ran with (``receiver.held.steps``).

Prints a JSON line per update (the pause window in ms) and a summary.

    python examples/vllm_async_rl.py --steps 4
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.vllm_rollout import CONFIG, PROMPTS, Trainer  # at the top, as a user's script would import it


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    trainer = Trainer(tie=True, lr=args.lr)
    workdir = tempfile.mkdtemp(prefix="weightsync-async-")
    trainer.config.save_pretrained(workdir)
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=workdir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", max_model_len=128,
        max_num_seqs=max(4, args.concurrency), weight_transfer_config=WeightTransferConfig(backend="weightsync"),
        worker_extension_cls="receiver.vllm.extension.WeightsyncWorker",
    ))

    async def workers_hold() -> int:
        """The version every worker holds (the backend evens them out inside update_weights)."""
        held = {w["version"] for w in await engine.collective_rpc("weightsync_versions")}
        assert len(held) == 1 and None not in held, held
        return int(held.pop())

    try:
        await engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info={"endpoint": trainer.sender.endpoint, "config": CONFIG}))
        held = await workers_hold()  # the bootstrap brought the trainer's current version (v0)
        await engine.update_weight_version(str(held))  # vLLM labels tokens "default" until told
        samples: list[dict[str, Any]] = []
        failures: list[str] = []
        stop = asyncio.Event()

        async def rollout(worker: int) -> None:
            n = 0
            while not stop.is_set():
                started_under = held
                params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=worker * 1000 + n)
                prompt = {"prompt_token_ids": PROMPTS[(worker + n) % len(PROMPTS)]}
                try:
                    final = None
                    async for out in engine.generate(prompt, params, request_id=f"w{worker}-{n}"):
                        final = out
                    assert final is not None and final.finished
                    completion = final.outputs[0]
                    spans = [(int(s.version), s.start, s.end) for s in completion.weight_versions or ()]
                    samples.append({"worker": worker, "started_under": started_under, "finished_under": held,
                                    "tokens": len(completion.token_ids), "spans": spans})
                except Exception as e:  # a dropped request is what this example must not see
                    failures.append(f"{type(e).__name__}: {e}")
                n += 1

        training_done = threading.Event()

        def train() -> None:
            for _ in range(args.steps):
                time.sleep(args.step_interval)
                trainer.step()
            training_done.set()

        workers = [asyncio.create_task(rollout(w)) for w in range(args.concurrency)]
        threading.Thread(target=train, daemon=True).start()
        windows: list[float] = []
        while held < args.steps:
            await asyncio.sleep(0.05)
            version = trainer.version
            if version == held:
                continue
            started = time.perf_counter()
            await engine.pause_generation(mode="keep")
            await engine.start_weight_update()
            await engine.update_weights(WeightTransferUpdateRequest(update_info={"version": version, "timeout": 60}))
            version = await workers_hold()  # what landed: the label vLLM puts on the tokens that follow
            await engine.finish_weight_update(str(version))
            await engine.resume_generation()
            windows.append(time.perf_counter() - started)
            held = version
            print(json.dumps({"updated_to": version, "pause_window_ms": round(windows[-1] * 1e3, 2), "samples_so_far": len(samples)}), flush=True)
        await asyncio.sleep(args.tail)  # some samples under the last version
        stop.set()
        await asyncio.gather(*workers)
        by_version: dict[int, int] = {}
        for s in samples:
            by_version[s["finished_under"]] = by_version.get(s["finished_under"], 0) + 1
        workers = await engine.collective_rpc("weightsync_versions")
        return {
            "steps": args.steps, "weight_version": await engine.get_weight_version(), "updates": len(windows),
            "pause_window_ms_median": round(statistics.median(windows) * 1e3, 2), "samples": len(samples),
            "samples_by_version": by_version, "spanning_an_update": sum(s["started_under"] != s["finished_under"] for s in samples),
            "tags_ordered": all(s["started_under"] <= s["finished_under"] for s in samples), "failures": failures,
            **check_spans(samples, workers),
        }
    finally:
        engine.shutdown()
        trainer.close()


def ordered(versions: list[int | None]) -> bool:
    """Strictly increasing (a worker never runs an older version again), None (no weights yet) first."""
    held = [v for v in versions if v is not None]
    unheld = versions[: len(versions) - len(held)]
    return all(a < b for a, b in itertools.pairwise(held)) and unheld == [None] * len(unheld)


def check_spans(samples: list[dict[str, Any]], workers: list[dict[str, Any]]) -> dict[str, Any]:
    """vLLM's spans against the driver's tags and the workers' record of their steps: each
    sample's spans cover its tokens in order, from a version no older than it started
    under to one no newer than it finished under, and every version a span names is one
    every worker ran engine steps at."""
    ran = [{run["version"] for run in w["runs"]} for w in workers]
    def covered(s: dict[str, Any]) -> bool:
        spans = s["spans"]
        ends = [0] + [end for _, _, end in spans]
        return (bool(spans) and [start for _, start, _ in spans] == ends[:-1] and ends[-1] == s["tokens"]
                and all(a[0] < b[0] for a, b in itertools.pairwise(spans)))
    def within(s: dict[str, Any]) -> bool:
        return bool(s["spans"]) and s["started_under"] <= s["spans"][0][0] and s["spans"][-1][0] <= s["finished_under"]
    named = {v for s in samples for v, _, _ in s["spans"]}
    return {
        "spans_cover_tokens": all(covered(s) for s in samples), "spans_within_tags": all(within(s) for s in samples),
        "spanning_versions": sum(len(s["spans"]) > 1 for s in samples), "span_versions": sorted(named),
        "span_versions_ran": all(named <= versions for versions in ran), "workers_held": [w["version"] for w in workers],
        "worker_steps": [w["steps"] for w in workers],
        "runs_ordered": all(ordered([run["version"] for run in w["runs"]]) for w in workers),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--step-interval", type=float, default=0.5, help="seconds between trainer steps")
    parser.add_argument("--concurrency", type=int, default=4, help="sampling requests kept in flight")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--tail", type=float, default=1.0, help="seconds of sampling after the last update")
    summary = asyncio.run(run(parser.parse_args(argv)))
    print(json.dumps({"summary": summary}), flush=True)
    return 0 if not summary["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
