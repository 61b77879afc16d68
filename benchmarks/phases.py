"""Per-version phase timers for the harness, installed around the library's functions.

The library keeps a few timers of its own (``SyncStats.build_seconds`` /
``encode_seconds``, ``ApplyStats.decode_seconds`` / ``apply_seconds``); this module adds
the rest without touching the library: ``sender_timers()`` (in the harness process,
beside the trainer, for one workload) and ``install_receiver()`` (in each rollout worker
process) wrap

* sender: the fused diff's compare and collect kernels (``mark``, ``collect``; where one
  pass collects as it compares, its time counts as ``mark``, and ``collect`` is what is
  left: moving chunks into place and collecting chunks that overflowed their room; the
  device compare's runs, compared and collected in one call, count as ``mark``), the
  framing of each message (``Stamper.__call__``: ``frame``), the ROUTER's queueing of
  each message for a receiver (``try_send``: ``send``);
* receiver: the arrival of each whole message (``DealerSocket.recv`` returning), the
  header and checksum validation (``decode_message``: ``validate``), each tensor's
  decode (``decode_entry``) and its staging (``StagedUpdate.stage``), and the time the
  ACK left (``DealerSocket.try_send`` of an ACK).

A wrapper costs two ``time.monotonic_ns()`` calls and an addition (about 0.1 us), per
call, a few hundred calls per version. Durations add up over a version (with more
than one codec thread, per-tensor sums can exceed the wall time they overlap in);
instants are ``CLOCK_MONOTONIC`` nanoseconds, one clock for every process on a Linux
host, so the harness can line a receiver's events up with the sender's.

``breakdown`` turns one version's figures into the phases the JSON reports and the
plot stacks, in milliseconds, along the critical path: sender ``mark``, ``collect``,
``per_tensor`` (the rest of ``sync()``: snapshot fetch, staging copies, Python per
tensor), ``encode``, ``frame``, ``send``; receiver (the one that acknowledged last)
``receive`` (from the sender's last queued send to the arrival of the whole message),
``validate``, ``decode``, ``stage`` (``StagedUpdate.stage``: gathering the old values and
applying the differences), ``commit``; ``ack`` (from the ACK leaving to ``wait_acked`` returning); ``other`` is
what the phases leave of the end-to-end time (waits between them, event-loop turns). Beside
them, off the critical path: ``cpu_sender`` (the sender's process, every thread, from
``sync()`` to ``wait_acked``) and ``cpu_receivers`` (every receiver's process, summed, from its
previous report to this one): set against ``e2e`` times the cores, they say whether a
version waits on CPU.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator
from typing import Any

SENDER_PHASES = ("mark", "collect", "per_tensor", "encode", "frame", "send")
RECEIVER_PHASES = ("receive", "validate", "decode", "stage", "commit", "ack")
PHASES = (*SENDER_PHASES, *RECEIVER_PHASES, "other")
CPU = ("cpu_sender", "cpu_receivers")  # reported beside the phases, not stacked


class Recorder:
    """Summed durations (ns) and last instants (monotonic ns) since the last ``take``, and
    the CPU time this process spent meanwhile (every thread's: ``time.process_time_ns``)."""

    def __init__(self) -> None:
        self.sums: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self.first: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.cpu_from = time.process_time_ns()

    def add(self, name: str, started: int, ended: int) -> None:
        self.sums[name] = self.sums.get(name, 0) + ended - started
        self.counts[name] = self.counts.get(name, 0) + 1
        self.first.setdefault(name, started)
        self.last[name] = ended

    def take(self) -> dict[str, Any]:
        cpu = time.process_time_ns()
        out = {"sums_ns": self.sums, "counts": self.counts, "first_ns": self.first, "last_ns": self.last, "cpu_ns": cpu - self.cpu_from}
        self.sums, self.counts, self.first, self.last, self.cpu_from = {}, {}, {}, {}, cpu
        return out

    def skip_cpu(self) -> None:
        """Count CPU time from now on: what this process did since the last ``take`` is left
        out of the next one (the harness's own checks between versions)."""
        self.cpu_from = time.process_time_ns()


RECORDER = Recorder()
_installed: set[str] = set()


def _timed(name: str, fn: Callable[..., Any], when: Callable[..., bool] | None = None) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.monotonic_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            if when is None or when(*args, **kwargs):
                RECORDER.add(name, started, time.monotonic_ns())

    return wrapper


def _timed_async(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = await fn(*args, **kwargs)
        now = time.monotonic_ns()
        RECORDER.add(name, now, now)  # an instant: when the whole message was there
        return result

    return wrapper


class _TimedKernel:
    """A numba dispatcher's stand-in that times each call (the kernels table holds these)."""

    def __init__(self, name: str, dispatcher: Any) -> None:
        self.name, self.dispatcher = name, dispatcher

    def compile(self, signature: Any) -> Any:
        """The dispatcher's own (``protocol.codec.aot.compile_all`` compiles through the table)."""
        return self.dispatcher.compile(signature)

    def __call__(self, *args: Any) -> Any:
        started = time.monotonic_ns()
        try:
            return self.dispatcher(*args)
        finally:
            RECORDER.add(self.name, started, time.monotonic_ns())


@contextlib.contextmanager
def sender_timers() -> Iterator[None]:
    """Time the sender's phases in this process while inside; the library's own functions
    are put back on exit (the harness runs in-process under pytest too)."""
    from protocol.net import sockets
    from protocol.wire import framing
    from sender.diff import fastdiff
    from sender.diff.compare_device import DeviceCompare

    kernels = dict(fastdiff._KERNELS)
    device_compare = DeviceCompare._compare
    threaded, serial = fastdiff._THREADED_ONE_PASS, fastdiff._SERIAL_ONE_PASS
    stamp, send = framing.Stamper.__call__, sockets.RouterSocket.try_send
    for parallel, k in kernels.items():
        fastdiff._KERNELS[parallel] = fastdiff.Kernels(_TimedKernel("mark", k.mark), _TimedKernel("collect", k.collect))
    # one pass collects inside the compare: its time is the mark's
    fastdiff._THREADED_ONE_PASS = fastdiff.ChunkedOnePass(_TimedKernel("mark", threaded.mark_collect), _TimedKernel("collect", threaded.compact))
    fastdiff._SERIAL_ONE_PASS = fastdiff.SerialOnePass(_TimedKernel("mark", serial.mark_collect), _TimedKernel("collect", serial.collect_from))
    framing.Stamper.__call__ = _timed("frame", stamp)  # type: ignore[method-assign]
    sockets.RouterSocket.try_send = _timed("send", send)  # type: ignore[method-assign]
    # the device compare (patch.codec: device) compares and collects a run in one call: its ``mark``
    DeviceCompare._compare = _timed("mark", device_compare)  # type: ignore[method-assign]
    try:
        yield
    finally:
        fastdiff._KERNELS.update(kernels)
        fastdiff._THREADED_ONE_PASS, fastdiff._SERIAL_ONE_PASS = threaded, serial
        framing.Stamper.__call__ = stamp  # type: ignore[method-assign]
        sockets.RouterSocket.try_send = send  # type: ignore[method-assign]
        DeviceCompare._compare = device_compare  # type: ignore[method-assign]


def install_receiver() -> None:
    """Time the receiver's phases in this process (idempotent)."""
    if "receiver" in _installed:
        return
    _installed.add("receiver")
    from protocol.net import sockets
    from protocol.wire.framing import MessageType, peek_type
    from receiver.apply import commit, decode
    from receiver.strategy import base

    def is_ack(self: Any, frames: Any) -> bool:
        try:
            return peek_type(frames) is MessageType.ACK
        except Exception:
            return False

    sockets.DealerSocket.recv = _timed_async("arrived", sockets.DealerSocket.recv)  # type: ignore[method-assign]
    sockets.DealerSocket.try_send = _timed("ack", sockets.DealerSocket.try_send, when=is_ack)  # type: ignore[method-assign]
    base.decode_message = _timed("validate", base.decode_message)
    decode.decode_entry = _timed("decode", decode.decode_entry)
    stage = commit.StagedUpdate.stage.__func__  # type: ignore[attr-defined]
    commit.StagedUpdate.stage = classmethod(_timed("stage_calls", stage))  # type: ignore[method-assign, assignment]


def _ms(ns: int | None) -> float:
    return (ns or 0) / 1e6


def breakdown(sender: dict[str, Any], receivers: list[dict[str, Any] | None], build_s: float, encode_s: float,
              e2e_s: float, started_ns: int, ended_ns: int) -> dict[str, Any]:
    """One version's phases in ms (see the module's docstring); ``receivers`` are the
    workers' ``applied`` reports (their ``phases`` and stats), ``started_ns`` /
    ``ended_ns`` the monotonic instants of ``sync()``'s start and ``wait_acked``'s return."""
    sums, last = sender["sums_ns"], sender["last_ns"]
    mark, collect = _ms(sums.get("mark")), _ms(sums.get("collect"))
    out: dict[str, Any] = {
        "mark": mark,
        "collect": collect,
        "per_tensor": max(0.0, build_s * 1e3 - mark - collect),
        "encode": encode_s * 1e3,
        "frame": _ms(sums.get("frame")),
        "send": _ms(sums.get("send")),
    }
    reports = [r for r in receivers if r and r.get("phases")]
    if reports:
        slowest = max(reports, key=lambda r: r["phases"]["last_ns"].get("ack", 0))
        p = slowest["phases"]
        send_end = last.get("send", started_ns)
        arrived = p["last_ns"].get("arrived", send_end)
        decode = _ms(p["sums_ns"].get("decode"))
        out.update({
            "receive": max(0.0, _ms(arrived - send_end)),
            "validate": _ms(p["sums_ns"].get("validate")),
            "decode": decode,
            "stage": _ms(p["sums_ns"].get("stage_calls")),
            "commit": (slowest.get("apply_s") or 0.0) * 1e3,
            "ack": max(0.0, _ms(ended_ns - p["last_ns"].get("ack", ended_ns))),
        })
    else:
        out.update({k: None for k in RECEIVER_PHASES})
    out["other"] = e2e_s * 1e3 - sum(v for v in out.values() if v is not None)
    out["e2e"] = e2e_s * 1e3
    # CPU time, not on the critical path: is a version bound by the cores it shares?
    out["cpu_sender"] = _ms(sender.get("cpu_ns"))
    cpus = [_ms(r["phases"].get("cpu_ns")) for r in reports]
    out["cpu_receivers"] = sum(cpus) if cpus else None
    return out
