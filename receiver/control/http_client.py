"""``python -m receiver ctl``: call a running receiver's control API from a shell.

    python -m receiver ctl pause --url http://127.0.0.1:8000
    python -m receiver ctl update-weights --version 12 --verify-checksum --url ...
    python -m receiver ctl resume --url ...
    python -m receiver ctl abort-requests --all --url ...        # or --req-ids ID[,ID...]

Prints the receiver's JSON answer (FastDeploy's ControlResponse: ``request_id``,
``status``, ``error_message``, ``result``, and ``error_type`` on an error); exits 0 on
success, 1 when the receiver answered with an error, 2 on bad usage, 3 when it could
not be reached (the answer printed is then made here, ``error_type`` "Unreachable").
``--url`` defaults to ``$WEIGHTSYNC_CONTROL_URL``. Standard library only: no event loop,
no torch work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

ENV_URL = "WEIGHTSYNC_CONTROL_URL"
ENV_TOKEN = "WEIGHTSYNC_CONTROL_TOKEN"  # the same variable the receiver reads (receiver/control/http_api.py)

# command -> (HTTP method, path, takes --tags)
COMMANDS: dict[str, tuple[str, str, bool]] = {
    "pause": ("POST", "/v1/pause", False),
    "resume": ("POST", "/v1/resume", False),
    "is-paused": ("GET", "/v1/is_paused", False),
    "status": ("GET", "/v1/version", False),
    "health": ("GET", "/health", False),
    "sleep": ("POST", "/v1/sleep", True),
    "wakeup": ("POST", "/v1/wakeup", True),
    "update-weights": ("POST", "/v1/update_weights", False),
    "abort-requests": ("POST", "/v1/abort_requests", False),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m receiver ctl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS))
    p.add_argument("--url", default=os.environ.get(ENV_URL), help=f"the receiver's control API (default ${ENV_URL})")
    p.add_argument("--token", default=os.environ.get(ENV_TOKEN), help=f"bearer token of the control API (default ${ENV_TOKEN})")
    p.add_argument("--tags", help="sleep / wakeup: comma-separated subset of weight,kv_cache (default both)")
    p.add_argument("--version", dest="weight_version", help="update-weights: the version to reach (default: the sender's current)")
    p.add_argument("--verify-checksum", action="store_true", help="update-weights: compare the state digest with the sender's")
    p.add_argument("--timeout", type=float, default=60.0, help="update-weights: seconds to wait for the version")
    p.add_argument("--all", dest="abort_all", action="store_true", help="abort-requests: every request in flight")
    p.add_argument("--req-ids", help="abort-requests: comma-separated ids of the requests to abort")
    args = p.parse_args(argv)
    if not args.url:
        p.error(f"--url is required (or set ${ENV_URL})")
    if args.tags is not None and not COMMANDS[args.command][2]:
        p.error(f"--tags applies to sleep and wakeup, not {args.command}")
    if args.command != "update-weights" and (args.weight_version is not None or args.verify_checksum):
        p.error("--version and --verify-checksum apply to update-weights only")
    if args.command != "abort-requests" and (args.abort_all or args.req_ids is not None):
        p.error("--all and --req-ids apply to abort-requests only")
    if args.command == "abort-requests" and not args.abort_all and not args.req_ids:
        p.error("abort-requests needs --all or --req-ids ID[,ID...]")
    return args


def local_error(error_type: str, message: str) -> dict[str, Any]:
    """An error answer in the receiver's shape, for what did not come from it."""
    return {"request_id": None, "status": "error", "error_message": message, "result": None, "error_type": error_type}


def request(args: argparse.Namespace) -> tuple[int, Any]:
    """Send the command; returns the HTTP status and the decoded JSON body."""
    method, path, _ = COMMANDS[args.command]
    url = args.url.rstrip("/") + path
    data = None
    if args.tags is not None:
        url += "?" + urllib.parse.urlencode({"tags": args.tags})
    if args.command == "update-weights":
        version: Any = args.weight_version
        if version is not None and version.isdigit():
            version = int(version)
        data = json.dumps({"version": version, "verify_checksum": args.verify_checksum, "timeout": args.timeout}).encode()
    if args.command == "abort-requests":
        ids = [] if not args.req_ids else [i for i in args.req_ids.split(",") if i]
        data = json.dumps({"abort_all": args.abort_all, "req_ids": ids}).encode()
    headers = {"Content-Type": "application/json"}
    if args.token:
        headers["Authorization"] = f"Bearer {args.token}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout + 10) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, local_error(f"HTTP{e.code}", body.decode(errors="replace"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        status, body = request(args)
    except (urllib.error.URLError, OSError) as e:
        print(json.dumps(local_error("Unreachable", f"{args.url}: {e}")), file=sys.stderr)
        return 3
    print(json.dumps(body))
    return 0 if status < 400 and isinstance(body, dict) and body.get("status") == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
