"""One error family (protocol/errors.py): the wire codes of both directions, the
timeout every public wait raises, and ZeroMQ's errors raised as ``TransportError``.

The codes are on the wire (an ERROR message's ``code``, a sidecar hand-off's error reply):
the strings below are written out literally so that renaming one fails here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from daemon_helpers import CONFIGS, DAEMON_KW, T, Trainer, receiver_model

from protocol.errors import (
    GENERIC_CODE,
    UNKNOWN_PEER,
    WIRE_CODES,
    ConfigError,
    IntegrityError,
    MetadataMismatchError,
    PlacementError,
    ProtocolError,
    ResyncLimitError,
    SharedMemoryError,
    StaleVersionError,
    StateError,
    TransportError,
    WeightSyncError,
    WeightSyncTimeout,
    WriteCheckError,
    error_code,
    error_from_code,
)
from protocol.net.sockets import DealerSocket, RouterSocket
from protocol.wire.framing import MessageType, decode_message, encode_message
from protocol.wire.messages import ErrorReport
from receiver import Receiver
from receiver.describe import ask_metadata
from sender import Sender
from sender.serve.client import SidecarClient, error_reply

# Every code that travels today, and the class each names.
CODES: dict[str, type[WeightSyncError]] = {
    "metadata_mismatch": MetadataMismatchError,
    "stale_version": StaleVersionError,
    "shared_memory": SharedMemoryError,
    "config": ConfigError,
    "protocol": ProtocolError,
    "resync_limit": ResyncLimitError,
    "state": StateError,
    "write_check": WriteCheckError,  # an SGLang worker's answer (receiver/sglang/commands.py)
    "timeout": WeightSyncTimeout,
}


def test_the_table_holds_every_code_on_the_wire() -> None:
    assert {code: cls for cls, code in WIRE_CODES.items()} == CODES
    assert (GENERIC_CODE, UNKNOWN_PEER) == ("error", "unknown_peer")


@pytest.mark.parametrize("code", sorted(CODES))
def test_every_code_round_trips(code: str) -> None:
    cls = CODES[code]
    assert error_code(cls("boom")) == code
    back = error_from_code(code, "boom")
    assert type(back) is cls and str(back) == "boom"
    # both directions carry it: an ERROR message, and a sidecar's error reply
    msg = decode_message(encode_message(ErrorReport.of(cls("boom")).to_message()))
    assert msg.type is MessageType.ERROR and msg.body == {"code": code, "message": "boom"}
    assert msgpack.unpackb(error_reply(7, cls("boom"))) == {"op": "error", "version": 7, "code": code, "message": "boom"}


def test_the_most_specific_class_names_the_code() -> None:
    class Asleep(StateError):
        pass

    assert error_code(PlacementError("p")) == "config"  # a ConfigError
    assert error_code(Asleep("a")) == "state"
    assert error_code(StaleVersionError("s", current=3, got=1, held=True)) == "stale_version"
    assert error_code(WriteCheckError("w")) == "write_check"  # not "config", though it is a ConfigError
    for plain in (WeightSyncError("w"), IntegrityError("i"), TransportError("t"), ValueError("v")):
        assert error_code(plain) == GENERIC_CODE, plain


@pytest.mark.parametrize("code", [GENERIC_CODE, UNKNOWN_PEER, "no_such_code", None, 3])
def test_an_unknown_code_reads_back_as_the_base_class(code: object) -> None:
    back = error_from_code(code, "m")
    assert type(back) is WeightSyncError and str(back) == "m"


def test_a_stale_version_read_back_has_no_versions() -> None:
    back = error_from_code("stale_version", "m")
    assert isinstance(back, StaleVersionError) and (back.current, back.got, back.held) == (None, None, False)


def test_the_timeout_is_in_the_family_and_every_timeout_type() -> None:
    for base in (WeightSyncError, TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError):
        assert issubclass(WeightSyncTimeout, base), base
    with pytest.raises(asyncio.TimeoutError):
        raise WeightSyncTimeout("t")


def _is_our_timeout(info: pytest.ExceptionInfo[BaseException]) -> None:
    assert type(info.value) is WeightSyncTimeout and isinstance(info.value, TimeoutError) and str(info.value), info.value


async def test_public_waits_raise_the_timeout() -> None:
    trainer = Trainer()
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await asyncio.wait_for(sender.start(trainer.model, version=0), T)
    lonely = Receiver(receiver_model(), "tcp://127.0.0.1:1", CONFIGS["patch"], identity="lonely", **DAEMON_KW)
    receiver = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="r", **DAEMON_KW)
    try:
        with pytest.raises(WeightSyncError) as info:
            await sender.wait_for_receivers(1, timeout=0.2)
        _is_our_timeout(info)
        with pytest.raises(WeightSyncError) as info:
            await lonely.start(timeout=0.3)  # nothing listens there
        _is_our_timeout(info)
        with pytest.raises(WeightSyncError) as info:
            await ask_metadata("tcp://127.0.0.1:1", timeout=0.3)
        _is_our_timeout(info)

        await asyncio.wait_for(receiver.start(), T)
        with pytest.raises(WeightSyncError) as info:
            await receiver.wait_for_version(5, timeout=0.2)
        _is_our_timeout(info)
        assert "v5" in str(info.value)
        with pytest.raises(WeightSyncError) as info:
            await sender.wait_acked(5, timeout=0.2)
        _is_our_timeout(info)
        await receiver.pause()
        with pytest.raises(WeightSyncError) as info:
            await receiver.update_weights(5, timeout=0.2)
        _is_our_timeout(info)
    finally:
        await receiver.close()
        await lonely.close()
        await sender.close()


def test_a_sidecar_that_never_answers_is_a_timeout(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    with pytest.raises(WeightSyncError) as info:
        with SidecarClient(f"ipc://{tmp_path}/nobody", f"ws-errors-{tmp_path.name[-8:]}", timeout=0.2, resend_interval=0.05) as client:
            client.publish(model, 0)
            client.flush()
    _is_our_timeout(info)


def _from_zmq(info: pytest.ExceptionInfo[TransportError], *names: str) -> None:
    """ZeroMQ's error is the cause, and the message names what failed, where."""
    assert isinstance(info.value.__cause__, zmq.ZMQError) and info.value.errno == info.value.__cause__.errno, info.value
    assert all(name in str(info.value) for name in names), info.value


async def test_an_endpoint_in_use_is_a_transport_error() -> None:
    trainer = Trainer()
    first = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
    await asyncio.wait_for(first.start(trainer.model, version=0), T)
    try:
        second = Sender(first.endpoint, CONFIGS["patch"], **DAEMON_KW)
        with pytest.raises(TransportError) as info:
            await second.start(trainer.model, version=0)
        _from_zmq(info, "bind", first.endpoint)
        assert info.value.errno == errno.EADDRINUSE
    finally:
        await first.close()


async def test_socket_failures_are_transport_errors(tmp_path: Path) -> None:
    context = zmq.asyncio.Context()
    try:
        with pytest.raises(TransportError) as info:
            DealerSocket(context, "tcp://nowhere", b"r")  # no port
        _from_zmq(info, "connect", "tcp://nowhere")
        with pytest.raises(TransportError) as info:
            RouterSocket(context, "nosuch://endpoint")
        _from_zmq(info, "bind", "nosuch://endpoint")
        router = RouterSocket(context, f"ipc://{tmp_path}/router")
        dealer = DealerSocket(context, router.endpoint, b"r")
        router.sock.close(linger=0)
        with pytest.raises(TransportError) as info:  # sending on a closed socket
            router.try_send(b"r", [b"x"])
        _from_zmq(info, "send", router.endpoint)
        dealer.close()
    finally:
        context.destroy(linger=0)
    with pytest.raises(TransportError) as info:
        SidecarClient("nosuch://handoff", f"ws-errors-{tmp_path.name[-8:]}")
    _from_zmq(info, "hand-off", "nosuch://handoff")
