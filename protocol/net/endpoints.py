"""The form of a ZeroMQ endpoint, checked before anything else is said about it.

A typo in an address (no port, no scheme, ``http://``) must be reported as a typo, naming
the form expected, not as a security problem (``check_transport`` would otherwise see a
non-loopback address without CURVE) nor as ZeroMQ's bare ``Invalid argument``.
"""

from __future__ import annotations

from protocol.errors import ConfigError

FORMS = "tcp://host:port, ipc://path or inproc://name"
SCHEMES = ("tcp://", "ipc://", "inproc://")


def check_endpoint(endpoint: object, *, bind: bool = False) -> str:
    """``endpoint`` if it has one of the forms ZeroMQ takes (``bind``: the port may also be
    ``0`` or ``*``, any free one, and the host ``*``, every interface); else a
    ``ConfigError`` naming what is wrong and the forms expected."""
    if not isinstance(endpoint, str) or not endpoint:
        raise ConfigError(f"an endpoint must be a non-empty string ({FORMS}), got {endpoint!r}")
    problem = _problem(endpoint, bind)
    if problem:
        raise ConfigError(f"malformed endpoint {endpoint!r}: {problem}; expected {FORMS}")
    return endpoint


def _problem(endpoint: str, bind: bool) -> str | None:
    scheme = next((s for s in SCHEMES if endpoint.startswith(s)), None)
    if scheme is None:
        if "://" in endpoint:
            return f"the scheme is {endpoint.split('://', 1)[0]}://"
        return "no scheme" + (f" (did you mean tcp://{endpoint}?)" if ":" in endpoint else "")
    rest = endpoint[len(scheme):]
    if not rest:
        return f"nothing after {scheme}"
    if scheme != "tcp://":
        return None
    host, colon, port = rest.split(";", 1)[-1].rpartition(":")
    if not colon or not host:
        return "no port (e.g. tcp://127.0.0.1:5555)"
    if host.startswith("[") != host.endswith("]"):
        return "an IPv6 host goes in brackets (tcp://[::1]:5555)"
    if bind and port == "*":
        return None
    low = 0 if bind else 1
    if not port.isdigit() or not low <= int(port) <= 65535:
        return f"the port {port!r} is not a number from {low} to 65535" + (" (0 or * for any free one)" if bind else "")
    return None
