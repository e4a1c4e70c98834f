"""Opening a route for one generation: plan it (or take the hops given), open its first session, hand it over.

`open_route` yields the engine's backend; `open_route_client` yields the client alone, for callers that
build a backend of their own or drive sessions by hand (tests, benchmarks).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from dsd.discovery.host import P2PNode
from dsd.discovery.swarm import SwarmWatch
from dsd.discovery.tasks import owned_nursery
from dsd.protocol import Hop, WireFormat
from dsd.protocol.deadlines import DeadlineRule
from dsd.protocol.route_state import RouteFailure, RouteState
from dsd.shard_store import HeadModule, SpanModule
from dsd.shard_store.dtypes import dtype_name

from .audit import AuditLedger, Auditor
from .backend import RouteBackend
from .client import RouteClient, plan_prior
from .errors import RouteGaveOut
from .legs import ReturnLegs

log = logging.getLogger(__name__)



@asynccontextmanager
async def open_route_client(
    node: P2PNode, legs: ReturnLegs, swarm: SwarmWatch, *, max_len: int, hops: Sequence[Hop] | None = None,
    wire: WireFormat | None = None, rule: DeadlineRule | None = None, avoid: frozenset[str] = frozenset(),
    **state_options: Any,
) -> AsyncIterator[RouteClient]:
    """A `RouteClient` with its first session open on `hops`, else on a plan of `swarm` that leaves out `avoid`
    (later failovers may use them), waiting up to the rule's `hole_wait_s` for missing blocks to be served (records lag
    behind a peer that just started; a peer that left leaves a hole until another takes its blocks), as failovers do.
    `state_options` go to `RouteState`. Raises `RouteGaveOut` (verdict no_route) when no route exists; an error inside the
    block comes out as itself, not wrapped in an exception group."""
    hole_wait_s = (rule or DeadlineRule()).hole_wait_s
    async with owned_nursery() as nursery:
        if hops is None:
            view = await swarm.plan(avoid, wait_s=hole_wait_s)
            if view.plan is None:
                assert view.error is not None
                waited = f" (after waiting {hole_wait_s:.0f} s for peers to serve them)" if hole_wait_s > 0 else ""
                raise RouteGaveOut(RouteFailure("no_route", f"{view.error}{waited}",
                                                missing_blocks=list(view.error.missing_blocks)))
            hops, prior = list(view.plan.protocol_hops()), plan_prior(view.plan)
            rtts = {pid: rtt for pid, rtt in view.rtts.items() if rtt is not None}
        else:
            prior, rtts = None, {}
        state = RouteState(hops, rule=rule, prior=prior, rtts=rtts, **state_options)
        client = RouteClient(node, legs, swarm, nursery, state, max_len=max_len, wire=wire)
        await client.open(hops, prior)
        try:
            yield client
        finally:
            await client.close()


@asynccontextmanager
async def open_route(
    node: P2PNode, legs: ReturnLegs, swarm: SwarmWatch, head: HeadModule, *, max_len: int,
    hops: Sequence[Hop] | None = None, local: SpanModule | None = None, timeout_s: float = 300.0,
    rule: DeadlineRule | None = None, audits: AuditLedger | None = None, wire: WireFormat | None = None,
    **options: Any,
) -> AsyncIterator[RouteBackend]:
    """The engine's backend over a route of `swarm` (or `hops`): hidden states in the head's compute dtype on the
    wire (exact; half the bytes in bf16/fp16) unless `wire` names another codec, `local` the layers the head
    serves itself (the route covers the others, as `swarm.blocks` says); windows audited as `audits.options` say
    (`audit.Auditor`), counted there. Options as `open_route_client`'s."""
    wire = (wire or WireFormat("auto")).for_dtype(dtype_name(head.dtype))
    async with open_route_client(node, legs, swarm, max_len=max_len, hops=hops, wire=wire, rule=rule,
                                 **options) as client:
        if audits is None or audits.options.rate <= 0.0:
            yield RouteBackend(head, client, timeout_s=timeout_s, local=local, audits=audits)
            return
        first = local if local is not None and local.start == 0 else None
        auditor = Auditor(node, legs, swarm, head, ledger=audits, max_len=max_len, wire=wire, local_first=first,
                          rule=rule)
        async with auditor.running():
            yield RouteBackend(head, client, timeout_s=timeout_s, local=local, auditor=auditor)
