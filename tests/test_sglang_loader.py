"""The SGLang loader's command protocol and its worker-side state machine, without SGLang.

SGLang hands a custom weight loader ``(model, [(name, tensor)])`` in its scheduler process,
and an exception in one ends the engine. These tests call ``receiver.sglang.loader.weightsync``
as SGLang does, over a plain torch model whose ``load_weights`` copies tensors by name (the
contract SGLang's models follow), with a real ``Sender`` and the real reply socket: every
command is answered, none raises, a bad one writes nothing. The real engine's tests are
tests/test_sglang_weightsync.py (SGLang's venv).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, receiver_model
from torch import nn

from protocol.errors import ConfigError
from protocol.wire.dtypes import bit_view
from receiver.sglang import loader
from receiver.sglang.commands import NAME, Answer, Command, Op, parse_command
from sender import Sender


class Model(nn.Module):
    """A rollout model as SGLang's are called: ``load_weights`` takes ``[(name, tensor)]``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = receiver_model()

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        state = self.inner.state_dict(keep_vars=True)  # parameters and buffers, by checkpoint name
        for name, t in weights:
            state[name].data.copy_(t)


@pytest.fixture
def reply() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind("tcp://127.0.0.1:*")
    try:
        yield sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        sock.close(0)
        ctx.term()


def call(model: nn.Module, reply: tuple[zmq.Socket[bytes], str], op: Op, **args: Any) -> Answer:
    """One command as SGLang runs it (the loader returns nothing), and its answer."""
    sock, address = reply
    command = Command(op, uuid.uuid4().hex, address, args)
    assert loader.weightsync(model, command.named_tensors()) is None
    assert sock.poll(int(T * 1000)), f"no answer to {op.value}"
    answer = Answer.unpack(sock.recv())
    assert answer.call == command.call
    return answer


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_command_round_trips_and_anything_else_is_refused() -> None:
    command = Command(Op.UPDATE, "abc", "tcp://127.0.0.1:5", {"version": 3, "timeout": 1.5})
    assert parse_command(command.named_tensors()) == command
    good = command.tensor()
    bad_inputs: list[list[tuple[str, Any]]] = [
        [],
        [("model.embed_tokens.weight", good)],  # a weight, not a command
        [(NAME, good), (NAME, good)],
        [(NAME, good.to(torch.int16))],
        [(NAME, good.view(1, -1))],
        [(NAME, torch.zeros(10, dtype=torch.uint8))],  # not msgpack of a map
        [(NAME, torch.frombuffer(bytearray(msgpack.packb({"op": "explode", "call": "x", "reply": "y"})), dtype=torch.uint8))],
        [(NAME, torch.frombuffer(bytearray(msgpack.packb({"op": "status", "call": 1, "reply": "y"})), dtype=torch.uint8))],
        [(NAME, torch.zeros(2 << 20, dtype=torch.uint8))],  # past MAX_COMMAND
    ]
    for named in bad_inputs:
        with pytest.raises(ConfigError):
            parse_command(named)


def test_a_malformed_call_never_raises_into_sglang_and_writes_nothing() -> None:
    model = Model()
    before = snapshot(model)
    assert loader.weightsync(model, [("model.embed_tokens.weight", torch.zeros(3))]) is None
    assert loader.weightsync(model, [(NAME, torch.zeros(7, dtype=torch.uint8))]) is None
    after = snapshot(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_init_update_status_and_shutdown_answer_and_never_raise(reply: tuple[zmq.Socket[bytes], str]) -> None:
    """The whole life of one worker: every refusal is an answer naming its type, the weights
    untouched by it; the accepted commands leave the model at the trainer's version."""
    trainer = Trainer()
    model = Model()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await sender.start(trainer.model, version=trainer.version)
    run = asyncio.to_thread
    try:
        before = snapshot(model)
        early = await run(call, model, reply, Op.UPDATE, version=1)
        assert early.error_code == "state" and early.version is None  # not initialised
        assert all(torch.equal(before[k], v) for k, v in snapshot(model).items())

        init = await run(call, model, reply, Op.INIT, endpoint=sender.endpoint, config=CONFIGS["patch"], timeout=T)
        assert init.error is None and init.version == 0 and init.world == 1 and init.info["tensors"] == len(trainer.expected[0])
        assert_holds(model, trainer, 0)

        again = await run(call, model, reply, Op.INIT, endpoint=sender.endpoint, timeout=T)
        assert again.error_code == "state" and again.version == 0  # the first keeps working

        await trainer.step_and_sync(sender)
        bad = await run(call, model, reply, Op.UPDATE, version="not a version")
        assert bad.error_code == "config" and bad.version == 0
        assert_holds(model, trainer, 0)  # staged, not written: nothing outside an update

        late = await run(call, model, reply, Op.UPDATE, version=5, timeout=1.0)
        assert late.error_code == "timeout" and late.version == 1  # v1 committed on the way; v5 never came

        await trainer.step_and_sync(sender)
        done = await run(call, model, reply, Op.UPDATE, version=2, timeout=T)
        assert done.error is None and done.version == 2 and "commit_s" in done.info
        assert_holds(model, trainer, 2)

        status = await run(call, model, reply, Op.STATUS)
        assert status.version == 2 and status.info["version"] == 2

        gone = await run(call, model, reply, Op.SHUTDOWN)
        assert gone.error is None
        after = await run(call, model, reply, Op.UPDATE, version=2)
        assert after.error_code == "state"
        assert_holds(model, trainer, 2)  # the weights stay
    finally:
        await run(loader.weightsync, model, Command(Op.SHUTDOWN, "x", "inproc://nobody").named_tensors())
        await sender.close()


def assert_holds(model: Model, trainer: Trainer, version: int) -> None:
    state = model.inner.state_dict()
    for name, want in trainer.expected[version].items():
        assert torch.equal(bit_view(state[name]), bit_view(want)), f"{name} is not v{version}"


class SkipsSome(Model):
    """A loader that silently skips names it does not know (SGLang's does, for the fused
    expert names transformers 5 keeps in memory): their parameters are never written."""

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        super().load_weights([(n, t) for n, t in weights if ".mlp." not in n])


class RaisesHalfway(Model):
    """A loader that writes some tensors, then refuses a name."""

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(weights[:-1])
        raise KeyError(weights[-1][0])


@pytest.mark.parametrize("model_class", [SkipsSome, RaisesHalfway])
async def test_a_refused_init_leaves_the_weights_it_found(model_class: type[Model], reply: tuple[zmq.Socket[bytes], str]) -> None:
    """Probing writes random bits into every parameter; an init that fails after that (a
    parameter no trainer tensor reaches, a loader refusing a name) puts the engine's weights
    back, bit for bit, and says why."""
    trainer = Trainer()
    model = model_class()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await sender.start(trainer.model, version=trainer.version)
    try:
        before = snapshot(model)
        answer = await asyncio.to_thread(call, model, reply, Op.INIT, endpoint=sender.endpoint, config=CONFIGS["patch"], timeout=T)
        assert answer.error_code == "metadata_mismatch" and answer.version is None
        assert ("reached by none of the trainer's tensors" in answer.error) == (model_class is SkipsSome), answer.error
        after = snapshot(model)
        assert all(torch.equal(bit_view(before[k]), bit_view(after[k])) for k in before)
    finally:
        await sender.close()
