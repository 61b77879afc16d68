"""The rollout control API, through real HTTP, against a real Sender and Receiver.

A trainer does real AdamW steps on the tiny transformer; a bf16 receiver follows it over
tcp:// loopback and serves its control API on a free localhost port. Every endpoint is
called with aiohttp's client (the ``ctl`` CLI as a real subprocess): pause really holds
versions back, update_weights applies them bit for bit, sleep frees the weights and
wakeup brings back the trainer's latest version, verify_checksum catches a corrupted
model, and bad requests get clear 400 answers. Bodies are FastDeploy's ControlResponse
(``tests/test_fastdeploy_api.py`` drives the API exactly as FastDeploy's clients do).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import torch
from daemon_helpers import CONFIGS, DAEMON_KW, ROOT, T, Trainer, assert_matches, mismatches, receiver_model, wait_until
from prometheus_client.parser import text_string_to_metric_families

from protocol.errors import ConfigError, MetadataMismatchError, StateError, TransportError, WeightSyncError
from protocol.state import resolve_state
from receiver import Receiver
from receiver.control import http_client
from receiver.naming import AGENT_PREFIX
from sender import Sender

pytestmark = pytest.mark.timeout(60)


@dataclass
class Engine:
    """A stand-in rollout engine: records the hooks the receiver calls, in order."""

    receiver: Receiver | None = None
    events: list[str] = field(default_factory=list)
    weights_released_at_kv_wakeup: list[bool] = field(default_factory=list)

    def register(self, receiver: Receiver) -> None:
        self.receiver = receiver

        async def on_wakeup_kv_cache() -> None:  # async hooks are awaited
            self.events.append("wakeup_kv_cache")
            assert self.receiver is not None
            self.weights_released_at_kv_wakeup.append(all(t.untyped_storage().nbytes() == 0 for t in self.receiver.model.state_dict().values()))

        receiver.register_engine(
            on_pause=lambda: self.events.append("pause"),
            on_resume=lambda: self.events.append("resume"),
            on_sleep_kv_cache=lambda: self.events.append("sleep_kv_cache"),
            on_wakeup_kv_cache=on_wakeup_kv_cache,
        )


@dataclass
class Rig:
    trainer: Trainer
    sender: Sender
    receiver: Receiver
    http: aiohttp.ClientSession
    engine: Engine

    @property
    def url(self) -> str:
        assert self.receiver.control_url is not None
        return self.receiver.control_url

    async def call(self, method: str, path: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        async with self.http.request(method, self.url + path, **kw) as resp:
            assert resp.content_type == "application/json", await resp.text()
            return resp.status, await resp.json()

    async def ok(self, method: str, path: str, **kw: Any) -> Any:
        """The ``result`` of a successful call (a ControlResponse with no error)."""
        status, body = await self.call(method, path, **kw)
        assert status == 200 and body["status"] == "success" and body["error_message"] is None, (status, body)
        assert body["request_id"].startswith("control-"), body
        return body["result"]

    async def one(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        """The single worker's entry of a list ``result`` (update_weights, sleep, wakeup)."""
        result = await self.ok(method, path, **kw)
        assert isinstance(result, list) and len(result) == 1, result
        return result[0]

    async def error(self, method: str, path: str, code: int, error_type: str, **kw: Any) -> str:
        """The ``error_message`` of a call expected to fail with ``code`` and ``error_type``."""
        status, body = await self.call(method, path, **kw)
        assert (status, body["status"], body["error_type"], body["result"]) == (code, "error", error_type, None), (status, body)
        return str(body["error_message"])

    async def sync(self) -> int:
        return await self.trainer.step_and_sync(self.sender)


@contextlib.asynccontextmanager
async def rig(mode: str = "patch", *, model: Any = None, sender_state: Callable[[Trainer], Any] | None = None, **kw: Any) -> AsyncIterator[Rig]:
    """A sender at v0 and a started receiver with its control API; closes everything."""
    trainer = Trainer()
    state = (lambda t: t.model) if sender_state is None else sender_state
    sender = Sender("tcp://127.0.0.1:0", CONFIGS[mode], **DAEMON_KW)
    receiver: Receiver | None = None
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=T))
    try:
        await asyncio.wait_for(sender.start(state(trainer), version=0), T)
        receiver = Receiver(
            receiver_model() if model is None else model, sender.endpoint, CONFIGS[mode], identity="rollout-0",
            control_address="127.0.0.1:0", **{**DAEMON_KW, **kw},
        )
        engine = Engine()
        engine.register(receiver)
        await receiver.start(timeout=T)
        yield Rig(trainer, sender, receiver, http, engine)
    finally:
        await http.close()
        if receiver is not None:
            await asyncio.wait_for(receiver.close(), T)
        await asyncio.wait_for(sender.close(), T)


async def sync_renamed(r: Rig, rename: Callable[[str], str]) -> int:
    version = r.trainer.step()
    state = {rename(k): v for k, v in r.trainer.model.state_dict().items()}
    await asyncio.wait_for(r.sender.sync(state, version), T)
    return version


# -- pause / update_weights / resume --------------------------------------------------------------
@pytest.mark.parametrize("mode", ["patch", "bucket"])
async def test_pause_holds_versions_until_update_weights_then_resume(mode: str) -> None:
    async with rig(mode) as r:
        await assert_matches(r.receiver, r.trainer, 0)
        assert await r.ok("GET", "/v1/is_paused") == {"is_paused": False}
        assert await r.ok("POST", "/v1/pause") is None
        assert await r.ok("GET", "/v1/is_paused") == {"is_paused": True}
        await r.ok("POST", "/v1/pause")  # idempotent: the engine is paused once
        assert r.engine.events == ["pause"]

        v1 = await r.sync()
        await wait_until(lambda: r.receiver.pending_version == v1)  # received and staged, not applied
        v2 = await r.sync()  # (bucket mode coalesces: v2 must not be built before v1 was sent)
        status = await r.ok("GET", "/v1/version")
        assert (status["version"], status["pending_version"], status["is_paused"], status["connected"]) == (0, v1, True, True)
        await assert_matches(r.receiver, r.trainer, 0)

        body = await r.one("POST", "/v1/update_weights", json={"version": v1})
        assert (body["version"], body["is_paused"]) == (v1, True)
        await assert_matches(r.receiver, r.trainer, v1)
        await wait_until(lambda: r.receiver.pending_version == v2)
        await assert_matches(r.receiver, r.trainer, v1)  # still paused: v2 waits

        body = await r.one("POST", "/v1/update_weights")  # no body: the sender's current version
        assert body["version"] == v2
        await assert_matches(r.receiver, r.trainer, v2)

        assert await r.ok("POST", "/v1/resume") is None
        assert await r.ok("GET", "/v1/is_paused") == {"is_paused": False}
        await r.ok("POST", "/v1/resume")
        assert r.engine.events == ["pause", "resume"]
        v3 = await r.sync()
        await r.receiver.wait_for_version(v3, timeout=T)
        await assert_matches(r.receiver, r.trainer, v3)


async def test_wrong_state_and_bad_requests() -> None:
    async with rig() as r:
        message = await r.error("POST", "/v1/update_weights", 500, "StateError", json={})
        assert message.startswith("Pause LLM Engine first")  # FastDeploy's words, which its clients look for
        assert not r.receiver.is_paused  # a refused update never pauses or resumes
        await r.ok("POST", "/v1/pause")

        bad: list[tuple[Any, str]] = [
            (b"{not json", "not valid JSON"),
            (b"[1, 2]", "JSON object"),
            (b"\xff\xfe", "not valid JSON"),
            (json.dumps({"version": True}).encode(), "version"),
            (json.dumps({"version": -1}).encode(), "non-negative"),
            (json.dumps({"version": 1.5}).encode(), "version"),
            (json.dumps({"version": "latest"}).encode(), "version"),
            (json.dumps({"verify_checksum": "yes"}).encode(), "verify_checksum"),
            (json.dumps({"timeout": 0}).encode(), "timeout"),
        ]
        for raw, text in bad:
            message = await r.error("POST", "/v1/update_weights", 400, "ConfigError", data=raw)
            assert text in message, (raw, message)

        v1 = await r.sync()
        await wait_until(lambda: r.receiver.pending_version == v1)
        body = await r.one("POST", "/v1/update_weights", json={"version": f"global_step_{v1}"})  # the seed's string versions
        assert body["version"] == v1
        body = await r.one("POST", "/v1/update_weights", json={"version": 0})  # at least v0: already past it
        assert body["version"] == v1

        for method, path, code, error_type in [
            ("GET", "/v1/nope", 404, "HTTPNotFound"), ("GET", "/v1/pause", 405, "HTTPMethodNotAllowed"),
            ("POST", "/v1/version", 405, "HTTPMethodNotAllowed"),
        ]:
            await r.error(method, path, code, error_type)
        for path in ["/v1/sleep?tags=bogus", "/v1/sleep?tags=", "/v1/sleep?tags=weight,", "/v1/wakeup?tags=kv"]:
            await r.error("POST", path, 400, "ConfigError")
        assert r.receiver.asleep == frozenset()
        await assert_matches(r.receiver, r.trainer, v1)


async def test_paused_before_the_first_handshake_connects_only_when_asked() -> None:
    trainer = Trainer()
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=0)
        async with Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], **DAEMON_KW) as receiver:
            await receiver.pause()
            started = asyncio.ensure_future(receiver.start(timeout=T))
            await asyncio.sleep(0.3)
            assert not receiver.connected and receiver.version is None and not started.done()
            assert await receiver.update_weights(timeout=T) == 0  # connects, bootstraps, stays paused
            await started
            await assert_matches(receiver, trainer, 0)
            assert receiver.is_paused
            v1 = await trainer.step_and_sync(sender)
            await receiver.resume()
            await receiver.wait_for_version(v1, timeout=T)
            await assert_matches(receiver, trainer, v1)


async def test_concurrent_pause_and_resume_calls() -> None:
    async with rig() as r:
        results = await asyncio.gather(*[r.call("POST", "/v1/pause") for _ in range(20)])
        assert all(s == 200 for s, _ in results) and r.engine.events == ["pause"]
        results = await asyncio.gather(*[r.call("POST", "/v1/resume") for _ in range(20)])
        assert all(s == 200 for s, _ in results) and r.engine.events == ["pause", "resume"]

        calls = [r.call("POST", "/v1/pause" if i % 3 else "/v1/resume") for i in range(40)]
        results = await asyncio.gather(*calls, *[r.call("GET", "/v1/is_paused") for _ in range(10)])
        assert all(s == 200 for s, _ in results)
        events = r.engine.events
        assert all(a != b for a, b in itertools.pairwise(events)), events  # serialised: never paused twice in a row
        assert r.receiver.is_paused == (events[-1] == "pause")
        await r.ok("POST", "/v1/resume")  # whatever the interleaving, the receiver still follows
        v1 = await r.sync()
        await r.receiver.wait_for_version(v1, timeout=T)
        await assert_matches(r.receiver, r.trainer, v1)


# -- sleep / wakeup --------------------------------------------------------------------------------
def released(receiver: Receiver) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in receiver.model.state_dict().values())


async def test_sleep_frees_weights_and_wakeup_restores_the_latest_version() -> None:
    async with rig() as r:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in r.receiver.model.state_dict().values()}
        nbytes = sum(s.nbytes() for s in storages.values())
        body = await r.one("POST", "/v1/sleep")
        assert body["asleep"] == ["kv_cache", "weight"] and body["freed_bytes"] == nbytes
        assert released(r.receiver) and r.receiver.is_paused and r.receiver.version is None
        await wait_until(lambda: not r.receiver.connected)
        assert r.engine.events == ["pause", "sleep_kv_cache"]
        await r.ok("POST", "/v1/sleep")  # idempotent

        v1 = await r.sync()  # the trainer moves on while the rollout sleeps
        for method, path in [
            ("POST", "/v1/wakeup?tags=weight"),  # the KV cache sleeps: it wakes first
            ("POST", "/v1/resume"),
            ("POST", "/v1/update_weights"),
        ]:
            await r.error(method, path, 500, "StateError")
        assert released(r.receiver)

        body = await r.one("POST", "/v1/wakeup")
        assert (body["version"], body["asleep"], body["is_paused"]) == (v1, [], False)
        assert r.engine.events == ["pause", "sleep_kv_cache", "wakeup_kv_cache", "resume"]
        assert r.engine.weights_released_at_kv_wakeup == [True]  # the KV cache woke before the weights
        await assert_matches(r.receiver, r.trainer, v1)

        await r.ok("POST", "/v1/sleep?tags=weight")  # one tag only; the kv_cache hook is not called
        assert r.receiver.asleep == {"weight"} and r.engine.events[-1] == "pause"
        v2 = await r.sync()
        assert (await r.one("POST", "/v1/wakeup?tags=weight"))["version"] == v2
        await assert_matches(r.receiver, r.trainer, v2)

        assert (await r.one("GET", "/clear_load_weight"))["asleep"] == ["kv_cache", "weight"]  # legacy = sleep
        assert released(r.receiver)
        v3 = await r.sync()
        assert (await r.one("GET", "/update_model_weight"))["version"] == v3  # legacy = wakeup
        await assert_matches(r.receiver, r.trainer, v3)
        v4 = await r.sync()  # and it follows again
        await r.receiver.wait_for_version(v4, timeout=T)
        await assert_matches(r.receiver, r.trainer, v4)


# -- verify_checksum ---------------------------------------------------------------------------------
async def test_verify_checksum_passes_and_detects_a_corrupted_model() -> None:
    async with rig() as r:
        await r.ok("POST", "/v1/pause")
        v1 = await r.sync()
        body = await r.one("POST", "/v1/update_weights", json={"version": None, "verify_checksum": True})
        assert (body["version"], body["verified"]) == (v1, True)

        async with r.receiver.lock.writing():  # a bit flip the sync did not cause
            w = r.receiver.model.blocks[0].mlp[0].weight
            w.view(torch.int16)[3, 5] ^= 1 << 3
        message = await r.error("POST", "/v1/update_weights", 500, "IntegrityError", json={"verify_checksum": True})
        assert "resync" in message, message

        async def repaired() -> bool:  # the resync of the same version repairs it, even while paused
            async with r.receiver.reading():
                return not mismatches(r.trainer.expected[v1], r.receiver.model.state_dict())

        for _ in range(int(T / 0.05)):
            if await repaired():
                break
            await asyncio.sleep(0.05)
        await assert_matches(r.receiver, r.trainer, v1)
        assert r.receiver.is_paused
        assert (await r.one("POST", "/v1/update_weights", json={"verify_checksum": True}))["version"] == v1

        v2 = await r.sync()  # the sender moves on: it has no digest of v1 any more
        message = await r.error("POST", "/v1/update_weights", 500, "StateError", json={"version": v1, "verify_checksum": True})
        assert f"the sender is at v{v2}" in message, message

        families = {f.name: f for f in text_string_to_metric_families(await (await r.http.get(r.url + "/metrics")).text())}
        nacks = {s.labels["reason"]: s.value for s in families["weightsync_receiver_nacks"].samples if s.name.endswith("_total")}
        assert nacks == {"IntegrityError": 1.0}


# -- version, health, metrics --------------------------------------------------------------------------
async def test_version_health_and_metrics() -> None:
    async with rig() as r:
        v1 = await r.sync()
        await r.receiver.wait_for_version(v1, timeout=T)
        health = await r.ok("GET", "/health")  # the status, under result
        assert health["healthy"] is True and health["version"] == v1
        status = await r.ok("GET", "/v1/version")
        assert status["identity"] == "rollout-0" and status["endpoint"] == r.sender.endpoint and status["asleep"] == []
        await r.ok("POST", "/v1/pause")

        async with r.http.get(r.url + "/metrics") as resp:
            assert resp.status == 200 and resp.content_type == "text/plain"
            text = await resp.text()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("weightsync_receiver_version", ())] == v1
        assert samples[("weightsync_receiver_paused", ())] == 1
        assert samples[("weightsync_receiver_connected", ())] == 1
        assert samples[("weightsync_receiver_asleep", (("tag", "weight"),))] == 0
        assert samples[("weightsync_receiver_versions_applied_total", (("kind", "bootstrap"),))] == 1
        assert samples[("weightsync_receiver_versions_applied_total", (("kind", "patch"),))] == 1
        assert samples[("weightsync_receiver_received_bytes_total", ())] == sum(s.wire_bytes for s in r.receiver.stats.values())
        assert samples[("weightsync_receiver_apply_seconds_count", ())] == 2
        assert ("weightsync_receiver_reconnects_total", ()) in samples


async def test_health_reports_a_failed_receiver() -> None:
    trainer = Trainer()
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=0)
        receiver = Receiver(receiver_model(dim=32), sender.endpoint, CONFIGS["patch"], control_address="127.0.0.1:0", **DAEMON_KW)
        async with receiver, aiohttp.ClientSession() as http:
            with pytest.raises(WeightSyncError, match=r"key 'pos': sender shape \[32, 64\], receiver shape \[32, 32\]"):
                await receiver.start(timeout=T)
            async with http.get(f"{receiver.control_url}/health") as resp:
                body = await resp.json()
                assert (resp.status, body["status"], body["error_type"]) == (503, "error", "Unhealthy")
                assert "MetadataMismatchError" in body["error_message"]
            async with http.post(f"{receiver.control_url}/v1/pause") as resp:
                assert resp.status == 200  # the engine can still be paused


# -- the ctl CLI ---------------------------------------------------------------------------------------
async def ctl(*args: str) -> tuple[int, dict[str, Any]]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "receiver", "ctl", *args, cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), T)
    assert proc.returncode is not None
    text = out.decode() or err.decode()
    return proc.returncode, json.loads(text.strip().splitlines()[-1])


async def test_the_http_api_imports_no_receiver() -> None:
    """receiver/control/http_api.py serves a Controllable: it loads without the Receiver (no import cycle)."""
    code = "import sys, receiver.control.http_api; print(sorted(m for m in sys.modules if m.startswith('receiver')))"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    assert proc.returncode == 0 and out.decode().strip() == "['receiver', 'receiver.control', 'receiver.control.http_api']"


async def test_ctl_cli(capsys: pytest.CaptureFixture[str]) -> None:
    async with rig() as r:
        await r.ok("POST", "/v1/pause")
        v1 = await r.sync()
        rc, body = await ctl("update-weights", "--version", str(v1), "--verify-checksum", "--url", r.url)  # a real process
        assert rc == 0 and body["status"] == "success" and body["result"] == [{"version": v1, "is_paused": True, "verified": True}]
        await assert_matches(r.receiver, r.trainer, v1)

        async def in_process(*args: str) -> tuple[int, dict[str, Any]]:  # the same main(), in a thread beside the loop
            code = await asyncio.to_thread(http_client.main, list(args))
            out, err = capsys.readouterr()
            return code, json.loads((out or err).strip().splitlines()[-1])

        rc, body = await in_process("sleep", "--tags", "weights", "--url", r.url)
        assert rc == 1 and body["error_type"] == "ConfigError" and "unknown tag 'weights'" in body["error_message"]

        rc, body = await in_process("status", "--url", r.url)
        assert rc == 0 and (body["result"]["version"], body["result"]["is_paused"]) == (v1, True)
        rc, body = await in_process("resume", "--url", r.url + "/")
        assert rc == 0 and (body["status"], body["error_message"], body["result"]) == ("success", None, None)
        rc, body = await in_process("update-weights", "--url", r.url)
        assert rc == 1 and body["error_type"] == "StateError" and "Pause LLM Engine first" in body["error_message"]
    rc, body = await in_process("pause", "--url", "http://127.0.0.1:1")
    assert rc == 3 and (body["status"], body["error_type"]) == ("error", "Unreachable")
    with pytest.raises(SystemExit) as usage:
        http_client.parse_args(["pause", "--tags", "weight", "--url", "http://127.0.0.1:1"])
    assert usage.value.code == 2
    for bad in (["abort-requests", "--url", "http://127.0.0.1:1"], ["pause", "--all", "--url", "http://127.0.0.1:1"]):
        with pytest.raises(SystemExit) as usage:
            http_client.parse_args(bad)  # abort-requests needs --all or --req-ids; only it takes them
        assert usage.value.code == 2


async def test_ctl_aborts_requests() -> None:
    """``ctl abort-requests``, a real process: --all, then by id, through the engine's hook."""
    async with rig() as r:
        calls: list[tuple[bool, list[str]]] = []

        async def abort(abort_all: bool, req_ids: list[str]) -> dict[str, list[str]]:
            calls.append((abort_all, req_ids))
            return {"aborted": ["r-1"] if abort_all else [i for i in req_ids if i != "gone"], "not_found": [i for i in req_ids if i == "gone"]}

        r.receiver.register_engine(on_pause=lambda: None, on_abort_requests=abort)
        rc, body = await ctl("abort-requests", "--all", "--url", r.url)
        assert rc == 0 and body["result"] == {"aborted": ["r-1"], "not_found": []}, body
        rc, body = await ctl("abort-requests", "--req-ids", "a,gone", "--url", r.url)
        assert rc == 0 and body["result"] == {"aborted": ["a"], "not_found": ["gone"]}, body
        assert calls == [(True, []), (False, ["a", "gone"])]


# -- name mapping --------------------------------------------------------------------------------------
POLICY = "policy."


@pytest.mark.parametrize("kind", ["dict", "callable", "is_agent"])
async def test_name_mapping(kind: str) -> None:
    prefix = AGENT_PREFIX if kind == "is_agent" else POLICY
    names = list(receiver_model().state_dict())
    mapping: Any = {"dict": {n: POLICY + n for n in names}, "callable": lambda n: POLICY + n, "is_agent": "is_agent"}[kind]

    def renamed(t: Trainer) -> dict[str, torch.Tensor]:
        return {prefix + k: v for k, v in t.model.state_dict().items()}

    async with rig(sender_state=renamed, name_mapping=mapping) as r:
        await assert_matches(r.receiver, r.trainer, 0)  # the bootstrap found every tensor under its trainer name
        v1 = await sync_renamed(r, lambda k: prefix + k)
        await r.receiver.wait_for_version(v1, timeout=T)
        await assert_matches(r.receiver, r.trainer, v1)
        await r.ok("POST", "/v1/pause")
        v2 = await sync_renamed(r, lambda k: prefix + k)
        assert (await r.one("POST", "/v1/update_weights", json={"verify_checksum": True}))["version"] == v2  # digests agree under trainer names
        await assert_matches(r.receiver, r.trainer, v2)


async def test_bad_name_mappings_are_clear_errors() -> None:
    model = receiver_model()
    names = list(model.state_dict())
    with pytest.raises(ConfigError, match=f"maps both '{names[0]}' and '{names[1]}' to the trainer name 'x'"):
        Receiver(model, "tcp://127.0.0.1:1", name_mapping={names[0]: "x", names[1]: "x"})
    with pytest.raises(ConfigError, match=r"renames 'no\.such\.weight', which the rollout model does not have"):
        Receiver(model, "tcp://127.0.0.1:1", name_mapping={"no.such.weight": "x"})
    with pytest.raises(ConfigError, match=f"leaves '{names[0]}' unmapped"):
        Receiver(model, "tcp://127.0.0.1:1", name_mapping=lambda n: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigError, match="unknown name_mapping preset"):
        Receiver(model, "tcp://127.0.0.1:1", name_mapping="is_agnet")

    # Valid on this side, but the trainer has no such name: the sender refuses, naming both names.
    trainer = Trainer()
    async with Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW) as sender:
        await sender.start(trainer.model, version=0)
        async with Receiver(model, sender.endpoint, CONFIGS["patch"], name_mapping={names[0]: "typo." + names[0]}, **DAEMON_KW) as receiver:
            with pytest.raises(WeightSyncError, match=f"name_mapping renames the rollout's '{names[0]}' to 'typo.{names[0]}'") as err:
                await receiver.start(timeout=T)
            assert isinstance(err.value.__cause__, MetadataMismatchError)


async def test_state_errors_without_http() -> None:
    """The methods are the API; HTTP is one client of them."""
    async with rig() as r:
        with pytest.raises(StateError):
            await r.receiver.update_weights()
        await r.receiver.sleep("kv_cache")
        with pytest.raises(StateError):
            await r.receiver.wakeup(["weight"])
        with pytest.raises(ConfigError):
            await r.receiver.sleep(["weights"])
        await r.receiver.wakeup()
        assert not r.receiver.is_paused and r.receiver.asleep == frozenset()
        assert resolve_state(r.receiver.model).tensors.keys() == r.trainer.expected[0].keys()


async def test_bad_control_addresses() -> None:
    for address in ["nope", "127.0.0.1:http", "127.0.0.1:70000"]:
        async with Receiver(receiver_model(), "tcp://127.0.0.1:1", control_address=address) as receiver:
            with pytest.raises(ConfigError, match="HOST:PORT"):
                await receiver.start(timeout=T)
    async with Receiver(receiver_model(), "tcp://127.0.0.1:1", control_address="127.0.0.1:0") as first:
        first_start = asyncio.ensure_future(first.start(timeout=None))  # never connects: no sender
        await wait_until(lambda: first.control_url is not None)
        taken = first.control_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
        async with Receiver(receiver_model(), "tcp://127.0.0.1:1", control_address=f"127.0.0.1:{taken}") as second:
            with pytest.raises(TransportError, match="cannot serve the control API") as caught:  # one type for every port in use
                await second.start(timeout=T)
            assert caught.value.errno == errno.EADDRINUSE
        first_start.cancel()
