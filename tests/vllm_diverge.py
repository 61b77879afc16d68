"""Two tensor-parallel workers that land on different versions are evened out (run by
tests/test_vllm.py, TP=2 on vLLM's CPU backend).

The trainer's v1 reaches one worker as it is; the other worker's copy is held at the
corrupting proxy (tests/proxy.py) until v2 has been synced, then delivered with flipped
payload bytes, followed by v2. That worker refuses v1 (checksum), refuses v2 (not on its
version) and is resynced by the sender, which is at v2 by then: its resync stages, held,
at v2. ``update_weights(version=1)`` then commits v1 on the first worker and the resync,
past the target, on the second; the backend must bring both to v2 before it returns (the
rounds in ``WeightsyncEngine.receive_weights``), and the engine must equal vLLM's own
load of the trainer's v2 weights (the engine reloaded from them in place). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # worker_versions runs in the workers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from proxy import Corrupt, Proxy, Wire  # noqa: E402
from vllm_faults import against_reference, background_loop, followed, wait  # noqa: E402

from examples.vllm_rollout import CONFIG, Trainer, engine  # noqa: E402
from protocol.wire.framing import MessageType  # noqa: E402


@dataclass
class HoldOneConnectionsPatch(Corrupt):
    """The first connection to carry a PATCH gets every one as it is. On any other, the
    first PATCH is held back, and delivered corrupted just before the next PATCH there."""

    first: int | None = None
    held: Wire | None = None
    seen: list[tuple[int, int | None, int | None]] = field(default_factory=list)  # (connection, type, version)

    def emit(self, w: Wire) -> list[Wire]:
        self.seen.append((w.connection, w.type, w.version))
        if w.type != MessageType.PATCH:
            return [w]
        if self.first is None:
            self.first = w.connection
        if w.connection == self.first:
            return [w]
        if self.held is None and self.hits == 0:
            self.hits += 1
            self.held = w
            return []
        if self.held is not None and self.held.connection == w.connection:
            held, self.held = self.held, None
            return [*self.act(held), w]
        return [w]


def worker_versions(worker: Any) -> tuple[int | None, int | None]:
    receiver = worker.weight_transfer_engine.receiver
    return receiver.version, receiver.pending_version


def pendings(llm: Any) -> list[int | None]:
    """Each worker's staged version, None first."""
    return sorted((p for _, p in llm.collective_rpc(worker_versions)), key=lambda p: -1 if p is None else p)


def main() -> int:
    run = background_loop()

    trainer = Trainer(tie=False, lr=2e-6)
    port = int(trainer.sender.endpoint.rsplit(":", 1)[1])
    tamper = HoldOneConnectionsPatch(lambda w: True, limit=None)
    proxy = Proxy(("127.0.0.1", port), tamper=tamper)
    run(proxy.start())
    workdir = tempfile.mkdtemp(prefix="weightsync-vllm-diverge-")
    trainer.config.save_pretrained(workdir)
    llm = engine(workdir, weightsync=True, tp=2, dummy=True)
    llm.init_weight_transfer_engine({"init_info": {"endpoint": proxy.endpoint, "config": CONFIG, "timeout": 120}})
    out: dict[str, Any] = {}

    trainer.step()  # v1: one worker stages it, the other's copy is held at the proxy
    wait(lambda: tamper.held is not None, 30, "the second worker's copy of v1 at the proxy")
    wait(lambda e=llm: pendings(e) == [None, 1], 30, "v1 staged on one worker")
    trainer.step()  # v2: releases the held v1, corrupted, to the other worker, then v2

    def resyncs() -> list[int | None]:  # bootstraps after the first patch, to the other worker
        start = next(i for i, (_, t, _) in enumerate(tamper.seen) if t == MessageType.PATCH)
        return [v for c, t, v in tamper.seen[start:] if t == MessageType.BOOTSTRAP and c != tamper.first]

    wait(lambda: 2 in resyncs(), 30, "the second worker's resync at v2")
    wait(lambda e=llm: pendings(e) == [1, 2], 30, "v1 and the resync (v2) staged")
    out["staged_before"] = pendings(llm)
    out["resync_versions"] = sorted(set(resyncs()))
    out["flipped"] = tamper.flipped
    llm.start_weight_update()
    llm.update_weights({"update_info": {"version": 1, "timeout": 60}})
    llm.finish_weight_update("2")
    out["versions_after"] = [v for v, _ in llm.collective_rpc(worker_versions)]

    ended = followed(llm, trainer.save, "weightsync-vllm-diverge-ref-")
    out.update(against_reference(ended, llm, tp=2))
    trainer.close()
    run(proxy.close())
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
