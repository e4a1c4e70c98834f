"""One generation over the swarm: plan a route, open a session, run the head engine, report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsd.discovery.host import P2PNode
from dsd.protocol import Hop
from dsd.shard_store import HeadModule

from .backends import RouteBackend
from .client import ReturnLegs, RouteSession
from .head import Drafter, GenerationConfig, HeadEngine
from .routing import survey
from .settings import WireFormat

log = logging.getLogger(__name__)


@dataclass
class HeadSetup:
    """What the head holds locally: the target's ends and a drafter."""

    head: HeadModule
    model_id: str
    num_layers: int
    drafter: Drafter | None


def plan_hops(plan) -> list[Hop]:
    """The planner's hops as protocol hops (peer, addresses, the span each serves for us)."""
    return list(plan.protocol_hops())


async def generate_once(
    node: P2PNode,
    legs: ReturnLegs,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    hops: list[Hop] | None = None,
    wire: WireFormat | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> dict:
    """Generate once; returns the `--json` report (without text)."""
    if hops is None:
        view = await survey(node, setup.model_id, setup.num_layers)
        if view.plan is None:
            assert view.error is not None
            raise view.error
        hops = plan_hops(view.plan)
    max_len = len(prompt) + cfg.max_new_tokens + cfg.gamma_max + 2
    async with RouteSession(node, legs, hops, model=setup.model_id, max_len=max_len, wire=wire) as session:
        backend = RouteBackend(setup.head, session, timeout_s=cfg.result_timeout_s)
        engine = HeadEngine(backend, setup.drafter, cfg)
        result = await engine.generate(prompt, on_tokens=on_tokens)
        report = result.as_dict()
        report.update(
            route=[h.peer_id for h in hops],
            spans=[[h.start, h.end] for h in hops],
            bytes_sent=session.traffic.sent,
            bytes_received=session.traffic.received,
            head_compute_s=round(backend.head_compute_s, 4),
        )
    return report
