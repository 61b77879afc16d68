"""The control API: the receiver's control calls over HTTP, in the shape of
FastDeploy's rollout server (its ``/v1/*`` weight-control endpoints), so FastDeploy's own
clients work against it unchanged. ``receiver/control/http_client.py`` is its command-line client.

Every endpoint calls one method of a ``Controllable`` (a ``Receiver`` is one: this module
imports no receiver code); it parses requests and maps results and errors to FastDeploy's
``ControlResponse`` body::

    {"request_id": "control-<uuid>", "status": "success" | "error",
     "error_message": null | <text>, "result": ...}

``result`` is null for pause and resume, ``{"is_paused": bool}`` for is_paused, and a list
with one entry per worker (this receiver is one) for update_weights, sleep and wakeup.
An error adds ``error_type`` (the exception's class: ``StateError``, ``IntegrityError``,
``TimeoutError``, ...), weightsync's precise reason. Codes are FastDeploy's:

    400 bad parameters or body (ConfigError)     500 a control call failed (any other error)
    404 / 405 unknown path / method              401 missing or wrong token

A call that changes something (every POST, and the legacy GETs that sleep or wake) is
never made on a parameter it does not know: a misspelt one (``?tag=weight``, ``"verison"``)
or a body that is not JSON is a 400 naming it, and nothing is done. FastDeploy's own fields
that weightsync does not act on (``FASTDEPLOY_FIELDS``: ``rsync_config`` of update_weights,
...) are accepted and listed in an ``ignored`` field (and logged once per endpoint and
name), as are unknown parameters of the read-only GETs. ``ignore_unknown`` (the receiver's
``control_ignore_unknown``, ``--control-ignore-unknown``) restores FastDeploy's own
behaviour, every unknown name ignored and listed, for clients that send extra fields.
It listens on localhost by default. With a token, every request but ``/health`` must
carry ``Authorization: Bearer <token>`` (401 otherwise, compared in constant time); a
token is required to listen anywhere but loopback. The token authenticates, it does not
encrypt: beyond a trusted network, put TLS in front.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from aiohttp import web

from protocol.errors import ConfigError, WeightSyncError
from protocol.net.http import bearer_auth, check_token, parse_address, serve

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10
TOKEN_ENV = "WEIGHTSYNC_CONTROL_TOKEN"
OPEN_PATHS = frozenset({"/health"})  # liveness probes carry no token; it changes nothing
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Fields FastDeploy's clients send that weightsync takes and does not act on: listed as ignored, never refused.
FASTDEPLOY_FIELDS: dict[str, frozenset[str]] = {
    "/v1/pause": frozenset({"wait_for_inflight_requests"}),
    "/v1/update_weights": frozenset({"rsync_config"}),
    "/v1/abort_requests": frozenset({"reason"}),
}


class Metrics(Protocol):
    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""


class Controllable(Protocol):
    """The calls this API serves (``Receiver``'s, documented there)."""

    @property
    def identity(self) -> str: ...
    @property
    def is_paused(self) -> bool: ...
    @property
    def healthy(self) -> bool: ...
    @property
    def metrics(self) -> Metrics: ...
    def status(self) -> dict[str, Any]: ...
    async def pause(self) -> None: ...
    async def resume(self) -> None: ...
    async def sleep(self, tags: str | Sequence[str] | None = None) -> dict[str, Any]: ...
    async def wakeup(self, tags: str | Sequence[str] | None = None, *, require_resume: bool = False) -> dict[str, Any]: ...
    async def update_weights(self, version: int | str | None, verify_checksum: bool, timeout: float | None) -> int | None: ...
    async def abort_requests(self, abort_all: bool, req_ids: Sequence[str] | None) -> Any: ...


def status_of(error: BaseException) -> int:
    """The HTTP status for an error a control call raised: FastDeploy's 400 for bad
    parameters, 500 for a call that failed (the body's ``error_type`` says why)."""
    return 400 if isinstance(error, ConfigError) else 500


def error_type(error: BaseException) -> str:
    """The body's ``error_type``: the exception's class, and ``TimeoutError`` for every
    timeout (``WeightSyncTimeout`` included: clients match on the name)."""
    return "TimeoutError" if isinstance(error, (TimeoutError, asyncio.TimeoutError)) else type(error).__name__


def control_response(
    status: int = 200, result: Any = None, *, error: str | None = None, error_type: str | None = None,
    ignored: Iterable[str] = (),
) -> web.Response:
    """FastDeploy's ``ControlResponse`` body, plus weightsync's ``error_type`` and ``ignored``."""
    body: dict[str, Any] = {
        "request_id": f"control-{uuid.uuid4()}",
        "status": "success" if error is None else "error",
        "error_message": error,
        "result": result,
    }
    if error_type is not None:
        body["error_type"] = error_type
    ignored = list(ignored)
    if ignored:
        body["ignored"] = ignored
    return web.json_response(body, status=status)


def failure(status: int, error_type: str, message: str) -> web.Response:
    return control_response(status, error=message, error_type=error_type)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error becomes a ControlResponse with FastDeploy's status, never a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as e:  # routing (404, 405) and aiohttp's own limits (413)
        if e.status < 400:
            raise
        return failure(e.status, type(e).__name__, f"{request.method} {request.path}: {e.reason}")
    except Exception as e:
        if not isinstance(e, (WeightSyncError, TimeoutError, asyncio.TimeoutError)):
            log.exception("control call %s %s failed", request.method, request.path)
        return failure(status_of(e), error_type(e), str(e) or type(e).__name__)


def _unauthorized() -> web.Response:
    return failure(401, "Unauthorized", "this control API needs 'Authorization: Bearer <token>'")


class ControlServer:
    """Serves a ``Receiver``'s control API from its own event loop."""

    def __init__(self, receiver: Controllable, address: str = "127.0.0.1:0", token: str | None = None, ignore_unknown: bool = False) -> None:
        """Without ``token`` only a loopback address is allowed (``ConfigError`` otherwise):
        anyone who reaches the port could pause the rollout or put its weights to sleep.
        ``ignore_unknown``: a changing call's unknown parameters are ignored and listed, as
        FastDeploy does, instead of refused (400)."""
        self.receiver = receiver
        self.ignore_unknown = ignore_unknown
        self.host, self.port = parse_address(address)
        check_token(self.host, token, "control API", f"Receiver(control_token=...), --control-token or ${TOKEN_ENV}")
        self.token = token
        self._runner: web.AppRunner | None = None
        self._warned: set[tuple[str, str]] = set()  # (path, ignored parameter) already logged
        self.url: str | None = None

    async def start(self) -> str:
        """Bind and serve; returns the resolved ``http://host:port``."""
        middlewares = [_errors] if self.token is None else [bearer_auth(self.token, _unauthorized, OPEN_PATHS, "control API"), _errors]
        app = web.Application(middlewares=middlewares, client_max_size=MAX_BODY)
        app.add_routes([
            web.post("/v1/pause", self._pause),
            web.post("/v1/resume", self._resume),
            web.get("/v1/is_paused", self._is_paused),
            web.post("/v1/sleep", self._sleep),
            web.post("/v1/wakeup", self._wakeup),
            web.post("/v1/update_weights", self._update_weights),
            web.post("/v1/abort_requests", self._abort_requests),
            web.get("/v1/version", self._version),
            web.get("/clear_load_weight", self._clear_load_weight),  # legacy: sleep every tag
            web.get("/update_model_weight", self._update_model_weight),  # legacy: wake every tag
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self._runner, self.url = await serve(app, self.host, self.port, "control API")
        log.info("receiver %s control API at %s", self.receiver.identity, self.url)
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _ok(self, request: web.Request, result: Any = None, body: Mapping[str, Any] | None = None, reads: Iterable[str] = ()) -> web.Response:
        """A success answer; the query and body names the endpoint does not read are
        ignored (FastDeploy's behaviour), listed in the answer and logged once."""
        names = sorted((set(request.query) | set(body or ())) - set(reads))
        for name in names:
            if (request.path, name) not in self._warned:
                self._warned.add((request.path, name))
                log.warning("control API: %s ignores the parameter %r (it takes %s)", request.path, name, sorted(reads) or "none")
        return control_response(200, result, ignored=names)

    async def _params(self, request: web.Request, reads: Iterable[str] = ()) -> dict[str, Any]:
        """A changing call's body (a JSON object, or empty), checked before anything is done:
        a query or body name it neither reads nor knows as FastDeploy's is a ``ConfigError``
        (400) naming it, unless ``ignore_unknown``."""
        body = await _json_object(request)
        known = set(reads) | FASTDEPLOY_FIELDS.get(request.path, frozenset())
        unknown = sorted((set(request.query) | set(body)) - known)
        if unknown and not self.ignore_unknown:
            raise ConfigError(
                f"{request.path} does not take {', '.join(map(repr, unknown))} (it takes {sorted(reads) or 'no parameters'}); "
                "nothing was done (a receiver started with control_ignore_unknown ignores such names, as FastDeploy does)"
            )
        return body

    # -- endpoints --------------------------------------------------------------------------
    async def _pause(self, request: web.Request) -> web.Response:
        body = await self._params(request)
        await self.receiver.pause()
        return self._ok(request, body=body)

    async def _resume(self, request: web.Request) -> web.Response:
        body = await self._params(request)
        await self.receiver.resume()
        return self._ok(request, body=body)

    async def _is_paused(self, request: web.Request) -> web.Response:
        return self._ok(request, {"is_paused": self.receiver.is_paused})

    async def _sleep(self, request: web.Request) -> web.Response:
        body = await self._params(request, ("tags",))
        return self._ok(request, [await self.receiver.sleep(_tags(request, body))], body, ("tags",))

    async def _wakeup(self, request: web.Request) -> web.Response:
        body = await self._params(request, ("tags",))
        return self._ok(request, [await self.receiver.wakeup(_tags(request, body), require_resume=True)], body, ("tags",))

    async def _clear_load_weight(self, request: web.Request) -> web.Response:
        body = await self._params(request)
        return self._ok(request, [await self.receiver.sleep()], body)

    async def _update_model_weight(self, request: web.Request) -> web.Response:
        body = await self._params(request)
        return self._ok(request, [await self.receiver.wakeup(require_resume=True)], body)

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await self._params(request, ("version", "verify_checksum", "timeout"))
        timeout = body.get("timeout", 60.0)
        if type(timeout) not in (int, float) or not timeout > 0:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        verify = body.get("verify_checksum", False)
        version = await self.receiver.update_weights(body.get("version"), verify, timeout=timeout)
        result = {"version": version, "is_paused": self.receiver.is_paused, "verified": verify}
        return self._ok(request, [result], body, ("version", "verify_checksum", "timeout"))

    async def _abort_requests(self, request: web.Request) -> web.Response:
        body = await self._params(request, ("abort_all", "req_ids"))
        result = await self.receiver.abort_requests(body.get("abort_all", False), body.get("req_ids"))
        return self._ok(request, result, body, ("abort_all", "req_ids"))

    async def _version(self, request: web.Request) -> web.Response:
        return self._ok(request, self.receiver.status())

    async def _health(self, request: web.Request) -> web.Response:
        status = self.receiver.status()
        if not self.receiver.healthy:
            return failure(503, "Unhealthy", status["error"] or "the receiver is not running")
        return self._ok(request, status)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = await asyncio.to_thread(self.receiver.metrics.render)
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response


def _tags(request: web.Request, body: Mapping[str, Any]) -> str | list[str] | None:
    """sleep / wakeup tags as FastDeploy reads them: the body's ``tags`` (a string or a
    list) when it has them, else the query's ``?tags=``; neither: every tag."""
    tags = body.get("tags")
    if tags is None:
        return request.query.get("tags")
    if isinstance(tags, str) or (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        return tags
    raise ConfigError(f"tags must be a string (weight,kv_cache) or a list of strings, got {tags!r}")


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object, whatever its Content-Type (curl -d sends a form type);
    an empty body is ``{}``."""
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
