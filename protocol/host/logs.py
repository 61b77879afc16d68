"""The daemons' log output: plain text, or one JSON object a line (``--log-format json``).

A JSON line has ``ts`` (ISO 8601, UTC), ``level``, ``logger`` and ``message``, plus every field
the call passed in ``extra`` (the version, the receiver's identity, bytes, seconds: weightsync's
own log calls pass them where they have them), and ``exc`` with a traceback. ``json_logging``
sets it up for in-process use.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import IO, Any

from protocol.errors import ConfigError

FORMATS = ("text", "json")
TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: the record's basics and its ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str, fmt: str = "text", stream: IO[str] | None = None) -> logging.Handler:
    """The root logger at ``level``, writing ``fmt`` (``text`` or ``json``) to ``stream``
    (stderr); replaces handlers set up before. Returns the handler."""
    if fmt not in FORMATS:
        raise ConfigError(f"log format must be one of {FORMATS}, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    return handler


def json_logging(level: str = "INFO", stream: IO[str] | None = None) -> logging.Handler:
    """JSON lines for a process that runs a Sender or Receiver in-process."""
    return setup_logging(level, "json", stream)
