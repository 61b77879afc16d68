"""What a driver says to the weightsync loader in SGLang's workers, and what each worker
answers: both sides of ``receiver/sglang`` (the driver's ``client.py`` and the workers'
``loader.py``) and nothing else.

SGLang hands a custom weight loader nothing but ``(model, [(name, tensor)])``, so a command
travels as one named tensor: ``("weightsync", uint8 tensor of its msgpack bytes)``. A
worker cannot answer through SGLang (a custom loader's return value is dropped, and an
exception in it ends SGLang's scheduler process, the whole engine with it), so each worker
answers on a ZeroMQ socket the driver binds for the call (``reply``): one ``Answer`` per
worker, the call's id echoed, so an answer to an earlier call that timed out is never taken
for this one's.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import torch

from protocol.errors import ConfigError

NAME = "weightsync"  # the named tensor that carries a command
LOADER = "receiver.sglang.loader.weightsync"  # what SGLang's --custom-weight-loader and load_format name
MAX_COMMAND = 1 << 20  # bytes: a command is a few hundred (an init with a name mapping: more)


class Op(str, enum.Enum):
    INIT = "init"  # start the worker's receiver and bootstrap (args: HeldInit's fields)
    UPDATE = "update"  # commit up to a version (args: version, timeout, verify_checksum)
    STATUS = "status"  # the version held and the steps run (no write)
    SHUTDOWN = "shutdown"  # stop the receiver; the weights stay


@dataclass(frozen=True)
class Command:
    op: Op
    call: str  # the driver's id for this call, echoed in every answer
    reply: str  # the driver's PULL socket (tcp://host:port, ipc://path)
    args: dict[str, Any] = field(default_factory=dict)

    def tensor(self) -> torch.Tensor:
        data = msgpack.packb({"op": self.op.value, "call": self.call, "reply": self.reply, "args": self.args}, use_bin_type=True)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(NAME, self.tensor())]


def parse_command(named_tensors: list[tuple[str, torch.Tensor]]) -> Command:
    """The command in what SGLang handed the loader; ``ConfigError`` for anything else."""
    if len(named_tensors) != 1 or named_tensors[0][0] != NAME:
        names = [n for n, _ in named_tensors[:3]]
        raise ConfigError(f"the weightsync loader takes one tensor named {NAME!r} (a command), got {len(named_tensors)}: {names}")
    t = named_tensors[0][1]
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 1 or t.numel() > MAX_COMMAND:
        raise ConfigError(f"a weightsync command is a 1-D uint8 tensor of at most {MAX_COMMAND} bytes")
    try:
        raw = msgpack.unpackb(t.cpu().numpy().tobytes(), raw=False)
        op, call, reply, args = Op(raw["op"]), raw["call"], raw["reply"], raw.get("args", {})
    except Exception as e:  # msgpack's errors, a missing key, an unknown op
        raise ConfigError(f"not a weightsync command: {type(e).__name__}: {e}") from e
    if not isinstance(call, str) or not isinstance(reply, str) or not isinstance(args, dict):
        raise ConfigError("a weightsync command's call and reply are strings and its args a map")
    return Command(op, call, reply, args)


@dataclass(frozen=True)
class Answer:
    """One worker's outcome of one command. ``error``: the exception's message when it failed,
    and ``error_code`` its class as the wire names it (``protocol.errors.WIRE_CODES``); the
    weights are then at ``version``, the last fully applied."""

    call: str
    rank: int
    world: int
    version: int | None
    error: str | None = None
    error_code: str | None = None
    info: dict[str, Any] = field(default_factory=dict)  # the op's own: timings, steps

    def pack(self) -> bytes:
        data: bytes = msgpack.packb(asdict(self), use_bin_type=True)
        return data

    @classmethod
    def unpack(cls, data: bytes) -> Answer:
        raw = msgpack.unpackb(data, raw=False)
        return cls(**raw)
