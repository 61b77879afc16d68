"""What both daemons' HTTP endpoints share (the receiver's control API, the sender's metrics):
the address form, the rule that anything beyond loopback needs a token, bearer-token checks,
and binding an aiohttp app with a clear error.

The token authenticates, it does not encrypt: beyond a trusted network, put TLS in front.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from aiohttp import web

from protocol.errors import ConfigError, TransportError
from protocol.net.security import is_local_host

log = logging.getLogger(__name__)

MIN_TOKEN = 16  # characters; secrets.token_urlsafe() gives 43
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_address(address: str, what: str = "control address") -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (localhost); port 0 picks a free one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def check_token(host: str, token: str | None, what: str, how: str) -> None:
    """A token, if given, long enough; and one given wherever ``host`` is not loopback
    (``how``: where the user passes it). ``ConfigError`` otherwise."""
    if token is not None and len(token) < MIN_TOKEN:
        raise ConfigError(f"{what} token is too short ({len(token)} characters, at least {MIN_TOKEN}); "
                          "python -c 'import secrets; print(secrets.token_urlsafe())' makes one")
    if token is None and not is_local_host(host):
        raise ConfigError(f"the {what} on {host} (not loopback) needs a token: {how}")


def bearer_auth(token: str, refused: Callable[[], web.Response], open_paths: Collection[str] = (), what: str = "HTTP API") -> Any:
    """A middleware admitting only requests with ``Authorization: Bearer <token>`` (compared
    in constant time), on every path but ``open_paths``; others get ``refused()`` (a 401)."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in open_paths:
            return await handler(request)
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            log.warning("%s: refused %s %s from %s: missing or wrong token", what, request.method, request.path, request.remote)
            response = refused()
            response.headers["WWW-Authenticate"] = 'Bearer realm="weightsync"'
            return response
        return await handler(request)

    return check


async def serve(app: web.Application, host: str, port: int, what: str) -> tuple[web.AppRunner, str]:
    """Bind ``app`` on ``host:port``; the runner (``cleanup`` it to stop) and the resolved
    ``http://host:port``. A port that cannot be bound (in use, an address not of this host)
    is a ``TransportError`` with the OS's ``errno``, as a ZeroMQ socket's bind is: one type
    for every port weightsync opens."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
    except BaseException as e:
        await runner.cleanup()
        if isinstance(e, OSError):
            raise TransportError(f"cannot serve the {what} on {host}:{port}: {e}", errno=e.errno) from e
        raise
    bound, real_port = runner.addresses[0][:2]
    url = f"http://[{bound}]:{real_port}" if ":" in bound else f"http://{bound}:{real_port}"
    if not is_local_host(host):
        log.warning("%s on %s is reachable beyond this host (token required, not encrypted)", what, url)
    return runner, url
