"""The receiver daemon as a sidecar process (``python -m receiver``).

Builds the rollout's model locally (``--model module:factory``, cast to ``--dtype``),
follows a sender, and reports each applied version as a JSON line on stdout (with the
state digest, so a script can check it against the trainer's; a version already replaced
by a newer one when its report is written says ``superseded_by`` instead).

``--shm NAME`` puts the model in a shared-memory region this process creates and owns
(unlinked on exit): a rollout engine maps its model onto it with
``receiver.attach(model, NAME)`` and reads under the region's seqlock; this process also
publishes there the trainer's latest version as it hears it, for the engine's
``reading(max_lag=k)`` (``sidecar_lag.py``).
``--load-strategy rsync`` (the default) follows a sender over the network;
``ipc_snapshot`` reloads the trainer's ``step_<version>.safetensors`` files from ``--watch``.

``--control HOST:PORT`` serves the control API (pause, resume, sleep, wakeup,
update_weights; see docs/control-api.md); ``python -m receiver ctl --help`` calls it. Off
loopback it needs ``--control-token`` (or ``$WEIGHTSYNC_CONTROL_TOKEN``).

Between hosts, use CURVE: ``--curve-secret`` (this receiver's ``.key_secret``, made by
``python -m sender keygen``) and ``--curve-server-key`` (the sender's public ``.key``).
A non-loopback ``--endpoint`` without them is refused unless ``--insecure-plaintext``.

``--relay-bind ENDPOINT`` makes this receiver a relay: it serves the versions it has
applied to other receivers, which connect to it as to a sender (``receiver/session/relay.py``).
Several ``--endpoint`` are parents tried in turn: a relay's death moves its children on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from protocol import progress
from protocol.errors import ConfigError
from protocol.host.cli import load_object, report, run, setup_logging
from protocol.host.logs import FORMATS
from protocol.net.security import CurveClient, CurveServer
from protocol.wire.checksum import state_digest
from protocol.wire.dtypes import parse_float_dtype

from .attach import engine_region, seqlock_writes
from .http_api import TOKEN_ENV
from .service import Receiver
from .sidecar_lag import LatestPublisher
from .snapshot_loader import serve_snapshots

log = logging.getLogger("receiver")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m receiver", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", action="append", metavar="ENDPOINT",
                   help="the sender's (or a relay's) address; repeat it to give parents tried in turn when one is lost "
                        "(default: tcp://127.0.0.1:5555)")
    p.add_argument("--config", help="weight_syncer YAML; must name the same strategy as the sender's")
    p.add_argument("--model", required=True, help="module:factory building the rollout's model")
    p.add_argument("--dtype", default="bfloat16", help="cast the model's floating tensors to this dtype (or 'keep')")
    p.add_argument("--identity", help="stable receiver id (default: host-pid-random)")
    p.add_argument("--save", type=Path, help="torch.save the state dict here on shutdown")
    p.add_argument("--digest", action="store_true", help="include the state digest in each report")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="seconds of silence before reconnecting")
    p.add_argument("--shm", help="create shared-memory region NAME holding the model, for an engine to attach to")
    p.add_argument("--load-strategy", choices=["rsync", "ipc_snapshot"], default="rsync",
                   help="rsync: follow --endpoint; ipc_snapshot: reload files from --watch")
    p.add_argument("--watch", type=Path, help="ipc_snapshot: directory the trainer writes step_<version>.safetensors to")
    p.add_argument("--control", metavar="HOST:PORT", help="serve the control API here (port 0: any free port; reported as a 'control' line)")
    p.add_argument(
        "--name-mapping", metavar="SPEC",
        help="rename this model's names to the trainer's: 'is_agent', a JSON file {rollout: trainer}, or module:callable",
    )
    p.add_argument("--control-ignore-unknown", action="store_true",
                   help="the control API ignores parameters a changing call does not know (FastDeploy's behaviour) instead of a 400")
    p.add_argument("--control-token", default=os.environ.get(TOKEN_ENV),
                   help=f"bearer token the control API requires (needed off loopback; default ${TOKEN_ENV})")
    p.add_argument("--curve-secret", type=Path, metavar="FILE", help="this receiver's CURVE .key_secret (python -m sender keygen)")
    p.add_argument("--curve-server-key", type=Path, metavar="FILE", help="the sender's CURVE public .key")
    p.add_argument("--relay-bind", metavar="ENDPOINT",
                   help="relay: serve the versions applied here to other receivers at ENDPOINT (port 0: any; reported as a 'relay' line)")
    p.add_argument("--relay-curve-allow", type=Path, metavar="FILE|DIR",
                   help="relay over CURVE: the public .key files of the receivers it admits (it serves with --relay-curve-secret)")
    p.add_argument("--relay-curve-secret", type=Path, metavar="FILE",
                   help="the .key_secret the relay serves with (default: --curve-secret); give every relay of a tree the same one "
                        "so a child can verify any parent with one --curve-server-key")
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="allow a non-loopback --endpoint without CURVE (weights in plaintext, sender not authenticated)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--verbose", action="store_true", help="a fatal error's whole traceback, not one line")
    p.add_argument("--log-format", choices=FORMATS, default="text", help="text, or json: one object a line with the fields as keys")
    args = p.parse_args(argv)
    args.endpoint = args.endpoint or ["tcp://127.0.0.1:5555"]
    if args.load_strategy == "ipc_snapshot" and args.watch is None:
        p.error("--load-strategy ipc_snapshot needs --watch DIR")
    if (args.curve_secret is None) != (args.curve_server_key is None):
        p.error("--curve-secret and --curve-server-key go together")
    try:
        args.curve = None if args.curve_secret is None else CurveClient.from_files(args.curve_secret, args.curve_server_key)
        relay_secret = args.relay_curve_secret or args.curve_secret
        if args.relay_curve_allow is not None and relay_secret is None:
            p.error("--relay-curve-allow needs --relay-curve-secret (or --curve-secret)")
        args.relay_curve = None if args.relay_curve_allow is None else CurveServer.from_files(relay_secret, args.relay_curve_allow)
    except ConfigError as e:
        p.error(str(e))
    if args.relay_bind is None and (args.relay_curve_allow or args.relay_curve_secret):
        p.error("--relay-curve-allow and --relay-curve-secret need --relay-bind")
    return args


def load_name_mapping(spec: str | None) -> Any:
    if spec is None or spec == "is_agent":
        return spec
    if spec.endswith(".json"):
        return json.loads(Path(spec).read_text())
    return load_object(spec)


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    model = load_object(args.model)()
    if args.dtype != "keep":
        model = model.to(parse_float_dtype(args.dtype))
    # owned here: unlinked on close or at exit. Following a trainer, it publishes the latest heard (max_age: two heartbeats)
    max_age = None if args.load_strategy == "ipc_snapshot" else 2 * args.heartbeat
    region = engine_region(model, args.shm, max_age) if args.shm else None
    if args.load_strategy == "ipc_snapshot":
        await serve_snapshots(args, model, region, stop)
        return
    receiver = Receiver(
        model, args.endpoint, args.config, identity=args.identity,
        heartbeat_interval=args.heartbeat, peer_timeout=args.peer_timeout,
        control_address=args.control, name_mapping=load_name_mapping(args.name_mapping),
        curve=args.curve, insecure_plaintext=args.insecure_plaintext, control_token=args.control_token,
        control_ignore_unknown=args.control_ignore_unknown,
        relay_endpoint=args.relay_bind, relay_curve=args.relay_curve,
        wrap_write=None if region is None else seqlock_writes(region, lambda: receiver.strategy.version),
    )

    async def on_update(version: int | None) -> None:
        # ``at``: the wall clock right after the commit (before the digest below): comparable
        # across the processes of one machine (benchmarks/flip.py: the spread of a fleet's commits)
        fields: dict[str, object] = {"version": version, "identity": receiver.identity, "at": time.time()}
        stats = receiver.stats.get(version) if version is not None else None
        if stats is not None:
            fields.update(stats.as_dict())
        if args.digest:  # of this version only: hooks run in their own task, and a newer one may be in by now
            async with receiver.reading() as held:
                if held == version:
                    fields["digest"] = await asyncio.to_thread(state_digest, model.state_dict())
                else:
                    fields["superseded_by"] = held
        report("applied", **fields)

    receiver.on_update(on_update)
    # the engines' reading(max_lag=...) bound: the latest heard, published in the region (receiver/control/sidecar_lag.py)
    publisher = None if region is None or max_age is None else asyncio.ensure_future(LatestPublisher(region, receiver, max_age).run())
    stopping = asyncio.ensure_future(stop.wait())
    watched = [stopping] if publisher is None else [stopping, publisher]  # the publisher never returns: only its failure ends it
    try:
        async with receiver:
            started = asyncio.ensure_future(receiver.start(timeout=None))
            if args.control is not None:
                while receiver.control_url is None and not started.done():
                    await asyncio.sleep(0.01)
                if receiver.control_url is not None:
                    report("control", url=receiver.control_url, identity=receiver.identity)
            await asyncio.wait([started, *watched], return_when=asyncio.FIRST_COMPLETED)
            if started.done():
                started.result()  # surface a failed handshake (metadata mismatch, ...)
                if receiver.relay_endpoint is not None:
                    report("relay", endpoint=receiver.relay_endpoint, identity=receiver.identity)
                await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            else:
                started.cancel()
            if publisher is not None and publisher.done():
                publisher.result()  # it failed: the sidecar stops with its error rather than publish no more
            if args.save is not None:
                async with receiver.reading():
                    torch.save(model.state_dict(), args.save)
    finally:
        for task in (publisher, stopping):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (publisher, stopping) if t is not None), return_exceptions=True)
        if region is not None:
            region.close()
    report("stopped", version=receiver.version, identity=receiver.identity)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format)
    if args.log_format == "text":
        progress.use_bars()  # a bar for long transfers when stderr is a terminal
    run(lambda stop: serve(args, stop), prog="python -m receiver", verbose=args.verbose)
