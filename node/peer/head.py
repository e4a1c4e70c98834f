"""Generating as a head: once from a fresh head process (join, generate, leave), or many times from a
head node that stays in the swarm (`generate_on`: `dsd-node serve`).

Shared by `dsd-node generate`, the demo and the service. Failures come back as one
`GenerationFailed` (never an exception group), carrying the tokens generated so far;
`generate_text` raises it outside the node's nursery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import NoRouteError, remote_blocks
from dsd.node.federated.generate import generate_federated_over_swarm
from dsd.node.federated.pool import FederatedError
from dsd.node.head.engine import GenerationConfig
from dsd.node.head.setup import HeadSetup
from dsd.node.route.errors import RouteError
from dsd.node.route.generate import GenerationFailed, generate_once
from dsd.node.route.legs import ReturnLegs
from dsd.protocol import Hop
from dsd.shard_store import SpanModule, Store, StoreError

from .config import parse_blocks
from .host import head_node
from .shaper import LinkProfile


def load_head_span(
    store: Store, blocks: str, *, device: torch.device | None = None, dtype: torch.dtype | None = None
) -> SpanModule:
    """The layers `generate --blocks A:B` names, from the head's own store (on `device` in `dtype`, like the
    head): the model's first layers (0:B) or its last ones (A:L), never every layer; ValueError naming the
    problem otherwise."""
    if blocks == "auto":
        raise ValueError("--blocks of a head takes START:END (the first or the last layers of the model), not auto")
    a, b = parse_blocks(blocks, store.num_layers)
    remote_blocks((a, b), store.num_layers)
    try:
        return store.load_span(a, b, device=device, dtype=dtype)
    except StoreError as exc:
        raise ValueError(f"--blocks {blocks}: the head serves those layers from its --store, which lacks them: {exc}") from exc


async def generate_text(
    bootstrap: list[str],
    link: LinkProfile,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    seed: int | None = None,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    federated: dict[str, Any] | None = None,
    local_span: SpanModule | None = None,
) -> dict:
    """Generate once from a fresh head node; `federated` (options of `generate_federated_over_swarm`)
    switches from a route of block peers to federated workers. Returns the `--json` report."""
    failure: GenerationFailed | None = None
    async with head_node(bootstrap, link, seed=seed) as (node, legs):
        try:
            return await generate_on(node, legs, setup, prompt, cfg, tokenizer=tokenizer, on_tokens=on_tokens,
                                     federated=federated, local_span=local_span)
        except GenerationFailed as exc:
            failure = exc
    raise failure


async def generate_on(
    node: P2PNode,
    legs: ReturnLegs,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    hops: list[Hop] | None = None,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    federated: dict[str, Any] | None = None,
    local_span: SpanModule | None = None,
) -> dict:
    """Generate once from a head node already in the swarm, over `hops` (else a fresh plan) or federated
    workers; returns the `--json` report. No route, a route that failed for good and failed workers all
    come out as `GenerationFailed` (its `cause` tells which). `local_span` (the model's first or last
    layers, not with `federated`) is served by the head itself; the route covers the other layers."""
    try:
        if federated is not None:
            return await generate_federated_over_swarm(
                node, setup, prompt, cfg, tokenizer=tokenizer, on_tokens=on_tokens, **federated
            )
        return await generate_once(node, legs, setup, prompt, cfg, hops=hops, on_tokens=on_tokens, tokenizer=tokenizer,
                                   local_span=local_span)
    except (NoRouteError, RouteError, FederatedError) as exc:
        raise GenerationFailed(exc, [], {}) from exc
