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


def zmq_raw_throughput(nbytes: int, frame: int, repeat: int = 3) -> float:
    """Bytes per second of one multipart message of ``nbytes`` in ``frame``-sized frames,
    DEALER -> ROUTER over tcp loopback, sent zero-copy; from the send call until the whole
    message is received (best of ``repeat``). Sender and receiver run in two threads."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
    frames = [memoryview(payload[i : i + frame]) for i in range(0, nbytes, frame)]
    try:
        dealer.send(b"hello")  # connect and route before timing
        router.recv_multipart()
        best = float("inf")
        for _ in range(repeat):
            got: list[int] = []
            ready = threading.Event()

            def receive(got: list[int] = got, ready: threading.Event = ready) -> None:
                ready.set()
                parts = router.recv_multipart(copy=False)
                got.append(sum(len(p.buffer) for p in parts[1:]))

            thread = threading.Thread(target=receive)
            thread.start()
            ready.wait()
            started = time.perf_counter()
            dealer.send_multipart(frames, copy=False)
            thread.join()
            elapsed = time.perf_counter() - started
            if got != [nbytes]:
                raise RuntimeError(f"received {got} bytes, sent {nbytes}")
            best = min(best, elapsed)
        return nbytes / best
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()
