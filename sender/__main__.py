"""``python -m sender``: the sender daemon as a sidecar process.

Two ways to get the trainer's weights (``--load-strategy``):

* ``ipc_snapshot`` (``--watch DIR``): the daemon serves the newest checkpoint of a trainer:
  the trainer saves each version's state dict as ``<watch>/step_<version>.safetensors`` or
  ``step_<version>.pt`` (``safetensors.torch.save_file``, ``torch.save``, a renamed
  ``save_pretrained`` ``model.safetensors``, ``sender.write_snapshot``), written under a
  temporary name that is not ``step_<version>.*`` and renamed into place; the daemon syncs
  every new one to its receivers and refuses, naming the fix, a file it cannot serve.
* ``ipc`` (``--shm NAME --handoff ENDPOINT``): the trainer calls
  ``sender.SidecarClient(ENDPOINT, NAME).publish(model, version)``, which copies
  its weights into shared memory the trainer owns; the daemon syncs them from there.

Between hosts, use CURVE: ``python -m sender keygen --out DIR --name NAME`` writes a key
pair (``NAME.key`` public, ``NAME.key_secret`` private); start the sender with
``--curve-secret sender.key_secret --curve-allow DIR_OF_RECEIVER_KEYS``. A non-loopback
``--endpoint`` without CURVE is refused unless ``--insecure-plaintext``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from protocol import progress
from protocol.errors import ConfigError
from protocol.host.cli import load_object, report, run, setup_logging
from protocol.host.logs import FORMATS
from protocol.net.context import IO_THREADS, shared_context
from protocol.net.security import CurveServer, write_keypair

from .checkpoints import Checkpoints
from .serve.metrics import TOKEN_ENV as METRICS_TOKEN_ENV
from .serve.service import Sender
from .serve.sidecar import serve_shm


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sender", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="tcp://127.0.0.1:5555", help="address to bind: tcp://host:port, ipc://path, tcp://host:0 for any port")
    p.add_argument("--config", help="weight_syncer YAML (examples/config/weight_syncer/patch_syncer.yaml); default: patch defaults")
    p.add_argument("--load-strategy", choices=["ipc_snapshot", "ipc"],
                   help="ipc_snapshot: watch --watch for files; ipc: shared memory --shm (default: ipc if --shm is given)")
    p.add_argument("--watch", type=Path, help="ipc_snapshot: directory the trainer writes step_<version>.pt / .safetensors state dicts to")
    p.add_argument("--shm", help="ipc: name of the shared-memory region the trainer's SidecarClient publishes into")
    p.add_argument("--handoff", help="ipc: endpoint to bind for the trainer's SidecarClient (default: ipc:///tmp/weightsync-<shm>.handoff)")
    p.add_argument("--model", help="module:factory building the trainer's model (marks frozen parameters); default: all keys tracked")
    p.add_argument("--poll", type=float, default=0.05, help="seconds between scans of --watch")
    p.add_argument("--ring-size", type=int, default=8, help="recent patches kept to catch up late receivers")
    p.add_argument("--ring-bytes", type=int, default=None, help="and of those no more bytes than this (default: a whole copy of the state)")
    p.add_argument("--max-inflight", type=int, default=2, help="versions sent to a receiver ahead of its acks")
    p.add_argument("--io-threads", type=int, default=IO_THREADS, help="ZeroMQ I/O threads the connections to receivers share (default: %(default)s)")
    p.add_argument("--heartbeat", type=float, default=0.5, help="seconds between heartbeats")
    p.add_argument("--peer-timeout", type=float, default=10.0, help="seconds of silence before a receiver is dropped")
    p.add_argument("--curve-secret", type=Path, metavar="FILE", help="the sender's CURVE .key_secret (python -m sender keygen)")
    p.add_argument("--curve-allow", type=Path, metavar="FILE|DIR",
                   help="receiver public keys to admit: a directory of .key files, or a file of keys")
    p.add_argument("--insecure-plaintext", action="store_true",
                   help="allow binding a non-loopback --endpoint without CURVE (weights in plaintext, anyone may connect)")
    p.add_argument("--metrics-address", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (off by default; loopback unless --metrics-token)")
    p.add_argument("--metrics-token", default=os.environ.get(METRICS_TOKEN_ENV),
                   help=f"bearer token the metrics endpoint requires (needed off loopback; default ${METRICS_TOKEN_ENV})")
    p.add_argument("--max-lag", type=int, help="staleness bound in versions (Sender(max_lag=)): see --lag-policy")
    p.add_argument("--lag-policy", choices=("off", "wait", "drop"), default="off",
                   help="receivers more than --max-lag behind at a new version: wait for them, drop (resync) them, or only count them")
    p.add_argument("--lag-timeout", type=float, default=60.0, help="seconds --lag-policy wait waits before the version fails")
    p.add_argument("--commit", choices=("independent", "together"), default="independent",
                   help="together: every receiver commits each version at once, when all staged it (one flip for the fleet)")
    p.add_argument("--quorum", type=int, help="--commit together: flip once this many receivers staged (default: all)")
    p.add_argument("--stage-timeout", type=float, default=30.0, help="--commit together: flip without the rest after this many seconds")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--verbose", action="store_true", help="a fatal error's whole traceback, not one line")
    p.add_argument("--log-format", choices=FORMATS, default="text", help="text, or json: one object a line with the fields as keys")
    args = p.parse_args(argv)
    if args.io_threads < 1:
        p.error(f"--io-threads must be at least 1, got {args.io_threads}")
    if (args.curve_secret is None) != (args.curve_allow is None):
        p.error("--curve-secret and --curve-allow go together")
    try:
        args.curve = None if args.curve_secret is None else CurveServer.from_files(args.curve_secret, args.curve_allow)
    except ConfigError as e:
        p.error(str(e))
    # the Sender's staleness bound and commit mode, checked by it (a bad value is a ConfigError, exit 2)
    args.policy = {"max_lag": args.max_lag, "lag_policy": args.lag_policy, "lag_timeout": args.lag_timeout,
                   "commit": args.commit, "quorum": args.quorum, "stage_timeout": args.stage_timeout}
    args.load_strategy = args.load_strategy or ("ipc" if args.shm else "ipc_snapshot")
    if args.load_strategy == "ipc" and not args.shm:
        p.error("--load-strategy ipc needs --shm NAME")
    if args.load_strategy == "ipc_snapshot" and args.watch is None:
        p.error("--load-strategy ipc_snapshot needs --watch DIR")
    if args.load_strategy == "ipc" and args.handoff is None:
        args.handoff = f"ipc:///tmp/weightsync-{args.shm}.handoff"
    return args


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    args.watch.mkdir(parents=True, exist_ok=True)
    checkpoints = Checkpoints(args.watch)
    model = load_object(args.model)() if args.model else None
    reference = None if model is None else dict(model.state_dict())
    first = checkpoints.next(None, reference)
    version = None
    if first is not None:
        version, _, state = first
        if model is None:
            model = state
        else:
            model.load_state_dict(state)
    if model is None:
        raise SystemExit(f"no --model and no checkpoint in {args.watch}: nothing to serve")
    sender = Sender(
        args.endpoint, args.config, ring_size=args.ring_size, ring_bytes=args.ring_bytes, max_inflight=args.max_inflight,
        heartbeat_interval=args.heartbeat, peer_timeout=args.peer_timeout,
        curve=args.curve, insecure_plaintext=args.insecure_plaintext, context=shared_context(args.io_threads),
        metrics_address=args.metrics_address, metrics_token=args.metrics_token, **args.policy,
    )
    async with sender:
        await sender.start(model, version=version)
        report("listening", endpoint=sender.endpoint, version=version, session=sender.session, metrics=sender.metrics_url)
        reference = dict(model) if isinstance(model, dict) else dict(model.state_dict())
        while not stop.is_set():
            found = await asyncio.to_thread(checkpoints.next, sender.version, reference, not isinstance(model, dict))
            if found is None:
                try:
                    await asyncio.wait_for(stop.wait(), args.poll)
                except TimeoutError:
                    pass
                continue
            step, _, state = found
            if isinstance(model, dict):
                model = state
            else:
                model.load_state_dict(state)
            stats = await sender.sync(model, step)
            await sender.flush()  # a patch is encoded in the background: its figures exist once it is
            figures = {k: v for k, v in stats.as_dict().items() if k != "send_seconds"}  # a strategy's injected send; the server's pumps send here
            report("synced", **figures, receivers=sender.receivers)
    report("stopped", version=sender.version)


def keygen(argv: list[str]) -> int:
    """``python -m sender keygen``: write a CURVE key pair, print its paths as JSON."""
    p = argparse.ArgumentParser(prog="python -m sender keygen", description=(
        "Write a ZeroMQ CURVE key pair: NAME.key (public: give it to the peers) and NAME.key_secret "
        "(mode 0600: keep it on this host). Make one for the sender and one per receiver; put the "
        "receivers' .key files in the directory the sender's --curve-allow names."))
    p.add_argument("--out", type=Path, required=True, help="directory to write into (created if missing)")
    p.add_argument("--name", default="sender", help="file name stem (default: sender)")
    args = p.parse_args(argv)
    try:
        public, secret = write_keypair(args.out, args.name)
    except ConfigError as e:
        print(f"python -m sender keygen: {e}", file=sys.stderr)
        return 1
    from protocol.net.security import load_public

    print(json.dumps({"event": "keygen", "public": str(public), "secret": str(secret), "public_key": load_public(public).decode()}))
    return 0


def compile_kernels_main(argv: list[str]) -> int:
    """``python -m sender compile``: fill numba's cache now (an image build, an install)
    rather than beside the first receiver's bootstrap, which on a fresh install compiles
    for tens of seconds before the first sync can start."""
    from protocol.codec.aot import compile_args

    from .diff.warmup import compile_kernels

    pairs, given = compile_args("python -m sender compile", compile_kernels_main.__doc__, argv)
    started = time.perf_counter()
    compile_kernels(pairs)
    report("compiled", side="sender", pairs=given, seconds=round(time.perf_counter() - started, 2))
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keygen"]:
        sys.exit(keygen(argv[1:]))
    if argv[:1] == ["compile"]:
        sys.exit(compile_kernels_main(argv[1:]))
    if argv[:1] == ["status"]:
        from .serve.status import main as status_main

        sys.exit(status_main(argv[1:]))
    args = parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    if args.log_format == "text":
        progress.use_bars()  # a bar for long transfers when stderr is a terminal
    run(lambda stop: serve_shm(args, stop) if args.load_strategy == "ipc" else serve(args, stop), prog="python -m sender", verbose=args.verbose)


if __name__ == "__main__":
    main()
