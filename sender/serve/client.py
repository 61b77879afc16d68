"""The trainer's side of a sender sidecar: ``publish(model, version)``.

The trainer process creates (and owns) a shared-memory region laid out like its state
dict; ``publish`` copies the weights into it under the region's seqlock and tells the
sidecar (``python -m sender --load-strategy ipc --shm NAME --handoff ENDPOINT``) over a
ZeroMQ DEALER socket. It returns as soon as the copy is made: the trainer may keep
training while the sidecar collects the version (``Sender.sync``) from the region.

Handshake, per version: the client waits until the sidecar has *collected* the previous
version (the region is free again) before it overwrites the region, so a trainer
publishing faster than the sidecar waits here, and never tears a version the sidecar is
reading. Messages are small msgpack maps::

    client -> sidecar  {"op": "publish", "version": v, "region": name, "generation": g}
    sidecar -> client  {"op": "collected", "version": v, "session": s}
                       {"op": "error", "version": v, "code": ..., "message": ...}

The client resends an unanswered ``publish`` every ``resend_interval`` seconds, and the
sidecar answers a repeat of the version it already holds with ``collected``: a sidecar
that restarts picks the region up by name (it holds the last published version) and
carries on. ``write_snapshot`` is the ``ipc_snapshot`` alternative: a file per version.

CPU tensors only: CUDA IPC hand-off (sharing the live device tensors) is not
implemented; publishing CUDA tensors raises ``ConfigError``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgpack
import zmq

from protocol.errors import (
    ConfigError,
    ProtocolError,
    SharedMemoryError,
    StaleVersionError,
    WeightSyncError,
    WeightSyncTimeout,
    error_code,
    error_from_code,
)
from protocol.host.shm import Layout, Region
from protocol.host.snapfile import write_snapshot
from protocol.net.sockets import handoff_socket, transport_errors
from protocol.state import StateLike, materialize, resolve_state

__all__ = ["SidecarClient", "write_snapshot"]

log = logging.getLogger(__name__)

def encode(op: str, **fields: Any) -> bytes:
    return msgpack.packb({"op": op, **fields})


def decode(frame: bytes) -> dict[str, Any]:
    """A hand-off message from a local peer (validated: a restarted peer may be another build)."""
    try:
        msg = msgpack.unpackb(frame)
    except Exception as e:
        raise ProtocolError(f"unreadable hand-off message: {e}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str) or type(msg.get("version")) is not int:
        raise ProtocolError(f"malformed hand-off message {msg!r:.80}")
    return msg


def error_reply(version: int, error: WeightSyncError) -> bytes:
    return encode("error", version=version, code=error_code(error), message=str(error))


class SidecarClient:
    """Publishes a trainer's weights to a sender sidecar through shared memory.

    ``handoff`` is the sidecar's ``--handoff`` endpoint, ``shm`` the region name it reads
    (its ``--shm``). Synchronous (trainer loops are); not thread-safe. Use as a context
    manager, or call ``close()``: it waits for the last version to be collected and
    unlinks the region, which this process owns.
    """

    def __init__(
        self,
        handoff: str,
        shm: str,
        *,
        timeout: float | None = 120.0,
        resend_interval: float = 0.5,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.handoff, self.shm = handoff, shm
        self.timeout, self.resend_interval = timeout, resend_interval
        self.version: int | None = None  # the last version published
        self.collected: int | None = None  # the last version the sidecar confirmed
        self.sidecar_session: str | None = None
        self._region: Region | None = None
        self._pending: int | None = None
        self._socket = handoff_socket(context or zmq.Context.instance(), zmq.DEALER)
        try:
            with transport_errors(f"cannot connect to the sender sidecar's hand-off at {handoff}"):
                self._socket.connect(handoff)
        except BaseException:
            self._socket.close(0)
            raise
        self._closed = False

    def publish(self, model: StateLike, version: int) -> None:
        """Hand ``version`` of ``model``'s weights to the sidecar.

        Waits for the sidecar to collect the previous version, copies the weights into
        the region, and returns: the trainer may change the model right away. Raises
        ``MetadataMismatchError`` if the state no longer matches the region (names,
        shapes, dtypes), ``StaleVersionError`` if ``version`` does not increase, and
        ``WeightSyncTimeout`` (a ``TimeoutError``) if the sidecar does not answer within ``timeout``,
        ``TransportError`` if the hand-off socket fails.
        """
        if self._closed:
            raise WeightSyncError("client is closed")
        if self.version is not None and version <= self.version:
            raise StaleVersionError(f"version {version} does not follow {self.version}", current=self.version, got=version)
        state = resolve_state(model)
        tensors = {k: materialize(t).detach() for k, t in state.tensors.items()}
        for key, t in tensors.items():
            if t.device.type != "cpu":
                raise ConfigError(f"{key!r} is on {t.device}: CUDA IPC hand-off is not implemented; publish CPU tensors or use ipc_snapshot")
        self.flush()  # the region is free again once the previous version is collected
        if self._region is None:
            self._region = Region.create(self.shm, Layout.of(tensors, state.tracked))  # replaces a killed trainer's leftover
        elif self._region.closed:
            raise SharedMemoryError(f"region {self.shm!r} was replaced by another process: two trainers under one name?")
        self._region.layout.check(tensors)  # same names, shapes and dtypes as the region, or nothing is written
        with self._region.writing(version):
            self._region.load(tensors)
        self.version = self._pending = version
        self._send()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the sidecar has collected the last published version."""
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._pending is not None:
            with transport_errors(f"receiving from the sender sidecar at {self.handoff}"):
                reply = self._socket.recv() if self._socket.poll(max(1, int(self.resend_interval * 1000))) else None
            if reply is not None:
                self._on_reply(decode(reply))
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise WeightSyncTimeout(f"the sender sidecar at {self.handoff} did not collect v{self._pending} within {timeout}s")
            self._send()  # lost, or the sidecar restarted: ask again (repeats are harmless)

    def close(self, timeout: float | None = None, *, wait: bool = True) -> None:
        """Wait for the last version to be collected (unless not ``wait``), then unlink
        the region and close. A sidecar that has not collected it yet loses it."""
        if self._closed:
            return
        try:
            if wait and self._pending is not None:
                self.flush(timeout)
        finally:
            self._closed = True
            self._socket.close(0)
            if self._region is not None:
                self._region.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(wait=exc_type is None)  # leaving on an error: do not wait for the sidecar too

    def _send(self) -> None:
        assert self._region is not None and self._pending is not None
        msg = encode("publish", version=self._pending, region=self.shm, generation=self._region.generation)
        with transport_errors(f"sending to the sender sidecar at {self.handoff}"):
            try:
                self._socket.send(msg, zmq.NOBLOCK)
            except zmq.Again:
                pass  # the queue towards a sidecar that is down is full: flush() resends

    def _on_reply(self, msg: dict[str, Any]) -> None:
        if msg["version"] != self._pending:
            return  # an answer to an earlier repeat
        if msg["op"] == "collected":
            self.collected, self._pending = self._pending, None
            self.sidecar_session = msg.get("session")
        elif msg["op"] == "error":
            self._pending = None
            raise error_from_code(msg.get("code"), f"sender sidecar: {msg.get('message')}")
        else:
            raise ProtocolError(f"unexpected hand-off reply {msg['op']!r}")
