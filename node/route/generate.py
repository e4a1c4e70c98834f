"""One generation over the swarm: plan a route, open a session, run the head engine, report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import NoRouteError, remote_blocks
from dsd.node.head.engine import GenerationConfig, HeadEngine
from dsd.node.head.setup import HeadSetup
from dsd.protocol import Hop, WireFormat
from dsd.shard_store import SpanModule
from dsd.shard_store.dtypes import dtype_name

from .backend import RouteBackend
from .errors import RouteError
from .keeper import Blacklist, open_route_keeper
from .legs import ReturnLegs

log = logging.getLogger(__name__)


def plan_hops(plan) -> list[Hop]:
    """The planner's hops as protocol hops (peer, addresses, the span each serves for us)."""
    return list(plan.protocol_hops())


def ring_hops(hops: Iterable[Any], head_peer_id: str, local: tuple[int, int] | None) -> list[dict[str, Any]]:
    """Every hop of the ring in order, as {peer_id, start, end, local}: the route's hops (anything with
    those attributes) and the head's own span `local` (the model's first layers or its last), if any."""
    out = [{"peer_id": h.peer_id, "start": h.start, "end": h.end, "local": False} for h in hops]
    if local is not None:
        mine = {"peer_id": head_peer_id, "start": local[0], "end": local[1], "local": True}
        out.insert(0 if local[0] == 0 else len(out), mine)
    return out


class GenerationFailed(Exception):
    """Generation stopped (no route left, too many failovers); `tokens` holds what was generated."""

    def __init__(self, cause: Exception, tokens: list[int], report: dict) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.tokens = tokens
        self.report = report


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
    tokenizer=None,
    blacklist: Blacklist | None = None,
    local_span: SpanModule | None = None,
) -> dict:
    """Generate once over a planned route (failing over when a peer fails); returns the `--json` report.

    `local_span`: layers the head serves itself (the model's first or last ones); the route covers the rest.
    The report's `route` and `spans` name the block peers; `hops` is the whole ring, the head's own span
    marked `local`.
    """
    max_len = len(prompt) + cfg.max_new_tokens + cfg.max_window_nodes + 2  # a tree window's nodes all take KV rows
    if wire is None and setup.head is not None:  # the head's compute dtype, carried exactly (half the bytes in bf16/fp16)
        wire = WireFormat("auto").for_dtype(dtype_name(setup.head.dtype))
    local = None if local_span is None else (local_span.start, local_span.end)
    blocks = None if local is None else remote_blocks(local, setup.num_layers)
    async with open_route_keeper(
        node, legs, hops=hops, model=setup.model_id, num_layers=setup.num_layers, max_len=max_len, wire=wire,
        blacklist=blacklist, deadline=cfg.deadline, blocks=blocks,
    ) as keeper:
        backend = RouteBackend(setup.head, keeper, timeout_s=cfg.result_timeout_s, local=local_span)
        engine = HeadEngine(backend, setup.drafter, cfg, tokenizer=tokenizer)

        def traffic() -> dict:
            s = keeper.session
            return {
                "route": [h.peer_id for h in s.hops] if s else [],
                "spans": [[h.start, h.end] for h in s.hops] if s else [],
                "hops": ring_hops(s.hops, node.peer_id, local) if s else [],
                "bytes_sent": keeper.bytes_sent,
                "bytes_received": keeper.bytes_received,
                "head_compute_s": round(backend.head_compute_s, 4),
                "failovers": len(keeper.events),
                "failover_s": [round(e.seconds, 3) for e in keeper.events],
                "failover_blamed": [e.blamed for e in keeper.events],
            }

        try:
            result = await engine.generate(prompt, on_tokens=on_tokens)
        except (RouteError, NoRouteError) as exc:
            raise GenerationFailed(exc, list(engine.progress), traffic()) from exc
        report = result.as_dict()
        report.update(traffic())
    return report
