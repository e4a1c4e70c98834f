"""One generation as a head process: join the swarm, generate over a route or federated workers, leave.

Shared by `dsd-node generate` and the demo. Failures come back as one
`GenerationFailed` raised outside the node's nursery (never an exception group),
carrying the tokens generated so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from dsd.discovery.planner import NoRouteError
from dsd.node.federated.generate import generate_federated_over_swarm
from dsd.node.federated.pool import FederatedError
from dsd.node.head.engine import GenerationConfig
from dsd.node.head.setup import HeadSetup
from dsd.node.route.errors import RouteError
from dsd.node.route.generate import GenerationFailed, generate_once

from .host import head_node
from .shaper import LinkProfile


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
) -> dict:
    """Generate once from a fresh head node; `federated` (options of `generate_federated_over_swarm`)
    switches from a route of block peers to federated workers. Returns the `--json` report."""
    failure: GenerationFailed | None = None
    async with head_node(bootstrap, link, seed=seed) as (node, legs):
        try:
            if federated is not None:
                return await generate_federated_over_swarm(
                    node, setup, prompt, cfg, tokenizer=tokenizer, on_tokens=on_tokens, **federated
                )
            return await generate_once(node, legs, setup, prompt, cfg, on_tokens=on_tokens, tokenizer=tokenizer)
        except GenerationFailed as exc:
            failure = exc
        except (NoRouteError, RouteError, FederatedError) as exc:
            failure = GenerationFailed(exc, [], {})
    raise failure
