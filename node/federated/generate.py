"""One federated generation: open the workers, run the head engine over them, report."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from dsd.discovery.host import P2PNode
from dsd.node.head.engine import Drafter, GenerationConfig, HeadEngine
from dsd.node.head.setup import HeadSetup

from .backend import DEFAULT_TOPK, open_federated_backend
from .pool import FederatedError, WorkerInfo, find_workers

log = logging.getLogger(__name__)


async def generate_federated(
    node: P2PNode,
    workers: Sequence[WorkerInfo],
    drafter: Drafter | None,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    vocab_size: int,
    top_k: int | None = DEFAULT_TOPK,
    weights: Sequence[float] | None = None,
    method: str = "residual",
    window_timeout_s: float = 60.0,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
) -> dict[str, Any]:
    """One federated generation: open the workers, run the head engine over them, return the `--json` report."""
    max_len = len(prompt) + cfg.max_new_tokens + cfg.max_window_nodes + 2  # a tree window's nodes all take KV rows
    async with open_federated_backend(
        node, workers, vocab_size=vocab_size, params=cfg.params, max_len=max_len, top_k=top_k, weights=weights,
        method=method, window_timeout_s=window_timeout_s, deadline=cfg.deadline,
    ) as backend:
        result = await HeadEngine(backend, drafter, cfg, tokenizer).generate(prompt, on_tokens=on_tokens)
    report = result.as_dict()
    report.update(backend.report())
    n = max(1, len(result.tokens))
    report["uplink_bytes_per_token"] = round(report["bytes_received"] / n, 2)
    return report


async def generate_federated_over_swarm(
    node: P2PNode,
    setup: HeadSetup,
    prompt: Sequence[int],
    cfg: GenerationConfig,
    *,
    peer_ids: Sequence[str] | None = None,
    tokenizer: Any = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Find the workers of the setup's vocabulary (or the named ones) and generate over them."""
    workers = await find_workers(node, setup.vocab_size, peer_ids=peer_ids)
    if not workers:
        raise FederatedError(f"no live federated worker with a vocabulary of {setup.vocab_size} tokens")
    return await generate_federated(node, workers, setup.drafter, prompt, cfg, vocab_size=setup.vocab_size,
                                    tokenizer=tokenizer, on_tokens=on_tokens, **options)
