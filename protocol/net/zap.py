"""The ZAP handler that admits receivers by public key (ZeroMQ's RFC 27).

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` *of the socket's context*
about every CURVE handshake; there is one per context, however many senders share it
(tests run senders and receivers on ``zmq.asyncio.Context.instance()``). So one handler
thread serves each context, and each sender registers its allowlist under its own ZAP
domain. A thread, not an asyncio task: handshakes are answered while the event loop is
busy (a ``sync()`` that holds it), and senders on different loops can share a context.

It must be bound before a CURVE socket binds: a handshake with no handler is admitted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import zmq
from zmq.utils import z85

from protocol.errors import ConfigError, TransportError

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
OnReject = Callable[[str, str], None]  # (peer address, z85 public key)


class _Handler:
    def __init__(self, context: zmq.Context) -> None:
        self.domains: dict[str, tuple[frozenset[bytes], OnReject | None]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.shadow(context.underlying)  # a sync view of the same context
        self._sock = self._context.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)  # raises if someone else's handler is bound there
        self._thread = threading.Thread(target=self._run, name="weightsync-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    request = sock.recv_multipart()
                    try:
                        reply = self._answer(request)
                    except Exception:  # fail closed, and keep answering: a dead handler stalls every handshake
                        log.exception("ZAP handler failed; refusing this handshake")
                        reply = [b"1.0", request[1] if len(request) > 1 else b"", b"500", b"internal error", b"", b""]
                    sock.send_multipart(reply)
        finally:
            sock.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        if len(request) < 6:
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain_b, address_b, _identity, mechanism = request[:6]
        domain, address = domain_b.decode(errors="replace"), address_b.decode(errors="replace")
        with self._lock:
            entry = self.domains.get(domain)
        if mechanism != b"CURVE" or len(request) < 7 or len(request[6]) != 32:
            if entry is None and mechanism != b"CURVE":
                return [version, request_id, b"200", b"OK", b"", b""]  # not ours: NULL/PLAIN of another socket
            log.warning("refused a %s handshake from %s on ZAP domain %r: not CURVE", mechanism.decode(errors="replace"), address, domain)
            return [version, request_id, b"400", b"CURVE required", b"", b""]
        key = z85.encode(request[6])
        if entry is not None and key in entry[0]:
            log.debug("admitted receiver key %s from %s", key.decode(), address)
            return [version, request_id, b"200", b"OK", key, b""]
        log.warning("refused a CURVE handshake from %s: public key %s is not in the allowlist", address, key.decode())
        if entry is not None and entry[1] is not None:
            try:
                entry[1](address, key.decode())
            except Exception:  # a counter hook must never stop the handler
                log.exception("ZAP rejection hook failed")
        return [version, request_id, b"400", b"public key not allowed", b"", b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


_handlers: dict[int, _Handler] = {}
_registry_lock = threading.Lock()


def register(context: zmq.Context, domain: str, allowed: frozenset[bytes], on_reject: OnReject | None = None) -> None:
    """Admit CURVE clients whose public key is in ``allowed`` on sockets of ``context``
    whose ``ZAP_DOMAIN`` is ``domain``; starts the context's handler if needed."""
    with _registry_lock:
        handler = _handlers.get(context.underlying)
        if handler is None:
            try:
                handler = _handlers[context.underlying] = _Handler(context)
            except zmq.ZMQError as e:
                raise TransportError(f"cannot start the ZAP handler at {ZAP_ENDPOINT} (another one bound there?): {e}", errno=e.errno) from e
        with handler._lock:
            if domain in handler.domains:
                raise ConfigError(f"ZAP domain {domain!r} is already registered")
            handler.domains[domain] = (allowed, on_reject)


def unregister(context: zmq.Context, domain: str) -> None:
    """Forget ``domain``; the last one out stops the context's handler."""
    with _registry_lock:
        handler = _handlers.get(context.underlying)
        if handler is None:
            return
        with handler._lock:
            handler.domains.pop(domain, None)
            empty = not handler.domains
        if empty:
            del _handlers[context.underlying]
            handler.close()
