"""Which upstream a receiver's next session connects to: a list tried in turn, or a resolver.

A list (the sender, or relays) moves on to its next entry whenever a session is lost; a
resolver (a callable, sync or async) is asked for the address before each session, for a
sender whose address changes when it restarts (a Ray actor, a Kubernetes pod).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence

from protocol.errors import ConfigError
from protocol.net.security import CurveClient, check_transport

from .session import Reconnect

Resolver = Callable[[], "str | Awaitable[str]"]  # asked for the sender's address before each session


class Upstreams:
    """``endpoint`` as ``Receiver`` takes it; each address is checked against ``curve``
    (plaintext beyond loopback needs ``insecure_plaintext``), a resolver's when it answers."""

    def __init__(self, endpoint: str | Sequence[str] | Resolver, curve: CurveClient | None, insecure_plaintext: bool) -> None:
        self._resolver = endpoint if callable(endpoint) else None
        self.endpoints = [] if callable(endpoint) else [endpoint] if isinstance(endpoint, str) else list(endpoint)
        if not self.endpoints and self._resolver is None:
            raise ConfigError("a receiver needs at least one upstream endpoint")
        for upstream in self.endpoints:
            check_transport(upstream, curve, insecure_plaintext, role="receiver")
        self._upstream = 0
        self._resolved: str | None = None
        self._curve, self._insecure_plaintext = curve, insecure_plaintext

    @property
    def endpoint(self) -> str:
        """The upstream followed (or tried next; with a resolver, the address it last
        returned, empty before the first)."""
        return self.endpoints[self._upstream] if self._resolver is None else self._resolved or ""

    def lost(self) -> None:
        """A session ended: a list moves on to its next entry (a lost parent: try the next)."""
        if self.endpoints:
            self._upstream = (self._upstream + 1) % len(self.endpoints)

    async def find(self, timeout: float) -> str:
        """The address for this session: the current list entry, or what the resolver
        says now (an async one within ``timeout``)."""
        if self._resolver is None:
            return self.endpoint
        try:
            found = self._resolver()
            if inspect.isawaitable(found):
                found = await asyncio.wait_for(found, timeout)
        except Exception as e:  # the sender may be restarting: ask again after a backoff
            raise Reconnect(f"the endpoint resolver failed: {e!r}") from e
        if not isinstance(found, str) or not found:
            raise ConfigError(f"the endpoint resolver returned {found!r}, not an address")
        check_transport(found, self._curve, self._insecure_plaintext, role="receiver")
        self._resolved = found
        return found
