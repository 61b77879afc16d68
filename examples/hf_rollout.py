"""A Hugging Face transformers rollout fed by weightsync, with trainer names mapped.

The trainer holds a PPO-style actor-critic: the language model is its ``policy``
submodule (names ``policy.model.layers.0...``) next to a value head the rollout never
runs. The rollout is a plain ``Qwen2ForCausalLM`` in bf16 (names ``model.layers.0...``),
built from a config in code, so nothing is downloaded. The receiver's
``name_mapping=add_prefix("policy.")`` says how the names correspond; the sender serves
only the policy's tensors, because the handshake requires both sides to hold exactly the
same keys.

Tied embeddings: both models are built from one config with ``tie_word_embeddings=True``
(as Qwen2.5-0.5B is), so on both sides ``lm_head.weight`` *is* ``embed_tokens.weight``;
weightsync finds the tie by storage identity and sends that tensor once. Keep the ties
equal on both sides (``check_ties``): a rollout that ties what the trainer does not would
have two different tensors written into one storage.

One process, two asyncio tasks over TCP loopback: the trainer does real AdamW steps and
syncs each version; on-policy, it waits for the rollout's generations made with that
version, which the rollout produces with ``model.generate`` under ``receiver.reading()``.
Prints a JSON line per version.

    python examples/hf_rollout.py --steps 5
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformers import Qwen2Config, Qwen2ForCausalLM

from protocol.errors import ConfigError
from protocol.host.cli import report, setup_logging
from protocol.wire.checksum import state_digest
from receiver import Receiver
from receiver.naming import add_prefix
from sender import Sender

POLICY = "policy."  # where the trainer keeps the language model
NAME_MAPPING = add_prefix(POLICY)  # rollout name -> trainer name
PROMPT = [[5, 6, 7, 8]]


def tiny_config(tie_word_embeddings: bool = True) -> Qwen2Config:
    """A Qwen2 small enough for two shared cores; same architecture as the real ones."""
    return Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


def build_rollout(config: Qwen2Config, seed: int = 1234) -> Qwen2ForCausalLM:
    """The inference model: bf16, eval mode, its own (wrong) weights until the bootstrap."""
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).to(torch.bfloat16).eval()


class ActorCritic(nn.Module):
    """The trainer's model: the policy LM plus a value head that stays on the trainer."""

    def __init__(self, config: Qwen2Config, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.policy = Qwen2ForCausalLM(config)
        self.value_head = nn.Linear(config.hidden_size, 1)

    def synced_state(self) -> dict[str, torch.Tensor]:
        """What the rollout runs, under trainer names: views of the live parameters, so
        every optimizer step shows through; the value head is left out."""
        return {k: v for k, v in self.state_dict().items() if k.startswith(POLICY)}


def check_ties(model: nn.Module, config: Qwen2Config) -> None:
    """Both sides must agree on the embedding tie; the config says which it is."""
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied != config.tie_word_embeddings:
        raise ConfigError(f"{type(model).__name__}: lm_head tied={tied}, config says {config.tie_word_embeddings}")


def train_step(agent: ActorCritic, optimizer: torch.optim.Optimizer, generator: torch.Generator, batch: int = 8, length: int = 24) -> float:
    """One real AdamW step: next-token loss on counting sequences plus a value regression
    (a stand-in for PPO's losses, with the same parameters and optimizer)."""
    vocab = agent.policy.config.vocab_size
    start = torch.randint(3, vocab, (batch, 1), generator=generator)
    tokens = 3 + (start + torch.arange(length)) % (vocab - 3)  # counting, past the special tokens
    out = agent.policy(input_ids=tokens, labels=tokens, output_hidden_states=True)
    values = agent.value_head(out.hidden_states[-1]).squeeze(-1)
    loss = out.loss + 0.5 * values.pow(2).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def bf16(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}


def trainer_digest(agent: ActorCritic) -> str:
    """What a bf16 rollout must hold, under trainer names."""
    return state_digest(bf16(agent.synced_state()))


def rollout_digest(model: nn.Module, mapping: Callable[[str], str] = NAME_MAPPING) -> str:
    """The rollout's state under trainer names: equal to ``trainer_digest`` when synced."""
    return state_digest({mapping(k): v for k, v in model.state_dict().items()})


@torch.no_grad()
def generate(model: Qwen2ForCausalLM, prompt: list[list[int]] = PROMPT, new_tokens: int = 6) -> list[int]:
    """Greedy decoding of exactly ``new_tokens`` tokens (no early stop, so runs compare)."""
    out = model.generate(torch.tensor(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt[0]):].tolist()


async def main(args: argparse.Namespace) -> dict[str, object]:
    config = tiny_config(tie_word_embeddings=not args.untied)
    agent, rollout = ActorCritic(config), build_rollout(config)
    check_ties(agent.policy, config)
    check_ties(rollout, config)
    optimizer = torch.optim.AdamW(agent.parameters(), lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    samples: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    started = time.perf_counter()
    equal = 0

    async with Sender(args.endpoint, args.config) as sender:
        await sender.start(agent.synced_state(), version=0)
        report("listening", endpoint=sender.endpoint, tensors=len(agent.synced_state()), tied=config.tie_word_embeddings)
        async with Receiver(rollout, sender.endpoint, args.config, identity="hf-rollout-0", name_mapping=NAME_MAPPING) as receiver:

            async def rollout_task() -> None:
                for version in range(0, args.steps + 1):
                    await receiver.wait_for_version(version, timeout=60)
                    async with receiver.reading():  # no version is committed while generating
                        held = receiver.version
                        tokens = await asyncio.to_thread(generate, rollout)
                        digest = await asyncio.to_thread(rollout_digest, rollout)
                    report("generated", version=held, tokens=tokens, digest=digest)
                    await samples.put((held, tokens))

            async def trainer_task() -> None:
                nonlocal equal
                held, _ = await samples.get()  # the rollout generated with the bootstrap (v0)
                for step in range(1, args.steps + 1):
                    loss = await asyncio.to_thread(train_step, agent, optimizer, generator)
                    stats = await sender.sync(agent.synced_state(), step)
                    await sender.flush()  # only so the line below can report wire bytes
                    digest = await asyncio.to_thread(trainer_digest, agent)
                    report("synced", loss=round(loss, 4), digest=digest, **stats.as_dict())
                    held, _ = await samples.get()  # on-policy: wait for generations made with this version
                    if held != step:
                        raise RuntimeError(f"the rollout generated with v{held}, expected v{step}")
                    async with receiver.reading():
                        equal += await asyncio.to_thread(rollout_digest, rollout) == digest

            await receiver.start(timeout=60)
            await asyncio.gather(rollout_task(), trainer_task())
    summary = {"versions": args.steps, "digests_equal": equal, "seconds": round(time.perf_counter() - started, 2)}
    report("done", **summary)
    return summary


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:0", help="where the sender binds (port 0: any free port)")
    p.add_argument("--config", help="weight_syncer YAML (default: patch defaults)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--untied", action="store_true", help="tie_word_embeddings=False on both sides")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the model is tiny)")
    p.add_argument("--log-level", default="WARNING")
    args = p.parse_args()
    setup_logging(args.log_level)
    torch.set_num_threads(args.threads)
    summary = asyncio.run(main(args))
    sys.exit(0 if summary["digests_equal"] == args.steps else 1)
