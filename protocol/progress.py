"""Progress of a long transfer (a bootstrap, a resync, a bucket version), logged on either side.

A transfer that has taken more than ``AFTER`` seconds logs a line at INFO every ``EVERY``
seconds: bytes done and total, rate, ETA, and what it is (which receiver). Short ones log
nothing. On a terminal the CLIs draw a tqdm bar instead (``use_bars``). The figures also go
in the log record's ``extra`` (``bytes_done``, ``bytes_total``,
``rate_Bps``, ``eta_s``, ``peer``) for structured logs.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable
from typing import IO, Any

AFTER = 2.0  # seconds a transfer runs before its progress is logged
EVERY = 5.0  # seconds between progress lines
BARS = False  # a progress bar (tqdm) on stderr instead of the lines: ``use_bars``, for a terminal


def use_bars(stream: IO[str] | None = None) -> bool:
    """Draw progress bars instead of logging lines when ``stream`` (stderr) is a terminal and
    tqdm is installed (the CLIs call this); plain lines otherwise. Returns whether bars are on."""
    global BARS
    stream = sys.stderr if stream is None else stream
    try:
        import tqdm  # noqa: F401
    except ImportError:
        BARS = False
    else:
        BARS = bool(getattr(stream, "isatty", lambda: False)())
    return BARS


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class Progress:
    """One transfer's progress: ``advance`` as bytes go (or come), ``finish`` at the end.
    ``total`` may be an estimate (None: unknown, no ETA). Not thread-safe: one owner."""

    def __init__(self, log: logging.Logger, what: str, total: int | None, *, peer: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.what, self.total, self.peer, self.clock = log, what, total, peer, clock
        self.started = self.last = clock()
        self.done = 0
        self.lines = 0
        self._bar: Any = None  # a tqdm bar, once the transfer has run AFTER seconds (BARS)

    @property
    def rate(self) -> float:
        """Bytes a second so far."""
        elapsed = self.clock() - self.started
        return self.done / elapsed if elapsed > 0 else 0.0

    @property
    def eta(self) -> float | None:
        """Seconds left at the rate so far (None: no total, or no rate yet)."""
        rate = self.rate
        if self.total is None or rate <= 0:
            return None
        return max(0.0, (self.total - self.done) / rate)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = self.clock()
        if self._bar is not None:
            self._bar.update(nbytes)
        elif now - self.started >= AFTER and BARS:
            from tqdm import tqdm

            size = shutil.get_terminal_size((100, 20))  # where the terminal says 0x0 (tqdm would hide the bar)
            self._bar = tqdm(total=self.total, initial=self.done, desc=self.what, unit="B", unit_scale=True, unit_divisor=1000,
                             file=sys.stderr, leave=True, ncols=size.columns, nrows=size.lines)
        elif now - self.started >= AFTER and now - self.last >= EVERY:
            self.last = now
            self._line("")

    def finish(self) -> None:
        """The transfer is over: a last line, if any was logged (or the bar closed)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self.lines:
            self._line(f" done in {self.clock() - self.started:.1f}s")

    def _line(self, tail: str) -> None:
        self.lines += 1
        eta = self.eta
        of = "" if self.total is None else f" of {_size(self.total)} ({100 * self.done / max(1, self.total):.0f}%)"
        extra = {"bytes_done": self.done, "bytes_total": self.total, "rate_Bps": self.rate, "eta_s": eta, "peer": self.peer}
        self.log.info(
            "%s: %s%s, %s/s%s%s", self.what, _size(self.done), of, _size(self.rate),
            "" if eta is None or tail else f", ETA {eta:.1f}s", tail, extra=extra,
        )
