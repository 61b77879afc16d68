"""The weightsync receiver inside SGLang's workers, reached through SGLang's own
``--custom-weight-loader`` extension point.

Start SGLang with ``custom_weight_loader=["receiver.sglang.loader.weightsync"]`` (``sglang.Engine``)
or ``--custom-weight-loader receiver.sglang.loader.weightsync`` (``launch_server``); SGLang imports
this module in each scheduler process (one per TP rank) and calls ``weightsync(model,
named_tensors)`` for every ``update_weights_from_tensor(..., load_format=LOADER)``, which it
allows only between ``begin_weight_update`` and ``end_weight_update``. The driver
(``receiver.sglang.client``) sends one command a call (``commands.py``): ``init`` starts a
held receiver in the worker (``receiver.held.worker.HeldWorker``) over the model as the
probe-recorded map places it and bootstraps it to the trainer's version; ``update`` commits
every staged version up to a target, in order, each all or nothing; ``status``;
``shutdown``. Versions are received and staged in the background while SGLang generates;
the model is written only inside these calls, so only inside SGLang's window, after which
SGLang re-runs the layers' post-load processing (``end_weight_update``) and flushes its cache.

Nothing raises out of ``weightsync``: an exception in a custom loader ends SGLang's
scheduler process, and the engine with it. Every outcome, a failure included, is answered
to the driver on its reply socket, and a failed command has left the weights at the last
fully applied version. Commands come from SGLang's scheduler thread one at a time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch
import zmq

from protocol.errors import ConfigError, StateError, error_code

from ..held.worker import HeldInit, HeldWorker, check_update
from .commands import Answer, Command, Op, parse_command
from .side import SGLangSide

log = logging.getLogger(__name__)
ANSWER_TIMEOUT_MS = 10_000  # a driver that went away does not hold the worker longer than this

# One worker per model (SGLang runs one model per scheduler process; a draft model would be another).
_WORKERS: dict[int, HeldWorker] = {}
_LOCK = threading.Lock()


def weightsync(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader: run one weightsync command, answer it, never raise."""
    try:
        command = parse_command(named_tensors)
    except ConfigError as e:  # no reply address to answer on: said in SGLang's log, the model untouched
        log.error("weightsync: %s", e)
        return
    held = _WORKERS.get(id(model))
    try:
        with _LOCK:
            info = _run(model, command)
        held = _WORKERS.get(id(model))
        answer = _answer(command, held, info=info)
    except Exception as e:  # answered; the receiver keeps the last whole version
        log.error("weightsync: %s failed: %s: %s", command.op.value, type(e).__name__, e)
        answer = _answer(command, _WORKERS.get(id(model), held), error=e)
    _send(command.reply, answer)


def _run(model: torch.nn.Module, command: Command) -> dict[str, Any]:
    held = _WORKERS.get(id(model))
    args = command.args
    if command.op is Op.INIT:
        if held is not None and held.receiver is not None:
            raise StateError("the weightsync worker is already initialised; shut it down first")
        dtype = _dtype(model, args.pop("dtype", None))
        held = HeldWorker(model, dtype, SGLangSide())
        held.start(HeldInit(**args))  # a failure leaves nothing running
        _WORKERS[id(model)] = held
        return {"tensors": len(held.layout.tensors) if held.layout else 0,
                "reloaded_layers": len(held.layout.reloads.layers) if held.layout else 0}
    if held is None:
        raise StateError("the weightsync worker is not initialised: send init first")
    if command.op is Op.UPDATE:
        version, timeout, verify = args.get("version"), args.get("timeout", 60.0), args.get("verify_checksum", False)
        check_update(version, timeout, verify)
        held.update(version, timeout, verify)
        return dict(held.last_timing)
    if command.op is Op.STATUS:
        return held.step_versions.snapshot() if held.step_versions is not None else {}
    held.shutdown()  # Op.SHUTDOWN
    _WORKERS.pop(id(model), None)
    return {}


def _dtype(model: torch.nn.Module, name: str | None) -> torch.dtype:
    """The dtype the engine holds its weights in: the driver's word (SGLang's ``--dtype``
    resolved), else what most of the model's floating-point elements are in."""
    if name is not None:
        dtype = getattr(torch, str(name).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"init dtype {name!r} is not a torch dtype")
        return dtype
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.dtype.is_floating_point:
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    if not counts:
        raise ConfigError("the model has no floating-point parameters to take its dtype from; pass init dtype")
    return max(counts, key=lambda d: counts[d])


def _answer(command: Command, held: HeldWorker | None, *, info: dict[str, Any] | None = None, error: Exception | None = None) -> Answer:
    side = held.side if held is not None else SGLangSide()
    world = side.world()
    rank = side.rank() if world > 1 else 0
    return Answer(command.call, rank, world, held.version if held is not None else None,
                  error=None if error is None else str(error), error_code=None if error is None else error_code(error),
                  info=info or {})


def _send(reply: str, answer: Answer) -> None:
    """One answer on the driver's socket; a driver gone away costs at most ANSWER_TIMEOUT_MS."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, ANSWER_TIMEOUT_MS)
        sock.setsockopt(zmq.SNDTIMEO, ANSWER_TIMEOUT_MS)
        sock.connect(reply)
        sock.send(answer.pack())
    except zmq.ZMQError as e:
        log.error("weightsync: could not answer %s on %s: %s", answer.call, reply, e)
    finally:
        sock.close()
