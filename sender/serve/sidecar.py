"""The sender sidecar's ``ipc`` mode: serve the weights a trainer publishes into shared memory.

``python -m sender --load-strategy ipc --shm NAME --handoff ENDPOINT`` binds a ROUTER on
``--handoff`` for ``sender.SidecarClient`` and, on the first ``publish``, maps the
trainer's region and starts a ``Sender`` whose model is a state dict of views onto it.
Each later ``publish`` is ``await sender.sync(views, version)``; the reply ``collected``
goes out once ``sync`` has returned (the changes are collected, the region may be
overwritten). The trainer owns the region; this process only maps it, so a restarted
sidecar finds it by name and serves the version it holds right away.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Any

import torch
import zmq
import zmq.asyncio

from protocol.errors import MetadataMismatchError, ProtocolError, SharedMemoryError, StaleVersionError, TransportError, WeightSyncError
from protocol.host.cli import report
from protocol.host.shm import Layout, Region
from protocol.net.context import shared_context
from protocol.net.sockets import handoff_socket, transport_errors

from .client import decode, encode, error_reply
from .service import Sender

log = logging.getLogger(__name__)


class ShmSidecar:
    """Owns the hand-off socket, the mapped region and the ``Sender`` built on it."""

    def __init__(self, args: argparse.Namespace, context: zmq.asyncio.Context | None = None) -> None:
        self.args = args
        self._context = context or shared_context()
        self.region: Region | None = None
        self.layout: Layout | None = None  # fixed by the first region served
        self.views: dict[str, torch.Tensor] = {}
        self.sender: Sender | None = None

    async def resume(self) -> None:
        """After a restart: the trainer's region is still there with its last version."""
        try:
            region = Region.attach(self.args.shm)
        except SharedMemoryError:
            return  # no trainer yet: wait for its first publish
        # Held still while the Sender copies it: a trainer that got its answer from the
        # sidecar before this one may be writing the next version right now.
        try:
            with region.reading(timeout=5.0) as version:
                if version is not None:
                    self._adopt(region)
                    await self._start(version)
                    return
        except SharedMemoryError as e:  # torn by a trainer killed mid-copy: its next publish rewrites it
            log.warning("not resuming from %s: %s", self.args.shm, e)
        region.close()  # nothing to serve yet: wait for the first publish

    async def handle(self, msg: dict[str, Any]) -> bytes:
        """Answer one hand-off message (``collected`` or a typed error)."""
        version = msg["version"]
        try:
            if msg["op"] != "publish":
                raise ProtocolError(f"unknown hand-off op {msg['op']!r}")
            await self._publish(version, msg.get("generation"))
        except TransportError:
            raise  # this sidecar's own socket (its endpoint taken, say): it cannot serve, it stops
        except WeightSyncError as e:
            log.error("publish v%s refused: %s", version, e)
            return error_reply(version, e)
        assert self.sender is not None
        return encode("collected", version=version, session=self.sender.session)

    async def close(self) -> None:
        if self.sender is not None:
            await self.sender.close()
        if self.region is not None:
            self.region.close()

    async def _publish(self, version: int, generation: object) -> None:
        region = self.region
        if region is None or region.generation != generation:
            region = Region.attach(self.args.shm)
            if region.generation != generation:
                region.close()
                raise SharedMemoryError(f"region {self.args.shm!r} is not the one v{version} was published into (recreated since?)")
            self._adopt(region)
        sender = self.sender
        if sender is not None and sender.version is not None:
            if version == sender.version:
                return  # a repeat (resent, or already served after a restart): collected
            if version < sender.version:
                raise StaleVersionError(f"v{version} is older than v{sender.version}, which this sidecar serves", current=sender.version, got=version)
        seq = region.seq
        if seq % 2 or region.version != version:
            raise SharedMemoryError(f"region holds v{region.version} (seq {seq}), not a complete v{version}")
        if sender is None:
            await self._start(version)
        else:
            stats = await sender.sync(self.views, version)
            report("synced", **stats.as_dict(), receivers=sender.receivers)
        if region.seq != seq:  # the client broke the hand-off: what was collected may be torn
            raise SharedMemoryError(f"region was written while v{version} was being collected")

    def _adopt(self, region: Region) -> None:
        if self.layout is not None:
            why = region.layout.same_as(self.layout)
            if why is not None:
                region.close()
                raise MetadataMismatchError(f"the trainer's region differs from the one this sidecar serves: {why}")
        if self.region is not None:
            self.region.close()
        self.region, self.layout, self.views = region, region.layout, region.tensors()

    async def _start(self, version: int | None) -> None:
        assert self.layout is not None
        a = self.args
        self.sender = Sender(
            a.endpoint, a.config, trainable_keys=self.layout.tracked, ring_size=a.ring_size, ring_bytes=a.ring_bytes, max_inflight=a.max_inflight,
            heartbeat_interval=a.heartbeat, peer_timeout=a.peer_timeout,
            curve=getattr(a, "curve", None), insecure_plaintext=getattr(a, "insecure_plaintext", False), context=self._context,
            metrics_address=getattr(a, "metrics_address", None), metrics_token=getattr(a, "metrics_token", None),
            **getattr(a, "policy", {}),
        )
        await self.sender.start(self.views, version=version)
        report("listening", endpoint=self.sender.endpoint, version=version, session=self.sender.session, shm=a.shm,
               metrics=self.sender.metrics_url)


async def serve_shm(args: argparse.Namespace, stop: asyncio.Event) -> None:
    """Run the ``ipc`` sidecar until ``stop``."""
    context = shared_context(args.io_threads)
    handoff = handoff_socket(context, zmq.ROUTER)
    try:
        with transport_errors(f"cannot bind the hand-off at {args.handoff}"):
            handoff.bind(args.handoff)
    except BaseException:
        handoff.close(0)
        raise
    sidecar = ShmSidecar(args, context)
    report("handoff", endpoint=args.handoff, shm=args.shm)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await sidecar.resume()
        while not stop.is_set():
            receiving = asyncio.ensure_future(handoff.recv_multipart())
            await asyncio.wait([receiving, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not receiving.done():
                receiving.cancel()
                break
            with transport_errors(f"receiving on the hand-off at {args.handoff}"):
                frames = receiving.result()
            if len(frames) != 2:
                log.warning("dropping a hand-off message of %d frames", len(frames))
                continue
            identity, payload = frames
            try:
                msg = decode(payload)
            except ProtocolError as e:
                log.warning("dropping a bad hand-off message: %s", e)
                continue
            reply = await sidecar.handle(msg)
            with transport_errors(f"answering on the hand-off at {args.handoff}"):
                await handoff.send_multipart([identity, reply])
    finally:
        stopping.cancel()
        await sidecar.close()
        handoff.close(0)
    report("stopped", version=sidecar.sender.version if sidecar.sender else None)
