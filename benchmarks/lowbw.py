"""Low bandwidth: rollouts behind a slow, delayed link (the decentralised case, PULSE's setting).

    python -m benchmarks --suite lowbw --json OUT.json [--mbit 100] [--rtt-ms 40]

The same workloads and paths as the other suites (``benchmarks.e2e``: weightsync patch and
bucket, a safetensors file, a gloo broadcast; 2 receivers each), but the receivers and the
peer workers run in a network namespace joined to the trainer by a veth pair, and

* the trainer-to-rollouts direction is shaped to ``--mbit`` Mbit/s with ``tc tbf``
  (``benchmarks.fanout.shaped_uplink``: the kernel here has no ``netem``);
* ``--rtt-ms`` comes from a userspace TCP proxy inside the namespace
  (``tests/proxy.py``'s delay, every chunk forwarded ``rtt/2`` after it arrived, each
  way): the weightsync receivers reach their Sender, and the safetensors workers the
  trainer's file server, through it. gloo cannot be proxied (its ranks connect to
  addresses they exchange themselves), so gloo crosses the shaped link without the delay.

safetensors here is a file hand-off over the network: the trainer writes the file (tmpfs),
each worker downloads it whole over TCP (``socket.sendfile`` on the trainer's side), then
``load`` + ``load_state_dict``. The bytes each path put on the shaped link are read from the
qdisc's counter before and after it (``link_bytes`` per step). Only the namespace pair's
addresses and loopback are used; the namespace (and with it the veth pair, its qdisc and the
proxies' sockets) is removed on exit. Needs Linux, root, ``ip`` and ``tc``; otherwise the
suite is skipped with the reason (``why_not``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MBIT = 100.0
DEFAULT_RTT_MS = 40.0


def why_not() -> str | None:
    """Why the low-bandwidth suite cannot run here (None: it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, or in CI via .ci/run)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2")):
        if shutil.which(tool) is None:
            return f"'{tool}' ({package}) is not installed (.ci/run installs it)"
    probe = f"wslbw{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    return None


def _ip(*args: str) -> str:
    return subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30).stdout


def interface_with(address: str, ns: str | None = None) -> str:
    """The name of the interface holding ``address`` (in namespace ``ns``)."""
    out = _ip(*(["-n", ns] if ns else []), "-o", "-4", "addr", "show")
    for line in out.splitlines():
        fields = line.split()
        if f"{address}/" in line:
            return fields[1]
    raise RuntimeError(f"no interface holds {address}")


def tbf_bytes_sent(dev: str) -> int:
    stats = subprocess.run(["tc", "-s", "qdisc", "show", "dev", dev], check=True, capture_output=True, text=True, timeout=30).stdout
    return int(stats.split("Sent ", 1)[1].split()[0])


class ShapedLink:
    """``benchmarks.e2e``'s network for the rigs: the Sender bound to this side's end of the
    veth, each rig's receivers in the namespace behind a delaying proxy of their own."""

    insecure_plaintext = True  # a non-loopback bind without CURVE: a test link of this machine

    def __init__(self, ns: str, host_ip: str, host_if: str, delay_s: float) -> None:
        self.ns, self.bind, self.host_if, self.delay_s = ns, host_ip, host_if, delay_s
        self.prefix = ("ip", "netns", "exec", ns)
        self.proxies: list[asyncio.subprocess.Process] = []

    async def proxy(self, upstream: tuple[str, int]) -> tuple[tuple[str, int], asyncio.subprocess.Process]:
        """A delaying TCP proxy on the namespace's loopback to ``upstream``; (its address there, the process)."""
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        proc = await asyncio.create_subprocess_exec(
            *self.prefix, sys.executable, "-m", "benchmarks.lowbw", "proxy", "--listen", "127.0.0.1:0",
            "--upstream", f"{upstream[0]}:{upstream[1]}", "--delay", str(self.delay_s),
            stdout=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL, cwd=ROOT, env=env)
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"the proxy exited with {await proc.wait()}")
        host, port = json.loads(line)["endpoint"].removeprefix("tcp://").rsplit(":", 1)
        self.proxies.append(proc)
        return (host, int(port)), proc

    async def route(self, sender_endpoint: str) -> tuple[str, Any]:
        host, port = sender_endpoint.removeprefix("tcp://").rsplit(":", 1)
        (phost, pport), proc = await self.proxy((host, int(port)))
        return f"tcp://{phost}:{pport}", proc

    async def unroute(self, handle: Any) -> None:
        if handle is None:
            return
        if handle.returncode is None:
            handle.terminate()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(handle.wait(), 10)
        if handle in self.proxies:
            self.proxies.remove(handle)

    def link_bytes(self) -> int | None:
        return tbf_bytes_sent(self.host_if)

    async def close(self) -> None:
        for proc in list(self.proxies):
            await self.unroute(proc)


def workloads(tiny: bool = False) -> list[Any]:
    """The quick suite's model (8.4M parameters): bf16 receivers at lr 1e-6 and 1e-5 (sparse),
    fp32 receivers (every element changes); ``tiny``: one small synthetic workload (the test)."""
    import torch

    from .workloads import SUITES, RealWorkload, SyntheticWorkload

    if tiny:
        return [SyntheticWorkload("synthetic-tiny-2%", 0.02, [(256, 256), (256,)], measured_steps=1)]
    model = SUITES["quick"].model
    return [
        RealWorkload("real-bf16-lr1e-6", torch.bfloat16, 1e-6, model, 3),
        RealWorkload("real-bf16-lr1e-5", torch.bfloat16, 1e-5, model, 3),
        RealWorkload("real-fp32-lr1e-5", torch.float32, 1e-5, model, 2),
    ]


async def run(chosen: list[Any], mbit: float = DEFAULT_MBIT, rtt_ms: float = DEFAULT_RTT_MS) -> dict[str, Any]:
    """Every path of every workload in ``chosen`` across the shaped link; the result document
    (``benchmarks.e2e.finish`` objects under ``results``)."""
    from . import e2e, report
    from .bandwidth import copy_bandwidth
    from .fanout import shaped_uplink
    from .memory import free_port
    from .peers import PeerGroup, PeerLink
    from .report import evaluate_targets

    reason = why_not()
    if reason:
        raise RuntimeError(f"the low-bandwidth suite cannot run here: {reason}")
    started, load = time.perf_counter(), os.getloadavg()[0]
    link_Bps = mbit * 1e6 / 8
    with shaped_uplink(mbit) as (ns, host_ip):
        host_if, ns_ip = interface_with(host_ip), host_ip.rsplit(".", 1)[0] + ".2"
        ns_if = interface_with(ns_ip, ns)
        net = ShapedLink(ns, host_ip, host_if, rtt_ms / 2e3)
        listener = socket.create_server((host_ip, 0))
        peers = None
        try:
            fetch, _ = await net.proxy((host_ip, listener.getsockname()[1]))
            peers = PeerGroup(free_port(), link=PeerLink(ns, host_ip, host_if, ns_if, listener.getsockname()[1], fetch), listener=listener)
            e2e.NETWORK = net
            copy_bps = copy_bandwidth(128 << 20)
            pending = []
            for w in chosen:
                t0 = time.perf_counter()
                pending.append(await e2e.run_workload(w, peers, memory_pass=False))
                pending[-1]["wall_s"] = time.perf_counter() - t0
                print(f"  {w.name}: {pending[-1]['wall_s']:.1f}s", file=sys.stderr, flush=True)
            results = [e2e.finish(r, copy_bps, link_Bps) for r in pending]
        finally:
            e2e.NETWORK = e2e.Loopback()
            if peers is not None:
                peers.close()
            listener.close()
            await net.close()
    for r in results:
        r["link_bytes"] = mean_link_bytes(r["steps"])
        r["notes"].append("zmq_raw_Bps here: the shaped link's rate (bucket_Bps / it is the link's use); "
                          "link_bytes: mean bytes each path put on the shaped link per measured step (the qdisc's counter)")
    doc: dict[str, Any] = {
        "benchmark": "weightsync-lowbw",
        "suite": "lowbw",
        "command": report.command("-m benchmarks"),
        "machine": report.machine(load),
        "link": {
            "mbit": mbit, "rtt_ms": rtt_ms,
            "shaping": f"veth into a namespace, tc tbf {mbit:g} Mbit/s towards the receivers (burst 256 kB, latency 500 ms); "
                       "the other direction unshaped",
            "delay": f"userspace TCP proxy in the namespace (tests/proxy.py's delay), {rtt_ms / 2:g} ms each way, for the weightsync "
                     "receivers and the safetensors downloads; gloo crosses the link without it",
        },
        "copy_Bps": copy_bps,
        "zmq_raw_Bps": link_Bps,
        "results": results,
        "targets": evaluate_targets(results),
        "wall_s": time.perf_counter() - started,
    }
    return doc


PATHS = ("patch", "bucket", "safetensors", "gloo")
TIMES = {"patch": "e2e_patch_s", "bucket": "e2e_bucket_s", "safetensors": "e2e_safetensors_s", "gloo": "e2e_gloo_s"}


def mean_link_bytes(steps: list[dict[str, Any]]) -> dict[str, float] | None:
    counted = [s["link_bytes"] for s in steps if s.get("link_bytes")]
    if not counted:
        return None
    return {p: sum(c[p] for c in counted) / len(counted) for p in PATHS}


def table(doc: dict[str, Any]) -> str:
    """Markdown: per workload, each path's time (median) and bytes on the link (mean), the fastest."""
    from .report import fmt_bytes

    link = doc["link"]
    rows = [f"link: {link['mbit']:g} Mbit/s, {link['rtt_ms']:g} ms RTT; 2 receivers; times in ms (median), bytes on the link per step (mean)",
            "| workload | changed | " + " | ".join(f"{p} ms | {p} on link" for p in PATHS) + " | fastest |",
            "| --- | --- | " + " | ".join("--- | ---" for _ in PATHS) + " | --- |"]
    for r in doc["results"]:
        lb = r.get("link_bytes") or {}
        cells = []
        for p in PATHS:
            b = lb.get(p)
            cells.append(f"{r[TIMES[p]] * 1e3:,.0f} | {fmt_bytes(b)}")
        fastest = min(PATHS, key=lambda p: r[TIMES[p]])
        rows.append(f"| {r['workload']} | {100 * r['density']:.3g}% | " + " | ".join(cells) + f" | {fastest} |")
    return "\n".join(rows)


# -- the proxy process ------------------------------------------------------------------------
def proxy_main(argv: list[str]) -> None:
    """``python -m benchmarks.lowbw proxy --listen H:P --upstream H:P --delay S``: tests/proxy.py's
    Proxy with its delay, forwarding both directions as bytes (no ZMTP parsing, so any TCP
    stream passes: ZeroMQ and the safetensors download alike)."""
    import argparse

    sys.path.insert(0, str(ROOT / "tests"))
    from proxy import Proxy  # type: ignore[import-not-found]

    p = argparse.ArgumentParser(prog="python -m benchmarks.lowbw proxy")
    p.add_argument("--listen", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    args = p.parse_args(argv)

    def hostport(text: str) -> tuple[str, int]:
        host, port = text.rsplit(":", 1)
        return host, int(port)

    async def serve() -> None:
        async with Proxy(hostport(args.upstream), hostport(args.listen), delay=args.delay, raw=True) as proxy:
            print(json.dumps({"event": "proxy", "endpoint": proxy.endpoint}), flush=True)
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    if sys.argv[1:2] == ["proxy"]:
        proxy_main(sys.argv[2:])
    else:
        raise SystemExit("usage: python -m benchmarks --suite lowbw --json OUT.json [--mbit M] [--rtt-ms R]  "
                         "(python -m benchmarks.lowbw proxy ... is the suite's proxy process)")
