"""Keeping a route alive: blacklist failed peers with backoff, re-plan, reopen, and let the backend replay.

When a window fails (a stream resets, a deadline passes, a peer answers with an
error), the head pings every hop of the route; peers that do not answer, and a
peer an error names, are blacklisted for a backoff that doubles with each
failure. A fresh survey of the DHT then plans a new route without them and a
new session is opened on it; the backend replays the committed tokens into the
new peers' caches and carries on, so no token is lost or repeated.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.ping import measure_rtt
from dsd.discovery.survey import survey
from dsd.protocol import Hop, WireFormat

from .errors import RouteError
from .legs import ReturnLegs
from .session import RouteSession

log = logging.getLogger(__name__)


@dataclass
class Blacklist:
    """Peers to avoid, each until its backoff runs out; the backoff doubles on every new failure."""

    base_s: float = 30.0
    max_s: float = 600.0
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)

    def add(self, peer: str, now: float | None = None) -> float:
        """Blacklist `peer`; returns how long for."""
        now = time.monotonic() if now is None else now
        strikes = self._strikes.get(peer, 0)
        self._strikes[peer] = strikes + 1
        backoff = min(self.max_s, self.base_s * 2**strikes)
        self._until[peer] = now + backoff
        return backoff

    def active(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {p for p, until in self._until.items() if until > now}


@dataclass
class FailoverEvent:
    """One recovery: what failed, whom we blamed, and how long until the new route was open."""

    error: str
    blamed: list[str]
    seconds: float
    new_route: list[str]


class RouteKeeper:
    """Owns the head's current `RouteSession` and replaces it when it fails (from any task).

    Every session's watcher runs in `nursery`, the keeper's own (see `open_route_keeper`), under
    that session's cancel scope, so closing a failed session stops just its watcher.
    """

    def __init__(
        self,
        node: P2PNode,
        legs: ReturnLegs,
        nursery: trio.Nursery,
        *,
        model: str,
        num_layers: int,
        max_len: int,
        wire: WireFormat | None = None,
        blacklist: Blacklist | None = None,
        max_failovers: int = 8,
        probe_timeout_s: float = 3.0,
    ) -> None:
        self.node = node
        self.legs = legs
        self.model = model
        self.num_layers = num_layers
        self.max_len = max_len
        self.wire = wire
        self.blacklist = blacklist or Blacklist()
        self.max_failovers = max_failovers
        self.probe_timeout_s = probe_timeout_s
        self.events: list[FailoverEvent] = []
        self.session: RouteSession | None = None
        self._closed_sent = 0
        self._closed_received = 0
        self._nursery = nursery

    async def _plan(self) -> list[Hop]:
        view = await survey(self.node, self.model, self.num_layers, blacklist=self.blacklist.active())
        if view.plan is None:
            assert view.error is not None
            raise view.error
        return list(view.plan.protocol_hops())

    async def _open(self, hops: list[Hop]) -> None:
        session = RouteSession(self.node, self.legs, hops, model=self.model, max_len=self.max_len, wire=self.wire)
        await session.open(self._nursery)
        self.session = session

    @property
    def bytes_sent(self) -> int:
        """Bytes the head sent over every session this keeper opened."""
        return self._closed_sent + (self.session.traffic.sent if self.session else 0)

    @property
    def bytes_received(self) -> int:
        return self._closed_received + (self.session.traffic.received if self.session else 0)

    async def _close_session(self) -> None:
        session, self.session = self.session, None
        if session is None:
            return
        self._closed_sent += session.traffic.sent
        self._closed_received += session.traffic.received
        await session.close()  # best effort within its own deadline: the old route may be broken

    async def _blame(self, error: RouteError, hops: list[Hop]) -> list[str]:
        """Peers to blacklist: those not answering a ping, else the one the error blames (`error.peer`)."""
        dead: list[str] = []

        async def probe(hop: Hop) -> None:
            try:
                await measure_rtt(self.node, hop.peer_id, hop.addrs, samples=1, timeout=self.probe_timeout_s)
            except Exception:
                dead.append(hop.peer_id)

        async with trio.open_nursery() as nursery:
            for hop in {h.peer_id: h for h in hops}.values():
                nursery.start_soon(probe, hop)
        if dead:
            return dead
        return [error.peer] if error.peer else []

    async def replace(self, error: RouteError) -> RouteSession:
        """Blacklist the culprits, re-plan and open a new session; raises NoRouteError if none is left."""
        if len(self.events) >= self.max_failovers:
            raise RouteError(f"giving up after {len(self.events)} failovers; last error: {error}") from error
        t0 = time.perf_counter()
        hops = self.session.hops if self.session is not None else []
        await self._close_session()
        blamed = await self._blame(error, hops)
        for peer in blamed:
            backoff = self.blacklist.add(peer)
            log.warning("route failed (%s): blacklisting %s for %.0f s", error, peer, backoff)
        new_hops = await self._plan()
        await self._open(new_hops)
        event = FailoverEvent(str(error), blamed, time.perf_counter() - t0, [h.peer_id for h in new_hops])
        self.events.append(event)
        log.warning("failover %d: new route %s in %.2f s", len(self.events), event.new_route, event.seconds)
        assert self.session is not None
        return self.session


@asynccontextmanager
async def open_route_keeper(
    node: P2PNode, legs: ReturnLegs, *, hops: list[Hop] | None = None, **options: Any
) -> AsyncIterator[RouteKeeper]:
    """A `RouteKeeper` (options as its constructor's) with a session open on `hops` (else on a fresh plan) for the block.

    The keeper's nursery holds its sessions' watchers; an error inside the block comes out as
    itself, not wrapped in an exception group.
    """
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        keeper = RouteKeeper(node, legs, nursery, **options)
        try:
            await keeper._open(hops or await keeper._plan())
            try:
                yield keeper
            finally:
                await keeper._close_session()
        except Exception as exc:  # re-raised below, once the nursery is closed
            failure = exc
    if failure is not None:
        raise failure
