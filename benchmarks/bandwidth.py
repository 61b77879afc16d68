"""The machine's own ceilings, measured in the same run: memory copy and raw ZeroMQ."""

from __future__ import annotations

import threading
import time

import torch
import zmq


def copy_bandwidth(nbytes: int, repeat: int = 5) -> float:
    """Bytes read per second by ``dst.copy_(src)`` of two large CPU fp32 tensors (best of ``repeat``)."""
    n = nbytes // 4
    src = torch.randn(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return n * 4 / best


def zmq_raw_throughput(nbytes: int, frame: int, repeat: int = 3, receivers: int = 2) -> float:
    """Bytes delivered per second when one ROUTER sends a multipart message of ``nbytes``
    (in ``frame``-sized frames, zero-copy) to each of ``receivers`` DEALERs over tcp
    loopback: the fan-out a sync does. From the first send call until every receiver has
    the whole message (best of ``repeat``); the receivers are threads of this process."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for i in range(receivers):
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IDENTITY, b"raw-%d" % i)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealers.append(dealer)
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
    frames = [memoryview(payload[i : i + frame]) for i in range(0, nbytes, frame)]
    try:
        identities = []
        for dealer in dealers:  # connect and route before timing
            dealer.send(b"hello")
            identities.append(router.recv_multipart()[0])
        best = float("inf")
        for _ in range(repeat):
            got: list[int] = []
            ready = threading.Barrier(receivers + 1)

            def receive(dealer: zmq.Socket, got: list[int] = got, ready: threading.Barrier = ready) -> None:
                ready.wait()
                parts = dealer.recv_multipart(copy=False)
                got.append(sum(len(p.buffer) for p in parts))

            threads = [threading.Thread(target=receive, args=(d,)) for d in dealers]
            for t in threads:
                t.start()
            ready.wait()
            started = time.perf_counter()
            for identity in identities:
                router.send_multipart([identity, *frames], copy=False)
            for t in threads:
                t.join()
            elapsed = time.perf_counter() - started
            if got != [nbytes] * receivers:
                raise RuntimeError(f"received {got} bytes, sent {nbytes} to each of {receivers}")
            best = min(best, elapsed)
        return receivers * nbytes / best
    finally:
        for dealer in dealers:
            dealer.close(0)
        router.close(0)
        ctx.term()
