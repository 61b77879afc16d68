"""Generations that let versions in between their steps (``Receiver.steps()``): each step
runs on one whole version, commits happen between steps, and the span says which versions
the generation saw. A real sender and receiver over TCP loopback, real AdamW steps; every
step's output is checked against the trainer's weights of the version it reported."""

from __future__ import annotations

import asyncio
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
