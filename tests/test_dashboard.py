"""The Grafana dashboard in examples/grafana/ (issue 37): every panel's query names only metrics
that a real Sender and Receiver export, in the form Prometheus stores them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from examples.tiny_model import build, train_step
from receiver import Receiver
from sender import Sender

DASHBOARD = Path(__file__).resolve().parent.parent / "examples" / "grafana" / "weightsync.json"
NAME = re.compile(r"\bweightsync_[a-z_]+\b")
CONFIG = {"weight_syncer": {"type": "patch"}}


def exported(text: str) -> set[str]:
    """The series names a scrape of ``text`` stores: counters with ``_total``, histograms with
    ``_bucket``/``_count``/``_sum``, gauges as they are (samples or not)."""
    names = set()
    for f in text_string_to_metric_families(text):
        if f.type == "counter":
            names.add(f.name + "_total")
        elif f.type == "histogram":
            names |= {f.name + s for s in ("_bucket", "_count", "_sum")}
        else:
            names.add(f.name)
    return names


async def test_every_panel_queries_metrics_the_code_exports() -> None:
    model = build(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    async with Sender("tcp://127.0.0.1:0", CONFIG) as sender:
        await sender.start(model, version=0)
        async with Receiver(build(seed=1).to(torch.bfloat16), sender.endpoint, CONFIG) as receiver:
            await receiver.start()
            train_step(model, optimizer, torch.Generator().manual_seed(0))
            await sender.sync(model, 1)
            await sender.flush()
            await receiver.wait_for_version(1, timeout=30)
            names = exported(sender.metrics.render()[0].decode()) | exported(receiver.metrics.render()[0].decode())
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            found = NAME.findall(target["expr"])
            assert found, f"panel {panel['title']!r}: {target['expr']!r} names no weightsync metric"
            missing = [n for n in found if n not in names]
            assert not missing, f"panel {panel['title']!r} queries {missing}, which nothing exports"
            queried |= set(found)
    # what the issue asks the dashboard to show
    for wanted in ("weightsync_sender_version", "weightsync_sender_receiver_lag_versions", "weightsync_sender_wire_bytes_total",
                   "weightsync_sender_dense_bytes_total", "weightsync_sender_build_seconds_bucket", "weightsync_sender_resyncs_total"):
        assert wanted in queried, wanted
