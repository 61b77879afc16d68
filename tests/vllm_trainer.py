"""A trainer process for tests/vllm_faults.py, so that it can be killed with SIGKILL.

The example's Trainer (Qwen2, fp32, AdamW) behind a Sender bound at ``--endpoint``. Reads
commands on stdin, one a line: ``step`` (one step, synced and encoded; prints
``{"version", "changed_fraction"}``) and ``save DIR`` (its weights as a bf16 checkpoint;
prints ``{"saved": DIR}``). Prints ``{"endpoint": ...}`` once serving.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.vllm_rollout import Trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=2e-6)
    args = parser.parse_args()
    trainer = Trainer(tie=True, lr=args.lr, seed=args.seed, endpoint=args.endpoint)
    print(json.dumps({"endpoint": trainer.sender.endpoint, "version": trainer.version}), flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "step":
            step = trainer.step()
            trainer.run(trainer.sender.flush())
            print(json.dumps(step), flush=True)
        elif command == "save":
            trainer.save(arg)
            print(json.dumps({"saved": arg}), flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
