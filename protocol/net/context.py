"""The ZeroMQ context weightsync's sockets use when the caller passes none."""

from __future__ import annotations

import zmq.asyncio

from protocol.errors import ConfigError

IO_THREADS = 2


def shared_context(io_threads: int = IO_THREADS) -> zmq.asyncio.Context:
    """The process's ``zmq.asyncio.Context.instance()``, created with ``io_threads`` I/O threads.

    libzmq moves each connection's bytes on one of its context's I/O threads. With its
    default of one, a sender fanning a dense version out to two receivers pushes both
    copies through one thread (about 2 GB/s here); two let the connections go side by
    side (docs/performance.md). The count applies only when this call creates the
    instance: one the application created first is used as it is, and a caller that
    wants its own passes ``context=`` to the sender or receiver.
    """
    if type(io_threads) is not int or io_threads < 1:
        raise ConfigError(f"io_threads must be an int of at least 1, got {io_threads!r}")
    return zmq.asyncio.Context.instance(io_threads=io_threads)
