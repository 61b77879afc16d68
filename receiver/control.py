"""The control API: the receiver's control calls over HTTP, in the shape of the seed's
rollout server (FastDeploy's ``/v1/*`` weight-control endpoints).

Every endpoint calls one ``Receiver`` method; this module only parses requests and maps
errors to status codes. Bodies are JSON, ``{"status": "success", ...}`` or
``{"status": "error", "error": <type>, "message": <text>}``:

    400 bad parameters or body (ConfigError)     409 wrong state (StateError, StaleVersionError)
    404 / 405 unknown path / method              500 integrity or internal error
    503 the receiver failed or is not running    504 a wait timed out

It listens on localhost by default. With a token, every request must carry
``Authorization: Bearer <token>`` (401 otherwise, compared in constant time); a token is
required to listen anywhere but loopback. The token authenticates, it does not encrypt:
beyond a trusted network, put TLS in front.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from protocol.errors import ConfigError, IntegrityError, MetadataMismatchError, StaleVersionError, StateError, WeightSyncError
from protocol.security import is_local_host

if TYPE_CHECKING:
    from .service import Receiver

log = logging.getLogger(__name__)

UPDATE_FIELDS = {"version", "verify_checksum", "timeout"}
MAX_BODY = 64 << 10
MIN_TOKEN = 16  # characters; secrets.token_urlsafe() gives 43
TOKEN_ENV = "WEIGHTSYNC_CONTROL_TOKEN"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT``, ``[IPv6]:PORT`` or ``:PORT`` (localhost); port 0 picks a free one."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"control address must be HOST:PORT, got {address!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def status_of(error: BaseException) -> int:
    """The HTTP status for an error a control call raised."""
    if isinstance(error, ConfigError):
        return 400
    if isinstance(error, (StateError, StaleVersionError)):
        return 409
    if isinstance(error, (IntegrityError, MetadataMismatchError)):
        return 500
    if isinstance(error, TimeoutError):
        return 504
    if isinstance(error, WeightSyncError):
        return 503
    return 500


def success(status: int = 200, **fields: Any) -> web.Response:
    return web.json_response({"status": "success", **fields}, status=status)


def failure(status: int, error: str, message: str) -> web.Response:
    return web.json_response({"status": "error", "error": error, "message": message}, status=status)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes a JSON body with a meaningful status, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as e:  # routing (404, 405) and aiohttp's own limits (413)
        if e.status < 400:
            raise
        return failure(e.status, e.reason.lower().replace(" ", "_"), f"{request.method} {request.path}: {e.reason}")
    except Exception as e:
        status = status_of(e)
        if status == 500 and not isinstance(e, WeightSyncError):
            log.exception("control call %s %s failed", request.method, request.path)
        return failure(status, type(e).__name__, str(e) or type(e).__name__)


def bearer_auth(token: str) -> Any:
    """A middleware admitting only requests with ``Authorization: Bearer <token>``."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
            log.warning("control API: refused %s %s from %s: missing or wrong token", request.method, request.path, request.remote)
            response = failure(401, "Unauthorized", "this control API needs 'Authorization: Bearer <token>'")
            response.headers["WWW-Authenticate"] = 'Bearer realm="weightsync"'
            return response
        return await handler(request)

    return check


class ControlServer:
    """Serves a ``Receiver``'s control API from its own event loop."""

    def __init__(self, receiver: Receiver, address: str = "127.0.0.1:0", token: str | None = None) -> None:
        """Without ``token`` only a loopback address is allowed (``ConfigError`` otherwise):
        anyone who reaches the port could pause the rollout or put its weights to sleep."""
        self.receiver = receiver
        self.host, self.port = parse_address(address)
        if token is not None and len(token) < MIN_TOKEN:
            raise ConfigError(f"control token is too short ({len(token)} characters, at least {MIN_TOKEN}); "
                              "python -c 'import secrets; print(secrets.token_urlsafe())' makes one")
        if token is None and not is_local_host(self.host):
            raise ConfigError(f"the control API on {self.host} (not loopback) needs a token: "
                              f"Receiver(control_token=...), --control-token or ${TOKEN_ENV}")
        self.token = token
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    async def start(self) -> str:
        """Bind and serve; returns the resolved ``http://host:port``."""
        middlewares = [_errors] if self.token is None else [bearer_auth(self.token), _errors]
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
        app.add_routes([
            web.post("/v1/pause", self._pause),
            web.post("/v1/resume", self._resume),
            web.get("/v1/is_paused", self._is_paused),
            web.post("/v1/sleep", self._sleep),
            web.post("/v1/wakeup", self._wakeup),
            web.post("/v1/update_weights", self._update_weights),
            web.get("/v1/version", self._version),
            web.get("/clear_load_weight", self._sleep),  # legacy: sleep every tag
            web.get("/update_model_weight", self._wakeup),  # legacy: wake every tag
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except BaseException as e:
            await runner.cleanup()
            if isinstance(e, OSError):
                raise ConfigError(f"cannot serve the control API on {self.host}:{self.port}: {e}") from e
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        if not is_local_host(self.host):
            log.warning("control API on %s is reachable beyond this host (token required, not encrypted)", self.url)
        log.info("receiver %s control API at %s", self.receiver.identity, self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    # -- endpoints --------------------------------------------------------------------------
    async def _pause(self, request: web.Request) -> web.Response:
        _only_query(request)
        await self.receiver.pause()
        return success(is_paused=True)

    async def _resume(self, request: web.Request) -> web.Response:
        _only_query(request)
        await self.receiver.resume()
        return success(is_paused=False)

    async def _is_paused(self, request: web.Request) -> web.Response:
        _only_query(request)
        return success(is_paused=self.receiver.is_paused)

    async def _sleep(self, request: web.Request) -> web.Response:
        _only_query(request, "tags")
        return success(**await self.receiver.sleep(request.query.get("tags")))

    async def _wakeup(self, request: web.Request) -> web.Response:
        _only_query(request, "tags")
        return success(**await self.receiver.wakeup(request.query.get("tags")))

    async def _update_weights(self, request: web.Request) -> web.Response:
        _only_query(request)
        body = await _json_object(request)
        unknown = sorted(set(body) - UPDATE_FIELDS)
        if unknown:
            raise ConfigError(f"unknown field {unknown[0]!r}; update_weights takes {sorted(UPDATE_FIELDS)}")
        timeout = body.get("timeout", 60.0)
        if type(timeout) not in (int, float) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        version = await self.receiver.update_weights(body.get("version"), body.get("verify_checksum", False), timeout=timeout)
        return success(version=version, is_paused=self.receiver.is_paused, verified=body.get("verify_checksum", False))

    async def _version(self, request: web.Request) -> web.Response:
        _only_query(request)
        return success(**self.receiver.status())

    async def _health(self, request: web.Request) -> web.Response:
        _only_query(request)
        status = self.receiver.status()
        if not self.receiver.healthy:
            return failure(503, "Unhealthy", status["error"] or "the receiver is not running")
        return success(**status)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = await asyncio.to_thread(self.receiver.metrics.render)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response


def _only_query(request: web.Request, *allowed: str) -> None:
    """A misspelt parameter (``?tag=weight``) is an error, not silently the default."""
    unknown = sorted(set(request.query) - set(allowed))
    if unknown:
        raise ConfigError(f"unknown query parameter {unknown[0]!r} for {request.path}" + (f"; it takes {list(allowed)}" if allowed else ""))


async def _json_object(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        raise ConfigError(f"body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"body must be a JSON object, got {type(body).__name__}")
    return body
