"""Generations that let versions in between their steps (``Receiver.steps()``): each step
runs on one whole version, commits happen between steps, and the span says which versions
the generation saw. A real sender and receiver over TCP loopback, real AdamW steps; every
step's output is checked against the trainer's weights of the version it reported."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest
import torch
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, receiver_model

from examples.tiny_model import build
from receiver import Receiver, Span
from sender import Sender

TOKENS = torch.tensor([[1, 2, 3, 4]])


def expected(trainer: Trainer, version: int) -> torch.Tensor:
    """The rollout model's output on ``TOKENS`` with the trainer's weights of ``version``."""
    model = build(seed=0).to(torch.bfloat16)
    model.load_state_dict(trainer.expected[version])
    with torch.no_grad():
        return model(TOKENS)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Trainer, Sender, Receiver]]:
    trainer = Trainer()
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=trainer.version)
        async with Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="r", **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)
            yield trainer, sender, receiver


def test_a_span_counts_first_last_and_switches() -> None:
    span = Span()
    assert (span.first, span.last, span.steps, span.mixed) == (None, None, 0, False)
    for v in (3, 3, 4, 4, 6):
        span.saw(v)
    assert (span.first, span.last, span.steps, span.switches, span.mixed) == (3, 6, 5, 2, True)
    assert span.as_dict() == {"first": 3, "last": 6, "steps": 5, "switches": 2}


async def test_versions_commit_between_steps_and_each_step_runs_on_one(pair: Any) -> None:
    trainer, sender, receiver = pair
    steps = receiver.steps()
    ran: list[tuple[int | None, torch.Tensor]] = []
    for i in range(6):
        async with steps.step() as version:
            with torch.no_grad():
                ran.append((version, receiver.model(TOKENS)))
        if i in (1, 3):  # a new version commits between these steps
            v = await trainer.step_and_sync(sender)
            await receiver.wait_for_version(v, timeout=T)
    assert [v for v, _ in ran] == [0, 0, 1, 1, 2, 2]
    assert (steps.span.first, steps.span.last, steps.span.switches) == (0, 2, 2)
    for version, out in ran:
        assert version is not None
        assert torch.equal(out, expected(trainer, version)), f"a step tagged v{version} ran on other weights"


async def test_a_commit_waits_for_the_step_under_way(pair: Any) -> None:
    trainer, sender, receiver = pair
    steps = receiver.steps()
    inside, release = threading.Event(), threading.Event()

    def generate() -> int | None:
        with steps.step_sync() as version:
            inside.set()
            release.wait(T)
            return version

    running = asyncio.create_task(asyncio.to_thread(generate))
    await asyncio.to_thread(inside.wait, T)
    v = await trainer.step_and_sync(sender)
    for _ in range(100):  # the version arrives and is staged; its commit waits for the step
        if receiver.pending_version == v:
            break
        await asyncio.sleep(0.02)
    assert receiver.pending_version == v and receiver.version == 0
    release.set()
    assert await asyncio.wait_for(running, T) == 0
    await receiver.wait_for_version(v, timeout=T)


async def test_each_forward_of_a_generation_in_a_thread_is_a_step(pair: Any) -> None:
    """As a Hugging Face ``generate`` runs: forwards in a thread, a version committed while
    it is under way; the span reports both, and every forward ran on the version it saw."""
    trainer, sender, receiver = pair
    steps = receiver.steps()
    model = receiver.model
    loop = asyncio.get_running_loop()
    outputs: list[tuple[int | None, torch.Tensor]] = []

    def generate() -> Span:
        with steps.each_forward(model) as span:
            for i in range(4):
                with torch.no_grad():
                    out = model(TOKENS)
                outputs.append((span.last, out))
                if i == 1:  # a version is synced and applied while this generation is under way
                    asyncio.run_coroutine_threadsafe(advance(), loop).result(T)
        return span

    async def advance() -> None:
        v = await trainer.step_and_sync(sender)
        await receiver.wait_for_version(v, timeout=T)

    span = await asyncio.to_thread(generate)
    assert (span.first, span.last, span.steps, span.mixed) == (0, 1, 4, True)
    assert [v for v, _ in outputs] == [0, 0, 1, 1]
    for version, out in outputs:
        assert version is not None and torch.equal(out, expected(trainer, version))
    assert "forward" not in model.__dict__  # the class's forward again


# -- a real Hugging Face generate --------------------------------------------------------------
@pytest.mark.parametrize("applied", ["between", "racing"])
async def test_each_forward_of_a_hugging_face_generate_runs_on_one_whole_version(applied: str) -> None:
    """``Qwen2ForCausalLM.generate`` (greedy, no KV cache: every forward reads the whole
    sequence, so each can be recomputed alone) in a thread inside ``each_forward``; the
    trainer (fp32 Qwen2, real AdamW steps) syncs v1 and v2 while it runs: ``between``, each
    applied between two tokens; ``racing``, each synced there and left to commit while the
    next forwards run. The span is what the forwards saw, and every forward's logits are
    those of the trainer's weights of the version it reported, at bf16, bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )

    def qwen(seed: int, dtype: torch.dtype) -> Any:
        torch.manual_seed(seed)
        return transformers.Qwen2ForCausalLM(config).to(dtype).eval()

    trainer = qwen(0, torch.float32).train()
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2, weight_decay=0.0)
    tokens = torch.Generator().manual_seed(7)
    weights = {0: {k: v.detach().to(torch.bfloat16).clone() for k, v in trainer.state_dict().items()}}  # version -> bf16 image
    rollout = qwen(1, torch.bfloat16)
    prompt = torch.tensor([[1, 5, 9, 13]])
    new_tokens, commit_after = 6, (2, 4)  # v1 goes in after the 2nd forward, v2 after the 4th
    ran: list[tuple[int | None, torch.Tensor, torch.Tensor]] = []  # per forward: version, input_ids, last logits
    syncs: list[concurrent.futures.Future[None]] = []

    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer, version=0)
        async with Receiver(rollout, sender.endpoint, CONFIGS["patch"], identity="hf", **DAEMON_KW) as receiver:
            await receiver.start(timeout=T)
            loop = asyncio.get_running_loop()
            steps = receiver.steps()

            async def advance() -> None:
                batch = torch.randint(3, config.vocab_size, (4, 12), generator=tokens)
                loss = trainer(input_ids=batch, labels=batch).loss
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                v = max(weights) + 1
                weights[v] = {k: t.detach().to(torch.bfloat16).clone() for k, t in trainer.state_dict().items()}
                await asyncio.wait_for(sender.sync(trainer, v), T)
                if applied == "between":
                    await receiver.wait_for_version(v, timeout=T)

            def recorded(*args: Any, **kwargs: Any) -> Any:  # the model's own forward, inside each step
                out = type(rollout).forward(rollout, *args, **kwargs)
                ran.append((steps.span.last, kwargs["input_ids"].clone(), out.logits[:, -1].clone()))
                return out

            class Between(transformers.LogitsProcessor):  # runs between forwards, outside their steps
                def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                    if len(ran) in commit_after:
                        syncs.append(asyncio.run_coroutine_threadsafe(advance(), loop))
                        syncs[-1].result(T)  # built (``racing``: its commit may wait for the forwards after)
                    return scores

            def generate() -> tuple[Span, torch.Tensor]:
                with steps.each_forward(rollout) as span, torch.no_grad():
                    out = rollout.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, use_cache=False,
                                           max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                           logits_processor=transformers.LogitsProcessorList([Between()]))
                return span, out

            rollout.forward = recorded  # each_forward wraps it, and gives it back after
            span, out = await asyncio.to_thread(generate)
            assert rollout.forward == recorded
            del rollout.forward
            await receiver.wait_for_version(2, timeout=T)

    assert out.shape == (1, prompt.shape[1] + new_tokens) and len(syncs) == 2
    versions = [v for v, _, _ in ran]
    if applied == "between":
        assert versions == [0, 0, 1, 1, 2, 2]
    assert versions[:2] == [0, 0] and versions == sorted(versions) and set(versions) <= {0, 1, 2}
    assert (span.first, span.last, span.steps) == (0, versions[-1], new_tokens)
    assert span.switches == sum(a != b for a, b in itertools.pairwise(versions))
    reference = qwen(2, torch.bfloat16)
    for version, input_ids, logits in ran:
        matches = []
        for v, state in weights.items():  # the reported version's, and no other's
            reference.load_state_dict(state)
            with torch.no_grad():
                if torch.equal(reference(input_ids=input_ids).logits[:, -1], logits):
                    matches.append(v)
        assert matches == [version], f"a forward tagged v{version} computed the logits of {matches}"
