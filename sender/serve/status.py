"""``python -m sender status``: where a deployment stands, read from a sender's metrics endpoint
(no second protocol: the Prometheus text ``sender/serve/metrics.py`` serves).

    python -m sender status --metrics http://127.0.0.1:9400 [--token T] [--json]

Prints each connected receiver (acknowledged and sent version, lag in versions and seconds,
credits in flight, ACK age), the staleness bound's waits and drops (``Sender(max_lag=...)``)
and the sender's last versions with their phase times and bytes;
``--json`` prints the same as one object for scripts. ``--metrics`` is the endpoint's base URL
or its ``/metrics`` URL (the one the sender logs). Exits 1 when the endpoint cannot be read or
is not a weightsync sender's metrics (a receiver's control port, another exporter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .metrics import PHASES, TOKEN_ENV

RECEIVER_FIELDS = {
    "acked": "weightsync_sender_receiver_acked_version",
    "sent": "weightsync_sender_receiver_sent_version",
    "lag_versions": "weightsync_sender_receiver_lag_versions",
    "lag_seconds": "weightsync_sender_receiver_lag_seconds",
    "inflight": "weightsync_sender_receiver_inflight",
    "ack_age_seconds": "weightsync_sender_receiver_ack_age_seconds",
}


def metrics_url(url: str) -> str:
    """``url``'s ``/metrics`` URL: given as the base URL or already as the metrics URL."""
    url = url.rstrip("/")
    return url if url.endswith("/metrics") else url + "/metrics"


def fetch(url: str, token: str | None = None, timeout: float = 10.0) -> str:
    """The Prometheus text at ``url``'s ``/metrics`` (``metrics_url``)."""
    request = urllib.request.Request(metrics_url(url))
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return str(response.read().decode())


def not_a_sender(text: str) -> str | None:
    """Why ``text`` is not a weightsync sender's metrics (not Prometheus text, or without
    ``weightsync_sender_version``, which every sender serves); None when it is."""
    try:
        names = sorted({f.name for f in text_string_to_metric_families(text)})
    except ValueError as e:
        return f"not Prometheus text ({e})"
    if "weightsync_sender_version" in names:
        return None
    return f"no weightsync_sender_version among its {len(names)} metrics" + (f" ({', '.join(names[:3])}, ...)" if names else "")


def status_of(text: str) -> dict[str, Any]:
    """The sender's state from its metrics text (``not_a_sender`` says whether it is one)."""
    receivers: dict[str, dict[str, Any]] = {}
    versions: dict[int, dict[str, Any]] = {}
    single: dict[str, float] = {}
    policy: tuple[str, float] = ("off", -1.0)  # a sender of before the staleness bound serves none
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "receiver" in s.labels:
                field = next((k for k, name in RECEIVER_FIELDS.items() if name == s.name), None)
                if field is not None:
                    receivers.setdefault(s.labels["receiver"], {})[field] = _number(s.value)
            elif s.name == "weightsync_sender_version_phase_seconds":
                versions.setdefault(int(s.labels["version"]), {})[f"{s.labels['phase']}_s"] = s.value
            elif s.name == "weightsync_sender_version_bytes":
                versions.setdefault(int(s.labels["version"]), {})[f"{s.labels['kind']}_bytes"] = int(s.value)
            elif s.name == "weightsync_sender_lag_policy":
                policy = (s.labels["policy"], s.value)
            elif not s.labels:
                single[s.name] = s.value
    version = single.get("weightsync_sender_version", -1)
    lag = {k: _number(single.get(f"weightsync_sender_lag_{k}_total", 0)) for k in ("waits", "wait_seconds", "timeouts", "drops", "over")}
    return {
        "version": None if version < 0 else int(version),
        "receivers_connected": int(single.get("weightsync_sender_receivers_connected", 0)),
        "resyncs": int(single.get("weightsync_sender_resyncs_total", 0)),
        "lag": {"policy": policy[0], "max_lag": None if policy[1] < 0 else int(policy[1]), **lag},
        "behind_asks": int(single.get("weightsync_sender_behind_asks_total", 0)),
        "resends": {k: int(single.get(f"weightsync_sender_{k}_resends_total", 0)) for k in ("ring", "bucket")},
        "receivers": dict(sorted(receivers.items())),
        "versions": [{"version": v, **fields} for v, fields in sorted(versions.items())],
    }


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x


def table(status: dict[str, Any]) -> str:
    """The status as text tables."""
    lines = [f"sender at v{status['version']}, {status['receivers_connected']} receivers connected, {status['resyncs']} resyncs"]
    lag = status["lag"]
    if lag["max_lag"] is not None:
        lines.append(f"staleness bound: max_lag {lag['max_lag']}, policy {lag['policy']}: {lag['waits']} waits ({lag['wait_seconds']:.1f}s), "
                     f"{lag['timeouts']} timed out, {lag['drops']} receivers dropped, {lag['over']} found beyond it")
    header: tuple[str, ...] = ("receiver", "acked", "sent", "lag", "lag s", "in flight", "last ACK s")
    rows: list[tuple[str, ...]] = [
        (name, _v(r.get("acked")), _v(r.get("sent")), str(r.get("lag_versions", "")), f"{r.get('lag_seconds', 0):.1f}",
         str(r.get("inflight", "")), f"{r.get('ack_age_seconds', 0):.1f}")
        for name, r in status["receivers"].items()
    ]
    lines += ["", *_grid(header, rows)]
    if status["versions"]:
        header = ("version", *(f"{p} s" for p in PHASES), "wire bytes", "dense bytes")
        rows = [
            (str(v["version"]), *(f"{v[p + '_s']:.3f}" if p + "_s" in v else "-" for p in PHASES),
             str(v.get("wire_bytes", "-")), str(v.get("dense_bytes", "-")))
            for v in status["versions"]
        ]
        lines += ["", *_grid(header, rows)]
    return "\n".join(lines)


def _v(x: Any) -> str:
    return "-" if x is None or x < 0 else f"v{x}"


def _grid(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    return ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in (header, *rows)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m sender status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--metrics", required=True, metavar="URL", help="the sender's metrics endpoint (Sender.metrics_url), e.g. http://127.0.0.1:9400")
    p.add_argument("--token", default=os.environ.get(TOKEN_ENV), help=f"its bearer token (default ${TOKEN_ENV})")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    args = p.parse_args(argv)
    try:
        text = fetch(args.metrics, args.token)
    except (urllib.error.URLError, OSError) as e:
        print(f"cannot read {metrics_url(args.metrics)}: {e}", file=sys.stderr)
        return 1
    why = not_a_sender(text)
    if why is not None:
        print(f"{metrics_url(args.metrics)} is not a weightsync sender's metrics: {why}", file=sys.stderr)
        return 1
    status = status_of(text)
    print(json.dumps(status, indent=2) if args.json else table(status))
    return 0
