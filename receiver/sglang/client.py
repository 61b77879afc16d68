"""Drive the weightsync receivers in an SGLang engine's workers, from the process that owns
the engine (an ``sglang.Engine``) or from anywhere that reaches its HTTP server
(``python -m sglang.launch_server ... --custom-weight-loader receiver.sglang.loader.weightsync``).

Every call goes through SGLang's own surface only: ``begin_weight_update``, then
``update_weights_from_tensor`` with one command for the workers' loader
(``loader.py``) and ``load_format`` naming it, then ``end_weight_update`` (always, so a
failure never leaves SGLang's window open). Each worker answers on a socket this client
binds (``commands.py``): SGLang drops a loader's return value, and an exception in a loader
ends the engine. A failure is raised here as the worker's typed error, after SGLang's
window is closed, with the weights at the last version every worker fully applied.

After an update the engine's weight version label (``/update_weight_version``; requests
are not aborted) names the version the workers hold, which may be past the one asked for
(a resync). ``flush_cache`` (default on, as SGLang's own update) drops the KV cache the old
weights made; SGLang refuses it while requests run, so pass ``pause="retract"`` (or
``"abort"``, ``"in_place"``) to have generation paused around the update and continued
after it, as SGLang's ``pause_generation`` / ``continue_generation`` do.

A client is not thread-safe: one call at a time (a second call while one runs would open a
second window, which SGLang refuses). Several clients may drive one engine one after the
other; each call's answers are matched by its id.
"""

from __future__ import annotations

import base64
import json
import pickle
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import torch
import zmq

from protocol.errors import ConfigError, WeightSyncError, WeightSyncTimeout, error_from_code

from .commands import LOADER, Answer, Command, Op

ANSWER_GRACE_S = 10.0  # the workers' answers are sent before SGLang's call returns: this is only for the network


class _Engine:
    """An in-process ``sglang.Engine``: its methods, and its tokenizer manager's for the
    calls 0.5.23's Engine does not wrap (weight version label, pause, continue)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def tp_size(self) -> int:
        return int(self.engine.server_args.tp_size)

    def begin(self) -> tuple[bool, str]:
        return _pair(self.engine.begin_weight_update())

    def end(self) -> tuple[bool, str]:
        return _pair(self.engine.end_weight_update())

    def load(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> tuple[bool, str]:
        return _pair(self.engine.update_weights_from_tensor(named, load_format=LOADER, flush_cache=flush_cache))

    def _manager(self, method: str, req: Any) -> Any:
        return self.engine.loop.run_until_complete(getattr(self.engine.tokenizer_manager, method)(req))

    def label(self, version: str) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        self._manager("update_weight_version", UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False))

    def pause(self, mode: str) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._manager("pause_generation", PauseGenerationReqInput(mode=mode))

    def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._manager("continue_generation", ContinueGenerationReqInput())


def _pair(out: Any) -> tuple[bool, str]:
    """(success, message) of an Engine call's answer: a tuple, or an output with those fields."""
    if isinstance(out, tuple | list):
        return bool(out[0]), str(out[1]) if len(out) > 1 else ""
    return bool(out.success), str(getattr(out, "message", ""))


class _Http:
    """An SGLang HTTP server, by its base URL: its routes, with the standard library only
    (a command's tensor is pickled plainly, which SGLang's safe unpickler takes, so this
    side needs no SGLang)."""

    def __init__(self, url: str, timeout: float, api_key: str | None) -> None:
        self.url, self.timeout, self.api_key = url.rstrip("/"), timeout, api_key
        self._tp: int | None = None

    def _post(self, route: str, body: dict[str, Any] | None = None, method: str = "POST") -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data, method=method, headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                status, text = resp.status, resp.read().decode()
        except urllib.error.HTTPError as e:
            status, text = e.code, e.read().decode()
        except (urllib.error.URLError, OSError) as e:
            raise WeightSyncError(f"the SGLang server at {self.url} did not answer {route}: {e}") from e
        try:
            return status, json.loads(text) if text else {}
        except json.JSONDecodeError:
            return status, {"message": text}

    def _ok(self, route: str, body: dict[str, Any] | None = None) -> tuple[bool, str]:
        status, out = self._post(route, body or {})
        ok = status == 200 and (not isinstance(out, dict) or out.get("success", True) is not False)
        return ok, str(out.get("message", out) if isinstance(out, dict) else out)

    def tp_size(self) -> int:
        if self._tp is None:
            status, out = self._post("/get_server_info", method="GET")
            if status != 200 or not isinstance(out, dict) or "tp_size" not in out:
                raise WeightSyncError(f"the SGLang server at {self.url} did not say its tp_size: {status} {out}")
            self._tp = int(out["tp_size"])
        return self._tp

    def begin(self) -> tuple[bool, str]:
        return self._ok("/begin_weight_update")

    def end(self) -> tuple[bool, str]:
        return self._ok("/end_weight_update")

    def load(self, named: list[tuple[str, torch.Tensor]], flush_cache: bool) -> tuple[bool, str]:
        payload = base64.b64encode(pickle.dumps(named)).decode()
        body = {"serialized_named_tensors": [payload] * self.tp_size(), "load_format": LOADER, "flush_cache": flush_cache}
        return self._ok("/update_weights_from_tensor", body)

    def label(self, version: str) -> None:
        ok, message = self._ok("/update_weight_version", {"new_version": version, "abort_all_requests": False})
        if not ok:
            raise WeightSyncError(f"SGLang refused the weight version label {version!r}: {message}")

    def pause(self, mode: str) -> None:
        self._ok("/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._ok("/continue_generation", {})


class SGLangWeights:
    """weightsync in an SGLang engine: ``init`` once, then ``update`` at each trainer step.

    ``engine``: an ``sglang.Engine`` started with ``custom_weight_loader=[LOADER]``, or the
    base URL of a server started with ``--custom-weight-loader`` the same. ``reply``: the
    address this client binds for the workers' answers (``tcp://<an address the workers
    reach>:<port or *>``; by default loopback, any free port)."""

    def __init__(self, engine: Any, *, reply: str = "tcp://127.0.0.1:*", http_timeout: float = 600.0, api_key: str | None = None) -> None:
        self._sglang = _Http(engine, http_timeout, api_key) if isinstance(engine, str) else _Engine(engine)
        # the process's shared context: a context of its own, collected with a socket open,
        # would block the collecting thread in zmq_ctx_term (seen: an import's GC pass)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pull = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(reply)
        self.reply = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)
        self.version: int | None = None  # what every worker held after the last call
        self.last_answers: list[Answer] = []

    # -- the calls ------------------------------------------------------------------------
    def init(self, endpoint: str | list[str], *, config: dict[str, Any] | str | None = None, curve: dict[str, str] | None = None,
             name_mapping: dict[str, str] | str | None = None, timeout: float = 120.0, insecure_plaintext: bool = False,
             check_writes: int | None = None, dtype: str | None = None) -> int | None:
        """Start a receiver in every worker and bootstrap it to the trainer's version (the
        arguments are ``receiver.held.worker.HeldInit``'s). Returns that version."""
        args: dict[str, Any] = {"endpoint": endpoint, "config": config, "curve": curve, "name_mapping": name_mapping,
                                "timeout": timeout, "insecure_plaintext": insecure_plaintext}
        if check_writes is not None:
            args["check_writes"] = check_writes
        if dtype is not None:
            args["dtype"] = dtype
        held = self._call(Op.INIT, args, timeout, flush_cache=True, pause=None)
        if held is not None:
            self._sglang.label(str(held))
        return held

    def update(self, version: int | str | None = None, *, timeout: float | None = 60.0, verify_checksum: bool = False,
               flush_cache: bool = True, pause: str | None = None, label: bool = True) -> int | None:
        """Commit every staged version up to ``version`` (None: the trainer's current one)
        in every worker, inside one SGLang window; returns the version they hold.
        ``pause``: "retract", "abort" or "in_place" pauses generation around the window (SGLang's
        own modes); "in_place" keeps the running requests' old KV cache, which SGLang cannot
        flush, so it needs ``flush_cache=False``."""
        if pause == "in_place" and flush_cache:
            raise ConfigError("pause='in_place' keeps the running requests' KV cache, which SGLang cannot flush: pass flush_cache=False")
        held = self._call(Op.UPDATE, {"version": version, "timeout": timeout, "verify_checksum": verify_checksum},
                          timeout, flush_cache=flush_cache, pause=pause)
        if label and held is not None:
            self._sglang.label(str(held))
        return held

    def status(self) -> list[dict[str, Any]]:
        """Each worker's held version and the runs of engine steps at each version
        (``receiver.held.steps``), in rank order. Opens an SGLang window that writes nothing."""
        self._call(Op.STATUS, {}, 30.0, flush_cache=False, pause=None)
        return [{"rank": a.rank, "version": a.version, **a.info} for a in self.last_answers]

    def shutdown(self) -> None:
        """Stop every worker's receiver (the weights stay) and this client's socket."""
        try:
            self._call(Op.SHUTDOWN, {}, 30.0, flush_cache=False, pause=None)
        finally:
            self.close()

    def close(self) -> None:
        """Close the answer socket (the workers' receivers keep running: ``shutdown`` stops
        them). Idempotent."""
        self._pull.close(linger=0)

    def __enter__(self) -> SGLangWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        pull = getattr(self, "_pull", None)
        if pull is not None and not pull.closed:
            pull.close(linger=0)

    # -- one command, one SGLang window ---------------------------------------------------------
    def _call(self, op: Op, args: dict[str, Any], timeout: float | None, *, flush_cache: bool, pause: str | None) -> int | None:
        if pause is not None and pause not in ("abort", "retract", "in_place"):
            raise ConfigError(f"pause must be 'abort', 'retract' or 'in_place', got {pause!r}")
        command = Command(op, uuid.uuid4().hex, self.reply, args)
        world = self._sglang.tp_size()
        if pause is not None:
            self._sglang.pause(pause)
        try:
            ok, message = self._sglang.begin()
            if not ok:
                raise WeightSyncError(f"SGLang refused to open a weight-update window: {message}")
            try:
                ok, message = self._sglang.load(command.named_tensors(), flush_cache)
            finally:
                ended, end_message = self._sglang.end()
            answers = self._answers(command.call, world, ANSWER_GRACE_S if ok else 1.0)
            if not ok and not answers:
                raise WeightSyncError(f"SGLang refused the weightsync {op.value}: {message}")
        finally:
            if pause is not None:
                self._sglang.resume()
        self.last_answers = answers
        failed = [a for a in answers if a.error is not None]
        if failed:
            first = failed[0]
            raise error_from_code(first.error_code, f"weightsync {op.value} failed on worker(s) {[a.rank for a in failed]}: "
                                  f"{first.error} (the workers hold {[a.version for a in answers]})")
        expected = max([world, *(a.world for a in answers)])
        if len(answers) < expected:
            raise WeightSyncTimeout(f"weightsync {op.value}: {len(answers)} of {expected} workers answered")
        if not ok:  # the workers did it; SGLang's own step after it did not (e.g. a flush refused while requests run)
            raise WeightSyncError(f"weightsync {op.value} done, but SGLang failed the call: {message}")
        if not ended:
            raise WeightSyncError(f"SGLang failed to close the weight-update window: {end_message}")
        versions = {a.version for a in answers}
        if len(versions) != 1:
            raise WeightSyncError(f"the workers hold different versions after {op.value}: {[a.version for a in answers]}")
        self.version = versions.pop()
        return self.version

    def _answers(self, call: str, world: int, wait_s: float) -> list[Answer]:
        """This call's answers, one a worker (older calls' are dropped), until all are in or
        ``wait_s`` passes. ``world`` is the least expected (the TP ranks); each answer says
        how many workers the engine has in all (pipeline stages too), and that many are awaited."""
        got: dict[int, Answer] = {}
        deadline = time.monotonic() + wait_s
        while len(got) < max([world, *(a.world for a in got.values())]):
            left = deadline - time.monotonic()
            if left <= 0 or not self._pull.poll(int(left * 1000)):
                break
            try:
                answer = Answer.unpack(self._pull.recv())
            except Exception:  # not an answer: ignored, as an old call's is
                continue
            if answer.call == call:
                got[answer.rank] = answer
        return [got[r] for r in sorted(got)]
