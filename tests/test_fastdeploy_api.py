"""FastDeploy's own clients, unchanged, against a weightsync receiver's control API.

Real HTTP over real sockets, a real Sender doing AdamW steps and a bf16 Receiver (the rig
of ``test_control.py``). Requests are sent the way FastDeploy's documentation
(``docs/features/weight_update.md``) and its CE script
(``tests/ce/rsync_weights/mixed/run.sh``) send them, with curl's bodies and headers
(``-d`` without ``-H`` is a form Content-Type), and every answer is checked against
FastDeploy's ``ControlResponse``: ``request_id`` ``control-<uuid>``, ``status``,
``error_message``, ``result``, FastDeploy's codes (400 bad parameters, 500 a failed call).
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
from typing import Any

import pytest
from daemon_helpers import T, assert_matches, wait_until
from test_control import Rig, released, rig

pytestmark = pytest.mark.timeout(90)

CONTROL_ID = re.compile(r"control-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
FORM = {"Content-Type": "application/x-www-form-urlencoded"}  # what curl -d sends without -H
JSON = {"Content-Type": "application/json"}


async def curl(r: Rig, method: str, path: str, data: str | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One request as curl sends it; the answer must be a well-formed ControlResponse."""
    kw: dict[str, Any] = {}
    if data is not None:
        kw = {"data": data.encode(), "headers": headers or FORM}
    status, body = await r.call(method, path, **kw)
    assert CONTROL_ID.fullmatch(body["request_id"]), body
    assert body["status"] in ("success", "error"), body
    expected = {"request_id", "status", "error_message", "result"}
    expected |= {"error_type"} if body["status"] == "error" else set()
    expected |= {"ignored"} if "ignored" in body else set()
    assert set(body) == expected, body
    assert (status == 200) == (body["status"] == "success") == (body["error_message"] is None), (status, body)
    return status, body


async def success(r: Rig, method: str, path: str, data: str | None = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    status, body = await curl(r, method, path, data, headers)
    assert status == 200, body
    return body


async def failed(r: Rig, method: str, path: str, code: int, error_type: str, data: str | None = None) -> str:
    status, body = await curl(r, method, path, data)
    assert (status, body["error_type"], body["result"]) == (code, error_type, None), body
    return str(body["error_message"])


def weights_freed(r: Rig) -> bool:
    return released(r.receiver)


# -- the documented sequences --------------------------------------------------------------------
async def test_workflow_2_pause_update_weights_resume() -> None:
    """pause -> update_weights {"version": "global_step_N", "verify_checksum": false} -> resume."""
    async with rig() as r:
        assert (await success(r, "POST", "/v1/pause"))["result"] is None
        assert (await success(r, "GET", "/v1/is_paused"))["result"] == {"is_paused": True}
        v1 = await r.sync()
        await wait_until(lambda: r.receiver.pending_version == v1)
        await assert_matches(r.receiver, r.trainer, 0)  # paused: staged, not applied

        body = await success(r, "POST", "/v1/update_weights", f'{{"version": "global_step_{v1}", "verify_checksum": false}}', JSON)
        assert body["result"] == [{"version": v1, "is_paused": True, "verified": False}]  # one worker; never resumes by itself
        await assert_matches(r.receiver, r.trainer, v1)
        assert (await success(r, "GET", "/v1/is_paused"))["result"] == {"is_paused": True}

        assert (await success(r, "POST", "/v1/resume"))["result"] is None
        assert (await success(r, "GET", "/v1/is_paused"))["result"] == {"is_paused": False}
        assert r.engine.events == ["pause", "resume"]
        v2 = await r.sync()  # and it follows the trainer again
        await r.receiver.wait_for_version(v2, timeout=T)
        await assert_matches(r.receiver, r.trainer, v2)


async def test_workflow_1_pause_sleep_wakeup_resume() -> None:
    """(pause) -> sleep?tags=weight,kv_cache -> wakeup?tags=weight,kv_cache -> (resume), and
    the documented variants: no tags (both), weight only."""
    async with rig() as r:
        await success(r, "POST", "/v1/pause")
        body = await success(r, "POST", "/v1/sleep?tags=weight,kv_cache")
        assert body["result"][0]["asleep"] == ["kv_cache", "weight"] and body["result"][0]["freed_bytes"] > 0
        assert weights_freed(r)
        v1 = await r.sync()  # the trainer moves on while the rollout sleeps
        body = await success(r, "POST", "/v1/wakeup?tags=weight,kv_cache")
        assert body["result"] == [{"asleep": [], "version": v1, "is_paused": False}]  # resumed after success, as FastDeploy
        await assert_matches(r.receiver, r.trainer, v1)
        assert (await success(r, "POST", "/v1/resume"))["result"] is None  # the optional explicit resume: a no-op
        assert r.engine.events == ["pause", "sleep_kv_cache", "wakeup_kv_cache", "resume"]

        await success(r, "POST", "/v1/sleep")  # no tags: both, and sleep pauses by itself
        assert r.receiver.asleep == {"weight", "kv_cache"} and r.receiver.is_paused
        v2 = await r.sync()
        assert (await success(r, "POST", "/v1/wakeup"))["result"][0]["version"] == v2
        await success(r, "POST", "/v1/sleep?tags=weight")  # weight only
        assert r.receiver.asleep == {"weight"}
        v3 = await r.sync()
        assert (await success(r, "POST", "/v1/wakeup?tags=weight"))["result"] == [{"asleep": [], "version": v3, "is_paused": False}]
        await assert_matches(r.receiver, r.trainer, v3)


async def test_workflow_3_legacy_clear_load_weight_then_update_model_weight() -> None:
    async with rig() as r:
        body = await success(r, "GET", "/clear_load_weight")
        assert body["result"][0]["asleep"] == ["kv_cache", "weight"] and weights_freed(r)
        v1 = await r.sync()
        body = await success(r, "GET", "/update_model_weight")
        assert body["result"] == [{"asleep": [], "version": v1, "is_paused": False}]
        await assert_matches(r.receiver, r.trainer, v1)


CE_REQUEST = r"""
set -e
request() {
    local name="$1"; shift
    local result http_code body
    result=$(curl -sS -w "%{http_code}" "$@")
    http_code="${result: -3}"
    body="${result%???}"
    [[ "${http_code}" == "200" ]] || { echo "${name} failed, http=${http_code}, body=${body}" >&2; exit 1; }
    echo "${name}: ${body}"
}
request pause -X POST "$URL/v1/pause"
request update_weights -X POST "$URL/v1/update_weights" -H "Content-Type: application/json" \
    -d "{\"version\":\"${MODEL_VERSION}\",\"verify_checksum\":${VERIFY_CHECKSUM}}"
request resume -X POST "$URL/v1/resume"
"""


@pytest.mark.skipif(shutil.which("curl") is None or shutil.which("bash") is None, reason="the CE script needs bash and curl")
@pytest.mark.parametrize("verify", ["false", "true"])
async def test_the_ce_scripts_requests_with_curl_on_an_engine_past_v0(verify: str) -> None:
    """The CE script's Step 4 (its own request() check: HTTP 200 or exit 1), MODEL_VERSION
    "0" sent to an engine already past v0: "at least v0" is met, the version held is reported."""
    async with rig() as r:
        v2 = 0
        for _ in range(2):
            v2 = await r.sync()
        await r.receiver.wait_for_version(v2, timeout=T)
        env = {"URL": r.url, "MODEL_VERSION": "0", "VERIFY_CHECKSUM": verify, "PATH": "/usr/bin:/bin"}
        done = await asyncio.to_thread(subprocess.run, ["bash", "-c", CE_REQUEST], env=env, capture_output=True, text=True, timeout=T)
        assert done.returncode == 0, done.stderr
        lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
        assert set(lines) == {"pause", "update_weights", "resume"}, done.stdout
        assert f'"result": [{{"version": {v2}, "is_paused": true, "verified": {verify}}}]' in lines["update_weights"]
        assert '"result": null' in lines["pause"] and '"result": null' in lines["resume"]
        assert not r.receiver.is_paused
        await assert_matches(r.receiver, r.trainer, v2)


# -- tags in the body --------------------------------------------------------------------------------
async def test_sleep_and_wakeup_read_tags_from_the_body_which_wins_over_the_query() -> None:
    async with rig() as r:
        await success(r, "POST", "/v1/sleep", '{"tags":"kv_cache"}')  # curl -d, no Content-Type: still JSON
        assert r.receiver.asleep == {"kv_cache"} and not weights_freed(r)  # the weights are untouched
        assert (await success(r, "POST", "/v1/wakeup", '{"tags": ["kv_cache"]}'))["result"][0]["is_paused"] is False

        await success(r, "POST", "/v1/sleep?tags=kv_cache", '{"tags": "weight"}', JSON)  # the body wins
        assert r.receiver.asleep == {"weight"} and weights_freed(r)
        v1 = await r.sync()
        await success(r, "POST", "/v1/wakeup?tags=weight", '{"tags": null}')  # null: the query's tags
        await assert_matches(r.receiver, r.trainer, v1)

        await success(r, "POST", "/v1/sleep", '{"tags": ["weight", "kv_cache"]}')
        assert r.receiver.asleep == {"weight", "kv_cache"}
        v2 = await r.sync()
        await success(r, "POST", "/v1/wakeup?tags=bogus", '{"tags": "kv_cache,weight"}')  # the body's comma list wins
        await assert_matches(r.receiver, r.trainer, v2)
        assert r.receiver.asleep == frozenset() and not r.receiver.is_paused

        for body, text in [('{"tags": 5}', "tags must be a string"), ('{"tags": [1]}', "tags must be a string"),
                           ('{"tags": "weights"}', "unknown tag 'weights'"), ('{"tags": []}', "tags must be"),
                           ('{"tags": "kv_cache"', "not valid JSON"), ('["kv_cache"]', "JSON object")]:
            assert text in await failed(r, "POST", "/v1/sleep", 400, "ConfigError", body), body
        assert r.receiver.asleep == frozenset() and not r.receiver.is_paused  # a refused call changes nothing


# -- unknown fields and parameters -----------------------------------------------------------------
async def test_fastdeploys_own_fields_are_ignored_and_listed(caplog: pytest.LogCaptureFixture) -> None:
    """Fields FastDeploy's clients send that weightsync does not act on, and any parameter of
    a read-only GET, are accepted, listed in ``ignored`` and logged once."""
    async with rig() as r:
        with caplog.at_level(logging.WARNING, logger="receiver.control.http_api"):
            body = await success(r, "POST", "/v1/pause?wait_for_inflight_requests=false")
            assert body["ignored"] == ["wait_for_inflight_requests"] and r.receiver.is_paused
            await success(r, "POST", "/v1/pause?wait_for_inflight_requests=false")
        logged = [m for m in caplog.messages if "wait_for_inflight_requests" in m]
        assert len(logged) == 1, caplog.messages  # once per endpoint and name

        v1 = await r.sync()
        rsync = f'{{"version": "global_step_{v1}", "rsync_config": {{"etcd_server": "127.0.0.1:2379", "mode": "pull"}}}}'
        body = await success(r, "POST", "/v1/update_weights", rsync, JSON)  # the English docs' body
        assert body["result"][0]["version"] == v1 and body["ignored"] == ["rsync_config"]
        await assert_matches(r.receiver, r.trainer, v1)
        body = await success(r, "GET", "/v1/is_paused?verbose=1")
        assert body["result"] == {"is_paused": True} and body["ignored"] == ["verbose"]
        assert "ignored" not in await success(r, "POST", "/v1/sleep?tags=weight")
        assert "ignored" not in await success(r, "POST", "/v1/wakeup?tags=weight")


async def test_a_misspelt_parameter_changes_nothing() -> None:
    """A changing call with a name it does not know (a typo) is a 400 naming it, and is not
    made: ``?tag=weight`` slept both tags, ``{"verison": 5}`` updated to the sender's latest,
    malformed JSON on /v1/pause paused. A receiver started with ``control_ignore_unknown``
    ignores such names instead, as FastDeploy does, and lists them."""
    async with rig() as r:
        message = await failed(r, "POST", "/v1/sleep?tag=weight", 400, "ConfigError")
        assert "does not take 'tag'" in message and "['tags']" in message and "nothing was done" in message
        assert r.receiver.asleep == frozenset()
        assert "'tags'" in await failed(r, "POST", "/v1/pause", 400, "ConfigError", '{"tags": "weight"}')
        assert "not valid JSON" in await failed(r, "POST", "/v1/pause", 400, "ConfigError", '{"pause": tru')
        assert not r.receiver.is_paused
        await success(r, "POST", "/v1/pause")
        v1 = await r.sync()
        assert "'verison'" in await failed(r, "POST", "/v1/update_weights", 400, "ConfigError", f'{{"verison": {v1}}}')
        assert r.receiver.version == 0  # not updated to the sender's latest
        assert "'req_id'" in await failed(r, "POST", "/v1/abort_requests", 400, "ConfigError", '{"req_id": ["a"]}')
        assert "'force'" in await failed(r, "POST", "/v1/resume?force=1", 400, "ConfigError")
        assert r.receiver.is_paused
        assert "'now'" in await failed(r, "GET", "/clear_load_weight?now=1", 400, "ConfigError")
        assert r.receiver.asleep == frozenset()
    async with rig(control_ignore_unknown=True) as r:
        body = await success(r, "POST", "/v1/sleep?tag=weight")  # FastDeploy's default: both tags, and it shows
        assert body["ignored"] == ["tag"] and body["result"][0]["asleep"] == ["kv_cache", "weight"]


# -- errors: FastDeploy's codes and messages, weightsync's type -----------------------------------------
async def test_errors_have_fastdeploys_codes_and_messages() -> None:
    async with rig() as r:
        message = await failed(r, "POST", "/v1/update_weights", 500, "StateError", '{"version": "1", "verify_checksum": false}')
        assert "Pause LLM Engine first" in message
        assert not r.receiver.is_paused  # a refused update never pauses or resumes
        await success(r, "POST", "/v1/pause")
        for body, text in [('{"version": "latest"}', "version"), ('{"verify_checksum": "false"}', "verify_checksum"),
                           ('{"timeout": -1}', "timeout"), ("not json", "not valid JSON")]:
            assert text in await failed(r, "POST", "/v1/update_weights", 400, "ConfigError", body), body
        message = await failed(r, "POST", "/v1/update_weights", 500, "TimeoutError", '{"version": 1000000, "timeout": 0.3}')
        assert "v1000000" in message
        await assert_matches(r.receiver, r.trainer, 0)
        assert "Not Found" in await failed(r, "POST", "/v1/nope", 404, "HTTPNotFound")
        await failed(r, "GET", "/v1/update_weights", 405, "HTTPMethodNotAllowed")
        await failed(r, "POST", "/v1/update_weights", 413, "HTTPRequestEntityTooLarge", '{"pad": "' + "x" * (70 << 10) + '"}')


async def test_a_wakeup_that_could_not_resume_is_refused_and_changes_nothing() -> None:
    """FastDeploy resumes after every wakeup, a partial one too; resuming while weights or the
    KV cache are freed is unsafe, so such a wakeup is an error a FastDeploy client sees."""
    async with rig() as r:
        await success(r, "POST", "/v1/sleep")
        events = list(r.engine.events)
        message = await failed(r, "POST", "/v1/wakeup?tags=kv_cache", 500, "StateError")
        assert "would leave ['weight'] asleep" in message and "wake ['kv_cache', 'weight'] together" in message
        await failed(r, "POST", "/v1/wakeup", 500, "StateError", '{"tags": "weight"}')
        assert r.receiver.asleep == {"weight", "kv_cache"} and weights_freed(r) and r.engine.events == events  # no hook called
        await failed(r, "POST", "/v1/resume", 500, "StateError")  # nor an explicit resume
        v1 = await r.sync()
        assert (await success(r, "POST", "/v1/wakeup"))["result"][0]["version"] == v1
        await assert_matches(r.receiver, r.trainer, v1)


# -- abort_requests --------------------------------------------------------------------------------
async def test_abort_requests_without_an_engine_hook_aborts_nothing_and_succeeds() -> None:
    """An RL controller aborts every request before it pauses: with no engine hook the
    answer is FastDeploy's 200 and its result's shape, nothing aborted and the requested
    ids not found (none for abort-all), never a 500 that would stop its loop."""
    async with rig() as r:
        body = await success(r, "POST", "/v1/abort_requests", '{"abort_all": true}', JSON)
        assert (body["status"], body["result"]) == ("success", {"aborted": [], "not_found": []}), body
        body = await success(r, "POST", "/v1/abort_requests", '{"req_ids": ["chatcmpl-1", "chatcmpl-2"]}', JSON)
        assert body["result"] == {"aborted": [], "not_found": ["chatcmpl-1", "chatcmpl-2"]}, body
        body = await success(r, "POST", "/v1/abort_requests", '{"abort_all": true, "req_ids": ["chatcmpl-1"]}', JSON)
        assert body["result"] == {"aborted": [], "not_found": []}, body  # abort-all: every id is covered
        assert "must provide" in await failed(r, "POST", "/v1/abort_requests", 400, "ConfigError", "{}")  # still checked
        assert not r.receiver.is_paused  # nothing else changed
        await success(r, "POST", "/v1/pause")
        assert (await success(r, "POST", "/v1/abort_requests", '{"abort_all": true}'))["result"] == {"aborted": [], "not_found": []}
        assert r.receiver.is_paused


async def test_abort_requests_calls_the_engines_hook_without_waiting_for_other_calls() -> None:
    async with rig() as r:
        calls: list[tuple[bool, list[str]]] = []

        async def abort(abort_all: bool, req_ids: list[str]) -> dict[str, list[str]]:
            calls.append((abort_all, req_ids))
            aborted = ["chatcmpl-1"] if abort_all else [i for i in req_ids if i != "gone"]
            return {"aborted": aborted, "not_found": [i for i in req_ids if i == "gone"]}

        r.receiver.register_engine(on_pause=lambda: None, on_abort_requests=abort)
        body = await success(r, "POST", "/v1/abort_requests", '{"abort_all": true}', JSON)
        assert body["result"] == {"aborted": ["chatcmpl-1"], "not_found": []}
        body = await success(r, "POST", "/v1/abort_requests", '{"req_ids": ["a", "gone"], "reason": "oversampled"}', JSON)
        assert body["result"] == {"aborted": ["a"], "not_found": ["gone"]} and body["ignored"] == ["reason"]
        assert calls == [(True, []), (False, ["a", "gone"])]
        for raw, text in [("{}", "must provide abort_all=true or req_ids"), ('{"abort_all": false, "req_ids": []}', "must provide"),
                          ('{"abort_all": "yes"}', "abort_all must be true or false"), ('{"req_ids": "a"}', "req_ids must be a list"),
                          ('{"req_ids": [1]}', "req_ids must be a list")]:
            assert text in await failed(r, "POST", "/v1/abort_requests", 400, "ConfigError", raw), raw
        assert len(calls) == 2 and not r.receiver.is_paused  # nothing else changed

        await success(r, "POST", "/v1/pause")
        update = asyncio.ensure_future(curl(r, "POST", "/v1/update_weights", '{"version": 1000000, "timeout": 2}'))
        await wait_until(lambda: r.receiver._lifecycle.apply_until == 1000000)  # the update holds the control lock, waiting
        await success(r, "POST", "/v1/abort_requests", '{"abort_all": true}')
        assert not update.done() and calls[-1] == (True, [])  # the abort did not queue behind it
        status, body = await update
        assert (status, body["error_type"]) == (500, "TimeoutError")


async def test_concurrent_wakeups_wake_once_and_both_succeed() -> None:
    async with rig() as r:
        await success(r, "POST", "/v1/sleep")
        v1 = await r.sync()
        results = await asyncio.gather(*[curl(r, "POST", "/v1/wakeup", '{"tags": "weight,kv_cache"}') for _ in range(3)])
        assert [s for s, _ in results] == [200, 200, 200], results
        assert sorted(b["result"][0]["version"] for _, b in results) == [v1] * 3
        assert r.engine.events.count("wakeup_kv_cache") == 1 and r.engine.events.count("resume") == 1
        await assert_matches(r.receiver, r.trainer, v1)
