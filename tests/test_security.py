"""Security: CURVE between hosts, the plaintext guard, the control API token, input limits.

Real sockets and real daemons throughout: a CURVE sender admits exactly the receivers in
its allowlist (and logs every refused key), receivers that hold the wrong sender key or
no key at all never connect, binding beyond loopback without CURVE is refused unless the
insecure flag says so, the control API off loopback requires a bearer token, and every
inbound bound (header, frame count, frame size, message size, tensor entries) is a
``LimitError`` that leaves the model untouched. The last test runs the CLIs as real
processes in three network namespaces joined by veth pairs, over TCP with CURVE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
import zmq
import zmq.asyncio
import zmq.auth
from daemon_helpers import (
    CONFIGS,
    DAEMON_KW,
    HEARTBEAT,
    PEER_TIMEOUT,
    ROOT,
    YAML,
    Proc,
    T,
    Trainer,
    assert_matches,
    free_port,
    mismatches,
    receiver_model,
    wait_until,
)

from protocol.codec.compress import Codec
from protocol.codec.tensorcodec import assemble, encode_dense
from protocol.errors import ConfigError, LimitError, ProtocolError, WeightSyncError
from protocol.net.endpoints import check_endpoint
from protocol.net.security import (
    CurveClient,
    CurveServer,
    KeyPair,
    is_local_endpoint,
    load_allowlist,
    load_public,
    load_secret,
    write_keypair,
)
from protocol.net.sockets import DealerSocket, RouterSocket
from protocol.wire.framing import Message, MessageType, decode_message, encode_message
from protocol.wire.limits import Limits
from receiver import Receiver
from sender import Sender

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="this libzmq has no CURVE (built without libsodium)")

NEVER = 2.0  # seconds a receiver that must not connect is given to (wrongly) connect
MODEL = "examples.tiny_model:build"
TIMING = ["--heartbeat", str(HEARTBEAT), "--peer-timeout", str(PEER_TIMEOUT)]


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, KeyPair]:
    """A sender and three receivers' key pairs, written as keygen would; ``allowed`` holds
    the public keys of receivers ``a`` and ``b`` only (``stranger`` is not in it)."""
    pairs = {}
    for name in ("sender", "a", "b", "stranger"):
        write_keypair(tmp_path / "keys", name)
        pairs[name] = load_secret(tmp_path / "keys" / f"{name}.key_secret")
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("a", "b"):
        shutil.copy(tmp_path / "keys" / f"{name}.key", allowed)
    return pairs


def server(keys: dict[str, KeyPair], tmp_path: Path) -> CurveServer:
    return CurveServer.from_files(tmp_path / "keys" / "sender.key_secret", tmp_path / "allowed")


def client(keys: dict[str, KeyPair], name: str, server_key: bytes | None = None) -> CurveClient:
    return CurveClient(keys[name], server_key or keys["sender"].public)


async def curve_sender(made: list[Any], keys: dict[str, KeyPair], tmp_path: Path, trainer: Trainer) -> Sender:
    """A sender that admits the ``allowed`` keys only, started at the trainer's version (closed with ``made``)."""
    sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], curve=server(keys, tmp_path), **DAEMON_KW)
    made.append(sender)
    await sender.start(trainer.model, version=trainer.version)
    return sender


@contextlib.asynccontextmanager
async def daemons() -> AsyncIterator[list[Any]]:
    """Senders and receivers appended here are closed at the end, receivers first."""
    made: list[Any] = []
    try:
        yield made
    finally:
        for d in sorted(made, key=lambda d: isinstance(d, Sender)):
            await asyncio.wait_for(d.close(), T)


# -- key files ---------------------------------------------------------------------------------
def test_keygen_cli_writes_usable_keys(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "sender", "keygen", "--out", str(tmp_path / "k"), "--name", "rollout-0"]
    done = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=T)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    public, secret = Path(report["public"]), Path(report["secret"])
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pair = load_secret(secret)
    assert load_public(public) == pair.public == report["public_key"].encode()
    assert zmq.curve_public(pair.secret) == pair.public
    assert load_allowlist(tmp_path / "k") == {pair.public}  # a directory of .key files
    zmq_public, zmq_secret = zmq.auth.load_certificate(secret)  # ZeroMQ's own certificate format
    assert (zmq_public, zmq_secret) == (pair.public, pair.secret)
    again = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=T)
    assert again.returncode == 1 and "exists" in again.stderr  # never overwrites a key


def test_bad_key_files_are_config_errors(tmp_path: Path) -> None:
    write_keypair(tmp_path, "s")
    with pytest.raises(ConfigError, match="no secret-key"):
        load_secret(tmp_path / "s.key")
    (tmp_path / "junk.key").write_text("not a key\n")
    with pytest.raises(ConfigError, match="Z85"):
        load_public(tmp_path / "junk.key")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no public keys"):
        load_allowlist(tmp_path / "empty")
    bare = tmp_path / "list.txt"
    pairs = [KeyPair.generate() for _ in range(2)]
    bare.write_text("# two receivers\n" + "".join(p.public.decode() + "\n" for p in pairs))
    assert load_allowlist(bare) == {p.public for p in pairs}


# -- CURVE between daemons ---------------------------------------------------------------------
async def test_curve_admits_only_allowed_keys_and_logs_the_rest(
    keys: dict[str, KeyPair], tmp_path: Path, caplog: pytest.LogCaptureFixture, reliability: Any
) -> None:
    caplog.set_level(logging.WARNING, logger="protocol.net.zap")
    caplog.set_level(logging.WARNING, logger="protocol.net.sockets")
    trainer = Trainer()
    async with daemons() as made:
        sender = await curve_sender(made, keys, tmp_path, trainer)
        allowed = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="allowed", curve=client(keys, "a"), **DAEMON_KW)
        stranger = Receiver(
            receiver_model(), sender.endpoint, CONFIGS["patch"], identity="stranger", curve=client(keys, "stranger"), **DAEMON_KW
        )
        made += [allowed, stranger]
        before = {k: v.clone() for k, v in stranger.model.state_dict().items()}
        refused = asyncio.ensure_future(stranger.start(timeout=NEVER))
        await allowed.start(timeout=T)
        for _ in range(3):
            version = await trainer.step_and_sync(sender)
            await asyncio.wait_for(sender.wait_acked(version), T)
            await assert_matches(allowed, trainer, version)
        with pytest.raises(TimeoutError):
            await refused
        stranger_key = keys["stranger"].public.decode()
        assert stranger.version is None and not stranger.connected
        assert not mismatches(before, stranger.model.state_dict())
        assert list(sender.receivers) == ["allowed"]
        assert sender.rejected_handshakes >= 1 and sender.rejected_keys == {stranger_key}
        assert any(stranger_key in r.getMessage() and "not in the allowlist" in r.getMessage() for r in caplog.records)
        assert any(r.name == "protocol.net.sockets" and "refused this receiver's key" in r.getMessage() for r in caplog.records)
        reliability.record(curve_versions_applied=len(allowed.stats), curve_rejected_handshakes=sender.rejected_handshakes)


@pytest.mark.parametrize("case,why", [("wrong_server_key", "not the --curve-server-key"), ("plaintext_client", "disagree on security")])
async def test_receivers_without_the_right_keys_never_connect(
    keys: dict[str, KeyPair], tmp_path: Path, case: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="protocol.net.sockets")
    trainer = Trainer()
    async with daemons() as made:
        sender = await curve_sender(made, keys, tmp_path, trainer)
        # An allowed receiver key, but it trusts another server key (an impostor sender's),
        # or no CURVE at all: neither completes a handshake with this sender.
        curve = client(keys, "a", server_key=KeyPair.generate().public) if case == "wrong_server_key" else None
        r = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity=case, curve=curve, **DAEMON_KW)
        made.append(r)
        with pytest.raises(TimeoutError):
            await r.start(timeout=NEVER)
        assert r.version is None and sender.receivers == {}
        assert any(why in rec.getMessage() for rec in caplog.records), [rec.getMessage() for rec in caplog.records]


def test_is_local_endpoint() -> None:
    local = ["tcp://127.0.0.1:5555", "tcp://127.3.4.5:0", "tcp://localhost:1", "tcp://[::1]:9", "ipc:///tmp/x", "inproc://x"]
    remote = ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.0.0.1:5555", "tcp://trainer:5555", "tcp://[::]:5", "udp://1.2.3.4:5"]
    assert all(is_local_endpoint(e) for e in local)
    assert not any(is_local_endpoint(e) for e in remote)


async def test_plaintext_beyond_loopback_needs_the_insecure_flag() -> None:
    trainer = Trainer()
    with pytest.raises(ConfigError, match="--insecure-plaintext"):
        Sender("tcp://0.0.0.0:0", CONFIGS["patch"])
    with pytest.raises(ConfigError, match="--insecure-plaintext"):
        Receiver(receiver_model(), "tcp://10.123.0.1:5555", CONFIGS["patch"])
    async with daemons() as made:
        sender = Sender("tcp://0.0.0.0:0", CONFIGS["patch"], insecure_plaintext=True, **DAEMON_KW)
        made.append(sender)
        await sender.start(trainer.model, version=trainer.version)
        port = sender.endpoint.rsplit(":", 1)[1]
        r = Receiver(receiver_model(), f"tcp://127.0.0.1:{port}", CONFIGS["patch"], identity="plain", **DAEMON_KW)
        made.append(r)
        await r.start(timeout=T)
        version = await trainer.step_and_sync(sender)
        await asyncio.wait_for(sender.wait_acked(version), T)
        await assert_matches(r, trainer, version)


def test_cli_refuses_plaintext_beyond_loopback(tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "sender", "--watch", str(tmp_path / "w"), "--model", MODEL, "--endpoint", "tcp://0.0.0.0:0"],
        cwd=ROOT, capture_output=True, text=True, timeout=T,
    )
    assert done.returncode != 0 and "--insecure-plaintext" in done.stderr


MALFORMED = [
    ("tcp://127.0.0.1", "no port"),
    ("127.0.0.1:5555", "no scheme (did you mean tcp://127.0.0.1:5555?)"),
    ("http://127.0.0.1:5555", "the scheme is http://"),
    ("udp://127.0.0.1:5555", "the scheme is udp://"),
    ("tcp://127.0.0.1:http", "the port 'http' is not a number"),
    ("tcp://[::1:5555", "in brackets"),
    ("ipc://", "nothing after ipc://"),
]


@pytest.mark.parametrize("endpoint, why", MALFORMED)
def test_a_malformed_endpoint_is_named_as_such_not_as_a_security_problem(endpoint: str, why: str) -> None:
    """Every side checks an endpoint's form before its security: a typo is reported with the
    forms expected, never as 'without CURVE ... pass --insecure-plaintext'."""
    for make in (lambda: Sender(endpoint, CONFIGS["patch"]), lambda: Receiver(receiver_model(), endpoint, CONFIGS["patch"])):
        with pytest.raises(ConfigError, match="malformed endpoint") as caught:
            make()
        assert why in str(caught.value) and "tcp://host:port" in str(caught.value) and "CURVE" not in str(caught.value)
    assert check_endpoint("tcp://*:0", bind=True) and check_endpoint("tcp://127.0.0.1:*", bind=True)
    with pytest.raises(ConfigError, match="from 1 to 65535"):
        check_endpoint("tcp://127.0.0.1:0")  # a port to connect to


@pytest.mark.parametrize("cli", ["sender", "receiver"])
def test_the_clis_report_a_malformed_endpoint_as_one(cli: str, tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    args = ["--watch", str(tmp_path / "w")] if cli == "sender" else []
    done = subprocess.run(
        [sys.executable, "-m", cli, *args, "--model", MODEL, "--endpoint", "tcp://127.0.0.1"],
        cwd=ROOT, capture_output=True, text=True, timeout=T,
    )
    assert done.returncode == 2 and "malformed endpoint 'tcp://127.0.0.1': no port" in done.stderr, done.stderr[-2000:]
    assert "--insecure-plaintext" not in done.stderr
    # one line, not a chained traceback (it was 33-57 lines); the traceback under --verbose
    assert "Traceback" not in done.stderr and f"python -m {cli}: ConfigError: malformed endpoint" in done.stderr, done.stderr
    verbose = subprocess.run(
        [sys.executable, "-m", cli, *args, "--model", MODEL, "--endpoint", "tcp://127.0.0.1", "--verbose"],
        cwd=ROOT, capture_output=True, text=True, timeout=T,
    )
    assert verbose.returncode != 0 and "Traceback" in verbose.stderr and "malformed endpoint" in verbose.stderr


# -- control API token -------------------------------------------------------------------------
async def test_control_api_off_loopback_needs_a_token() -> None:
    trainer = Trainer()
    token = uuid.uuid4().hex
    async with daemons() as made:
        sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], **DAEMON_KW)
        made.append(sender)
        await sender.start(trainer.model, version=trainer.version)
        bare = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], control_address="0.0.0.0:0", **DAEMON_KW)
        made.append(bare)
        with pytest.raises(ConfigError, match="needs a token"):
            await bare.start(timeout=T)
        short = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], control_address="0.0.0.0:0", control_token="abc", **DAEMON_KW)
        made.append(short)
        with pytest.raises(ConfigError, match="too short"):
            await short.start(timeout=T)
        r = Receiver(
            receiver_model(), sender.endpoint, CONFIGS["patch"], identity="guarded", control_address="0.0.0.0:0",
            control_token=token, **DAEMON_KW,
        )
        made.append(r)
        await r.start(timeout=T)
        assert r.control_url is not None
        url = f"http://127.0.0.1:{r.control_url.rsplit(':', 1)[1]}"
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
                async with http.post(f"{url}/v1/pause", headers=headers) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error_type"] == "Unauthorized"
            assert not r.is_paused
            auth = {"Authorization": f"Bearer {token}"}
            async with http.post(f"{url}/v1/pause", headers=auth) as resp:
                assert resp.status == 200 and (await resp.json())["status"] == "success"
            assert r.is_paused
            for path in ("/clear_load_weight", "/metrics"):  # beyond /v1 too: they free weights, or tell versions
                async with http.get(f"{url}{path}") as resp:
                    assert resp.status == 401, path
            async with http.get(f"{url}/health") as resp:  # liveness probes carry no token (FastDeploy's too)
                assert resp.status == 200
        from receiver.control.http_client import main as ctl

        assert await asyncio.to_thread(ctl, ["resume", "--url", url, "--token", token]) == 0
        assert await asyncio.to_thread(ctl, ["status", "--url", url]) == 1  # no token: refused
        assert not r.is_paused


# -- limits ------------------------------------------------------------------------------------
def patch_like(tensors: int, frame_bytes: int) -> list[bytes]:
    """A well-formed message with ``tensors`` dense entries of ``frame_bytes`` each."""
    entries = [encode_dense(i, torch.zeros(frame_bytes, dtype=torch.uint8), Codec.NONE) for i in range(tensors)]
    specs, frames = assemble(entries)
    return [bytes(f) for f in encode_message(Message(MessageType.BUCKET, version=1, tensors=specs, frames=frames))]


@pytest.mark.parametrize(
    "limit,limits",
    [
        ("header bytes", Limits(header_bytes=64)),
        ("frame count", Limits(frames=3)),
        ("frame bytes", Limits(frame_bytes=1000)),
        ("message bytes", Limits(message_bytes=5000)),
        ("tensor entries", Limits(tensors=3)),
    ],
)
def test_decode_enforces_each_limit(limit: str, limits: Limits) -> None:
    frames = patch_like(4, 2000)
    decode_message(frames)  # within the defaults
    with pytest.raises(LimitError) as e:
        decode_message(frames, limits)
    assert isinstance(e.value, ProtocolError) and e.value.limit == limit


async def test_socket_limits_drop_oversized_messages_without_keeping_them() -> None:
    """A raw peer sends messages over each bound; each is a LimitError, and the next good
    message still arrives intact (the bad one was drained, not left half-read)."""
    context = zmq.asyncio.Context()
    limits = Limits(header_bytes=256, frames=4, frame_bytes=4096, message_bytes=8192, tensors=4)
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = DealerSocket(context, f"tcp://127.0.0.1:{port}", b"r", limits=limits)
    try:
        await dealer.send([b"hello"])
        identity, _ = await asyncio.wait_for(router.recv_multipart(), T)
        good = [b"h" * 100, b"x" * 1000]
        for bad, limit in [
            ([b"h" * 300], "header bytes"),
            ([b"h", b"", b"", b"", b""], "frame count"),
            ([b"h", b"x" * 3000, b"x" * 3000, b"x" * 3000], "message bytes"),
        ]:
            await router.send_multipart([identity, *bad])
            await router.send_multipart([identity, *good])
            with pytest.raises(LimitError) as e:
                await asyncio.wait_for(dealer.recv(), T)
            assert e.value.limit == limit
            assert [bytes(f) for f in await asyncio.wait_for(dealer.recv(), T)] == good
        # Over MAXMSGSIZE, ZeroMQ drops the connection before buffering the frame: it never arrives.
        await router.send_multipart([identity, b"h", b"x" * 5000])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(dealer.recv(), 0.5)
    finally:
        dealer.close()
        router.close(linger=0)
        context.destroy(linger=0)


async def test_sender_discards_oversized_messages_and_keeps_serving(reliability: Any) -> None:
    trainer = Trainer()
    context = zmq.asyncio.Context()
    try:
        async with daemons() as made:
            sender = Sender("tcp://127.0.0.1:0", CONFIGS["patch"], context=context, **DAEMON_KW)
            made.append(sender)
            await sender.start(trainer.model, version=trainer.version)
            hostile = context.socket(zmq.DEALER)
            hostile.linger = 0
            hostile.connect(sender.endpoint)
            for _ in range(3):  # many small frames: over the frame count, each under MAXMSGSIZE
                await hostile.send_multipart([b"x"] * 1000)
            socket = sender.server._socket
            assert isinstance(socket, RouterSocket)
            await wait_until(lambda: socket.oversized == 3)
            hostile.close(linger=0)
            r = Receiver(receiver_model(), sender.endpoint, CONFIGS["patch"], identity="after", context=context, **DAEMON_KW)
            made.append(r)
            await r.start(timeout=T)
            version = await trainer.step_and_sync(sender)
            await asyncio.wait_for(sender.wait_acked(version), T)
            await assert_matches(r, trainer, version)
            reliability.record(oversized_messages_discarded=socket.oversized)
    finally:
        context.destroy(linger=0)


async def test_receiver_over_its_limits_fails_typed_and_untouched() -> None:
    """Every bootstrap bucket has more frames than this receiver allows: the handshake
    fails with the LimitError as its cause, and not one byte of the model changed."""
    trainer = Trainer()
    async with daemons() as made:
        sender = Sender("tcp://127.0.0.1:0", CONFIGS["bucket"], **DAEMON_KW)
        made.append(sender)
        await sender.start(trainer.model, version=trainer.version)
        model = receiver_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        r = Receiver(model, sender.endpoint, CONFIGS["bucket"], identity="tight", limits=Limits(frames=2), **DAEMON_KW)
        made.append(r)
        with pytest.raises(WeightSyncError) as e:
            await r.start(timeout=T)
        assert isinstance(e.value.__cause__, LimitError) and e.value.__cause__.limit == "frame count"
        assert r.version is None and not mismatches(before, model.state_dict())


def test_default_limits_fit_the_model() -> None:
    model = receiver_model()
    limits = Limits.for_model(model.state_dict())
    biggest = max(t.numel() for t in model.state_dict().values())
    assert limits.frame_bytes >= 8 * biggest and limits.tensors == len(model.state_dict())
    assert limits.frame_bytes < 64 << 20  # tight: a tiny model does not accept gigabyte frames


# -- hosts as network namespaces ---------------------------------------------------------------
def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True, timeout=T)


@pytest.fixture
def hosts() -> Iterator[dict[str, str]]:
    """Three network namespaces: ``trainer`` joined to ``r1`` and ``r2`` by veth pairs
    (10.123.1.0/24, 10.123.2.0/24). Yields namespace names and the trainer's address on
    each link; every namespace (and with it its veths) is deleted even on failure."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' tool (iproute2) is not installed")
    tag = uuid.uuid4().hex[:6]
    names = {h: f"ws-{h}-{tag}" for h in ("trainer", "r1", "r2")}
    made: list[str] = []
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i, host in ((1, "r1"), (2, "r2")):
            a, b = f"wst{i}{tag}", f"wsr{i}{tag}"
            _ip("link", "add", a, "netns", names["trainer"], "type", "veth", "peer", "name", b, "netns", names[host])
            _ip("-n", names["trainer"], "addr", "add", f"10.123.{i}.1/24", "dev", a)
            _ip("-n", names[host], "addr", "add", f"10.123.{i}.2/24", "dev", b)
            _ip("-n", names["trainer"], "link", "set", a, "up")
            _ip("-n", names[host], "link", "set", b, "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in made:
            _ip("netns", "del", ns, check=False)
        pytest.skip(f"cannot build network namespaces here: {e}")
    try:
        yield {**names, "r1_addr": "10.123.1.1", "r2_addr": "10.123.2.1"}
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)


async def spawn_in(ns: str, name: str, logs: Path, module: str, *args: str) -> Proc:
    log = logs / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as err:
        process = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, "-m", module, *args,
            cwd=ROOT, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=err,
        )
    return Proc(name, process, log)


async def test_hosts_over_tcp_with_curve(hosts: dict[str, str], keys: dict[str, KeyPair], tmp_path: Path, reliability: Any) -> None:
    """The sender CLI in one namespace, two receiver CLIs in two others, over TCP with
    CURVE; every version bit-exact by digest. A third receiver with a key the sender does
    not know never applies a version, and the sender's log names its key."""
    watch, config = tmp_path / "ckpt", tmp_path / "patch.yaml"
    watch.mkdir()
    config.write_text(YAML["patch"])
    trainer = Trainer(seed=7)
    trainer.save(watch)
    key_dir = tmp_path / "keys"
    port = free_port()
    procs: list[Proc] = []
    try:
        sender = await spawn_in(
            hosts["trainer"], "sender", tmp_path, "sender", "--watch", str(watch), "--model", MODEL, "--config", str(config),
            "--endpoint", f"tcp://0.0.0.0:{port}", "--curve-secret", str(key_dir / "sender.key_secret"),
            "--curve-allow", str(tmp_path / "allowed"), *TIMING,
        )
        procs.append(sender)
        await sender.wait_event(lambda e: e.get("event") == "listening")
        receivers = {}
        for name, host, key in (("r1", "r1", "a"), ("r2", "r2", "b"), ("intruder", "r2", "stranger")):
            receivers[name] = await spawn_in(
                hosts[host], name, tmp_path, "receiver", "--endpoint", f"tcp://{hosts[host + '_addr']}:{port}", "--model", MODEL,
                "--identity", name, "--digest", "--config", str(config), "--curve-secret", str(key_dir / f"{key}.key_secret"),
                "--curve-server-key", str(key_dir / "sender.key"), *TIMING,
            )
            procs.append(receivers[name])

        async def converged(version: int) -> None:
            for name in ("r1", "r2"):
                event = await receivers[name].wait_event(lambda e: e.get("event") == "applied" and e.get("version") == version)
                assert event["digest"] == trainer.digests[version], f"{name} applied v{version} with another digest"

        await converged(0)
        for _ in range(3):
            trainer.step()
            trainer.save(watch)
            await converged(trainer.version)
        stranger_key = keys["stranger"].public.decode()
        await wait_until(lambda: stranger_key in sender.log.read_text(errors="replace"))
        assert "not in the allowlist" in sender.log.read_text()
        await wait_until(lambda: "refused this receiver's key" in receivers["intruder"].log.read_text(errors="replace"))
        assert receivers["intruder"].applied() == [] and receivers["intruder"].process.returncode is None
        figures = {
            "hosts": 3, "transport": "tcp+curve", "versions": trainer.version + 1,
            "applied": {n: len(receivers[n].applied()) for n in ("r1", "r2", "intruder")},
            "reconnects": sum(receivers[n].log.read_text(errors="replace").count("reconnecting") for n in ("r1", "r2")),
            "rejected_handshakes": sender.log.read_text().count("not in the allowlist"), "digests_equal": True,
        }
        rcs = {p.name: await p.terminate() for p in reversed(procs)}  # receivers first: no goodbye to reconnect after
        assert rcs == {p.name: 0 for p in procs}, rcs
        reliability.record(**figures)
        print("RELIABILITY " + json.dumps({"test": "netns_curve", **figures}))
    finally:
        for p in procs:
            await p.kill()
