"""Ask a sender (or relay) which keys and shapes it serves, before saying HELLO.

A receiver normally declares its own model. One whose model is laid out differently
(vLLM's fused, sharded parameters: ``receiver.vllm``) first learns the trainer's
checkpoint names and shapes, derives where each lives in its runtime layout, and then
declares exactly those.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import zmq.asyncio

from protocol.errors import WeightSyncError, WeightSyncTimeout
from protocol.net.context import shared_context
from protocol.net.security import CurveClient, check_transport
from protocol.net.sockets import DealerSocket
from protocol.wire.framing import MessageType, decode_message, encode_message
from protocol.wire.messages import Description, DigestRequest
from protocol.wire.metadata import ModelMetadata


async def ask_metadata(
    endpoints: str | Sequence[str],
    *,
    curve: CurveClient | None = None,
    insecure_plaintext: bool = False,
    timeout: float = 30.0,
    context: zmq.asyncio.Context | None = None,
) -> ModelMetadata:
    """The metadata the first answering upstream serves (its dtypes are its own).

    Upstreams are tried in turn until ``timeout`` runs out, each given an equal share
    of it; one that has no model yet answers None, and the next is asked.
    ``WeightSyncTimeout`` (a ``TimeoutError``) when none answered with metadata."""
    upstreams = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    if not upstreams:
        raise WeightSyncError("no upstream endpoint to ask")
    ctx = context or shared_context()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    errors: list[str] = []
    while loop.time() < deadline:
        for endpoint in upstreams:
            check_transport(endpoint, curve, insecure_plaintext, role="receiver")
            share = max(0.05, min(deadline - loop.time(), timeout / len(upstreams)))
            sock = DealerSocket(ctx, endpoint, f"describe-{uuid.uuid4().hex[:8]}".encode(), curve=curve)
            try:
                found = await asyncio.wait_for(_ask(sock), share)
                if found is not None:
                    return found
                errors.append(f"{endpoint}: no model yet")
            except asyncio.TimeoutError:
                errors.append(f"{endpoint}: no answer within {share:.3g}s")
            finally:
                sock.close()
            if loop.time() >= deadline:
                break
        await asyncio.sleep(min(0.2, max(0.0, deadline - loop.time())))
    raise WeightSyncTimeout(f"no upstream described its model within {timeout}s ({'; '.join(errors[-len(upstreams):])})")


async def _ask(sock: DealerSocket) -> ModelMetadata | None:
    nonce = uuid.uuid4().hex
    await sock.send(encode_message(DigestRequest(nonce, metadata=True).to_message()))
    while True:
        msg = decode_message(await sock.recv())
        if msg.type is MessageType.DIGEST:
            answer = Description.from_body(msg.body)
            if answer.nonce == nonce:
                return answer.metadata
