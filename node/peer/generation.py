"""Generating as a head: from a head node already in the swarm (`generate_over_swarm`: `dsd-node serve`, the demo,
the benchmarks) or from a fresh head process that joins, generates and leaves (`generate_from_fresh_head`:
`dsd-node generate`).

Here the target is opened — a route of block peers (`RouteTarget`) or federated workers (`FederatedTarget`) —
and handed to `dsd.node.head.generation.generate`, the one function that runs a generation. Every failure
comes out as one `GenerationFailed` (never an exception group) carrying the tokens made so far and why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import remote_blocks
from dsd.discovery.swarm import SwarmWatch
from dsd.node.federated.open import open_federated
from dsd.node.head.backend import BackendError, TargetBackend
from dsd.node.head.config import GenerationConfig
from dsd.node.head.generation import generate
from dsd.node.head.logprobs import TokenLogprob
from dsd.node.head.report import GenerationFailed, GenerationReport, GenerationResult
from dsd.node.head.setup import HeadSetup
from dsd.node.head.streaming import RepairGuard
from dsd.node.route.audit import AuditFailure, AuditLedger, AuditOptions
from dsd.node.route.legs import ReturnLegs
from dsd.node.route.open import open_route
from dsd.protocol import Hop, WireFormat
from dsd.shard_store import SpanModule, Store, StoreError
from dsd.shard_store.devices import Placement

from .config import parse_blocks
from .host import head_node
from .shaper import LinkProfile

log = logging.getLogger(__name__)

MAX_REPAIRS = 3  # regenerations after audits caught liars, before a generation gives up


@dataclass(frozen=True)
class RouteTarget:
    """The target on a route of block peers: `hops` (else planned from the swarm), the head serving `local` itself,
    putting hidden states on the wire as `wire` says (None: its compute dtype's codec, exact)."""

    hops: Sequence[Hop] | None = None
    local: SpanModule | None = None
    wire: WireFormat | None = None
    weights: str | None = None  # the planned route's weight format (None: the cheapest format's; "any": mixed)

    @property
    def local_blocks(self) -> tuple[int, int] | None:
        return None if self.local is None else (self.local.start, self.local.end)


@dataclass(frozen=True)
class FederatedTarget:
    """The target as federated workers: every live one of the vocabulary, or those `peer_ids` names."""

    peer_ids: Sequence[str] | None = None
    top_k: int | None = 64
    weights: Sequence[float] | None = None
    method: str = "residual"
    window_timeout_s: float = 60.0


Target = RouteTarget | FederatedTarget


def load_head_span(store: Store, blocks: str, placement: Placement | None = None) -> SpanModule:
    """The layers `generate --blocks A:B` names, from the head's own store (where and as `placement` says, like the
    head, in its weight format): the model's first layers (0:B) or its last ones (A:L), never every layer;
    ValueError naming the problem otherwise."""
    if blocks == "auto":
        raise ValueError("--blocks of a head takes START:END (the first or the last layers of the model), not auto")
    a, b = parse_blocks(blocks, store.num_layers)
    remote_blocks((a, b), store.num_layers)
    try:
        if placement is None:
            return store.load_span(a, b)
        weights = placement.weights if placement.quantized else None
        return store.load_span(a, b, device=placement.device, dtype=placement.dtype, weights=weights)
    except StoreError as exc:
        raise ValueError(f"--blocks {blocks}: the head serves those layers from its --store, which lacks them: {exc}") from exc


def swarm_watch(node: P2PNode, setup: HeadSetup, local_blocks: tuple[int, int] | None = None, **options: Any) -> SwarmWatch:
    """The head process's view of the swarm for `setup`'s model: routes over every layer, or over those the head
    does not serve itself (`local_blocks`)."""
    blocks = None if local_blocks is None else remote_blocks(local_blocks, setup.num_layers)
    return SwarmWatch(node, setup.model_id, setup.num_layers, blocks=blocks, **options)


@asynccontextmanager
async def open_target(
    node: P2PNode, legs: ReturnLegs, swarm: SwarmWatch | None, setup: HeadSetup, cfg: GenerationConfig,
    prompt_len: int, target: Target, audits: AuditLedger | None = None,
) -> AsyncIterator[TargetBackend]:
    """The backend of `target`, open for a generation of `cfg` after a prompt of `prompt_len` tokens (a route's
    windows audited as `audits` says)."""
    max_len = cfg.session_len(prompt_len)
    if isinstance(target, FederatedTarget):
        async with open_federated(
            node, vocab_size=setup.vocab_size, peer_ids=target.peer_ids, params=cfg.params, max_len=max_len,
            top_k=target.top_k, weights=target.weights, method=target.method,
            window_timeout_s=target.window_timeout_s, deadline=cfg.deadline,
        ) as backend:
            yield backend
        return
    assert swarm is not None and setup.head is not None, "a route needs the swarm's view and the target's ends"
    async with open_route(node, legs, swarm, setup.head, max_len=max_len, hops=target.hops, local=target.local,
                          timeout_s=cfg.result_timeout_s, rule=cfg.deadline, audits=audits, wire=target.wire) as backend:
        yield backend


async def generate_over_swarm(
    node: P2PNode,
    legs: ReturnLegs,
    swarm: SwarmWatch | None,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    target: Target | None = None,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    audit: AuditOptions | None = None,
) -> GenerationReport:
    """Generate once from a head node already in the swarm over `target` (default: a route the swarm plans);
    `swarm` is the process's view (None only for federated workers). A route's windows are audited as `audit` says
    (None: not at all); when an audit catches a liar, the generation is redone from the first window it computed,
    without it (at most `MAX_REPAIRS` times). Raises `GenerationFailed` when there is no route or no worker, or
    the target gives out midway."""
    target = target or RouteTarget()
    ledger = AuditLedger(audit) if audit is not None and isinstance(target, RouteTarget) else None
    guard = RepairGuard(on_tokens)
    kept: list[int] = []  # tokens made before the liar's first window, when redoing
    kept_logprobs: list[TokenLogprob] = []  # their logprobs, when the config asks for them
    spent: list[GenerationResult] = []  # the results of attempts a liar spoiled
    for repair in range(MAX_REPAIRS + 1):
        rest = replace(cfg, max_new_tokens=cfg.max_new_tokens - len(kept))
        try:
            try:
                async with open_target(node, legs, swarm, setup, rest, len(prompt) + len(kept), target,
                                       ledger) as backend:
                    report = await generate(backend, setup.drafter, rest, [*prompt, *kept], tokenizer=tokenizer,
                                            on_tokens=guard.push)
            except BackendError as exc:  # the target could not be opened
                raise GenerationFailed(exc.failure, GenerationResult(cfg.mode)) from exc
        except GenerationFailed as exc:
            result = exc.result.continuing(kept, spent, kept_logprobs)
            lie = exc.failure
            if not isinstance(lie, AuditFailure) or lie.verdict == "disputed" or repair == MAX_REPAIRS:
                raise GenerationFailed(exc.failure, result, exc.transport) from exc
            good = max(lie.good - len(prompt), len(kept))
            kept = result.tokens[: min(good, cfg.max_new_tokens - 1)]
            kept_logprobs = result.logprobs[: len(kept)]
            spent.append(exc.result)
            assert ledger is not None
            ledger.repairs.append({"verdict": lie.verdict, "blamed": list(lie.blamed), "from_token": len(kept),
                                   "discarded_tokens": len(result.tokens) - len(kept)})
            log.warning("an audit caught the route lying (%s); generating again from token %d of %d", lie.message,
                        len(kept), len(result.tokens))
            guard.rewind(len(kept))
            target = replace(target, hops=None)  # plan anew, without the banned peer
            continue
        if ledger is not None:
            ledger.shown_wrong_from = guard.wrong_from
        return GenerationReport(report.result.continuing(kept, spent, kept_logprobs), report.transport)
    raise AssertionError("unreachable")


async def generate_from_fresh_head(
    bootstrap: list[str],
    link: LinkProfile,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    seed: int | None = None,
    target: Target | None = None,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    listen: list[str] | None = None,
    audit: AuditOptions | None = None,
) -> GenerationReport:
    """Join the swarm as a new head, generate once (see `generate_over_swarm`), leave. `GenerationFailed` is
    raised outside the node's nursery."""
    failure: GenerationFailed | None = None
    target = target or RouteTarget()
    async with head_node(bootstrap, link, seed=seed, listen=listen) as (node, legs):
        local = target.local_blocks if isinstance(target, RouteTarget) else None
        swarm = None if isinstance(target, FederatedTarget) else swarm_watch(node, setup, local, weights=target.weights)
        try:
            return await generate_over_swarm(node, legs, swarm, setup, prompt, cfg, target=target,
                                             tokenizer=tokenizer, on_tokens=on_tokens, audit=audit)
        except GenerationFailed as exc:
            failure = exc
    raise failure
