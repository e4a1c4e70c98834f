"""The probes that find the hop at fault when a route goes quiet or slow (when to run them, and what their
answers mean: `dsd.protocol.route_state`).

With the ring the head only sees that a result did not come back, or came back late. Two probes
find the hop:

- `ping_hops`: a short ping to every hop at once. A frozen process (stopped, swapping, asleep), a
  partitioned link or a dead connection that never reset does not answer; healthy hops do.
- `time_prefixes`: when every hop answers pings but the route is stuck or slow, a trial session on
  each prefix h1..hi of the route (the last hop of the prefix returns to the head), one window of
  the route's size through each, all in parallel. The first prefix without a result within the
  limit ends at the silent hop (`first_silent`); the hop whose prefix adds the most time is the
  slow one (`slowest_hop`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np
import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.ping import measure_rtt
from dsd.protocol import Hop, WireFormat
from dsd.protocol.route_state import short

from .errors import RouteError
from .legs import ReturnLegs
from .session import RouteSession

log = logging.getLogger(__name__)


async def ping_hops(node: P2PNode, hops: Sequence[Hop], timeouts: Mapping[str, float]) -> list[str]:
    """The distinct peers of `hops` (in route order) that do not answer one ping within their timeout, over the open
    connection nor, when that was QUIC, over a new one dialled after hanging it up."""
    peers = {h.peer_id: h for h in hops}
    silent: set[str] = set()

    async def one(hop: Hop) -> None:
        timeout = timeouts.get(hop.peer_id, 3.0)
        # Over QUIC the path can die while the peer and its TCP port live (UDP blackholed, a NAT that forgot the
        # mapping); over TCP a silent connection is a silent peer (a frozen one would cost a second timeout).
        over_quic = node.transport_to(hop.peer_id) == "quic"
        try:
            await measure_rtt(node, hop.peer_id, hop.addrs, samples=1, timeout=timeout)
            return
        except Exception as exc:  # timeout, reset, refused
            log.info("hop %s did not answer a ping: %r", short(hop.peer_id), exc)
        if over_quic:  # the QUIC connection may be what died: dial afresh once, TCP first
            await node.hang_up(hop.peer_id)
            try:
                await measure_rtt(node, hop.peer_id, hop.addrs, samples=1, timeout=timeout)
                log.warning("hop %s answers on a new connection (%s): the old one had died", short(hop.peer_id),
                            node.transport_to(hop.peer_id))
                return
            except Exception as exc:
                log.info("hop %s did not answer on a new connection either: %r", short(hop.peer_id), exc)
        silent.add(hop.peer_id)

    async with trio.open_nursery() as nursery:
        for hop in peers.values():
            nursery.start_soon(one, hop)
    return [p for p in peers if p in silent]


async def time_prefixes(
    node: P2PNode,
    legs: ReturnLegs,
    hops: Sequence[Hop],
    *,
    model: str,
    hidden_size: int,
    tokens: int,
    limit_s: float,
    wire: WireFormat | None = None,
) -> list[float | None]:
    """Seconds one window of `tokens` random hidden states takes through each prefix h1..hi of the route,
    each on a trial session of its own, all at once; None where no result came within `limit_s`."""
    times: list[float | None] = [None] * len(hops)
    hidden = np.random.default_rng(0).standard_normal((max(1, tokens), hidden_size)).astype(np.float32)

    async def one(i: int) -> None:
        session = RouteSession(node, legs, hops[: i + 1], model=model, max_len=len(hidden) + 1, wire=wire,
                               open_timeout_s=limit_s)
        async with trio.open_nursery() as nursery:
            opened = False
            with trio.move_on_after(2 * limit_s):
                try:
                    await session.open(nursery)
                    opened = True
                    t0 = trio.current_time()
                    await session.forward(hidden, start=0, commit=0, timeout=limit_s)
                    times[i] = trio.current_time() - t0
                except RouteError as exc:
                    log.info("trial window through %d hop(s) failed: %s", i + 1, exc)
            if opened:
                with trio.move_on_after(1.0):
                    await session.close()
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for i in range(len(hops)):
            nursery.start_soon(one, i)
    log.info("trial windows through the route's prefixes: %s",
             ", ".join("-" if t is None else f"{t * 1000:.0f} ms" for t in times))
    return times
