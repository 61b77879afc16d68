"""Faults under a real vLLM engine on the weightsync backend (run by tests/test_vllm.py).

One offline engine follows a trainer process (tests/vllm_trainer.py) through the
corrupting proxy (tests/proxy.py):

1. the first patch arrives with flipped payload bytes: the worker's receiver refuses it
   (checksum) and NACKs, and the sender resyncs it with a bootstrap; the resync stages
   (hold) and vLLM's checksums do not move until ``update_weights``, which lands the version;
2. the trainer process is killed with SIGKILL and a new one (another seed: other weights, a
   new session) started at the same address: the engine's receiver reconnects, is
   resynced, and ``update_weights`` follows the new trainer;
3. the engine then equals vLLM's own load of the new trainer's weights (the same engine
   reloaded from them in place by vLLM: tokens, logprobs, checksums).

Prints one JSON object.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # weights_differing runs in the workers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from proxy import CorruptAndRecord, Proxy, of_type  # noqa: E402

from examples.vllm_rollout import CONFIG, checksums, compare, engine, generate, reloaded, tiny_config, weights_differing  # noqa: E402
from protocol.wire.framing import MessageType  # noqa: E402

TRAINER = Path(__file__).resolve().parent / "vllm_trainer.py"


class TrainerProcess:
    def __init__(self, endpoint: str, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(TRAINER), "--endpoint", endpoint, "--seed", str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.endpoint = self._read()["endpoint"]
        self.version = 0

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the trainer process exited ({self.proc.wait()})")
        return json.loads(line)

    def command(self, text: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        return self._read()

    def step(self) -> int:
        self.version = int(self.command("step")["version"])
        return self.version

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def background_loop() -> Any:
    """An event loop on a daemon thread (the proxy's), and how to run a coroutine on it."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result(60)


@dataclass
class Followed:
    """What the engine that followed the trainer produced, and the trainer's weights saved
    beside it, read before vLLM reloads them as the reference."""

    generated: Any
    checksums: Any
    reference: str
    weights_differing: Any


def followed(llm: Any, save: Callable[[str], Any], prefix: str) -> Followed:
    """The engine's tokens, logprobs and checksums, the weights ``save(directory)`` writes,
    and which of the engine's weights differ from them."""
    generated, ours = generate(llm), checksums(llm)
    reference = tempfile.mkdtemp(prefix=prefix)
    save(reference)
    return Followed(generated, ours, reference, llm.collective_rpc(weights_differing, args=(reference,)))


def against_reference(f: Followed, llm: Any, tp: int) -> dict[str, Any]:
    """vLLM's own figures for ``f``'s saved weights, against ``f``: the followed engine
    ``llm`` reloaded from them in place by vLLM (examples/vllm_rollout.py: ``reloaded``)."""
    expected, theirs = reloaded(llm, f.reference)
    out: dict[str, Any] = {"weights_differing": f.weights_differing}
    out.update(compare(f.generated, expected, tp))
    out["checksums_equal"] = f.checksums == theirs
    return out


def main() -> int:
    run = background_loop()

    trainer = TrainerProcess("tcp://127.0.0.1:0", seed=0)
    port = int(trainer.endpoint.rsplit(":", 1)[1])
    tamper = CorruptAndRecord(of_type(MessageType.PATCH, payload=True), limit=1)
    proxy = Proxy(("127.0.0.1", port), tamper=tamper)
    run(proxy.start())
    workdir = tempfile.mkdtemp(prefix="weightsync-vllm-faults-")
    tiny_config(tie=True).save_pretrained(workdir)
    llm = engine(workdir, weightsync=True, tp=1, dummy=True)
    llm.init_weight_transfer_engine({"init_info": {"endpoint": proxy.endpoint, "config": CONFIG, "timeout": 120}})
    out: dict[str, Any] = {}

    # 1. a corrupted patch: refused, resynced, staged; nothing written until update_weights
    before = checksums(llm)
    trainer.step()
    wait(lambda: tamper.hits == 1, 30, "the corrupted patch")
    first = tamper.seen.index(MessageType.PATCH) + 1  # what came after the corrupted patch
    wait(lambda: MessageType.BOOTSTRAP in tamper.seen[first:], 30, "the sender's resync after the NACK")
    time.sleep(0.5)  # the resync reaches the worker and waits there, staged
    out["corrupt_checksums_unchanged"] = checksums(llm) == before
    out["resync_bootstraps"] = tamper.seen[first:].count(MessageType.BOOTSTRAP)
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1, "timeout": 60}})
    llm.finish_weight_update("1")
    out["checksums_moved_after_update"] = checksums(llm) != before

    # 2. the trainer is killed; another one (other weights, a new session) takes its address
    trainer.kill()
    trainer = TrainerProcess(f"tcp://127.0.0.1:{port}", seed=1)
    for _ in range(3):
        trainer.step()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": trainer.version, "timeout": 90}})
    llm.finish_weight_update(str(trainer.version))
    out["followed_to"] = trainer.version

    # 3. equal to vLLM's own load of the new trainer's weights
    ended = followed(llm, lambda directory: trainer.command(f"save {directory}"), "weightsync-vllm-faults-ref-")
    out.update(against_reference(ended, llm, tp=1))
    trainer.kill()
    run(proxy.close())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
