"""A test head over a swarm: its view of the swarm, one generation over a route, and backends that misbehave
on purpose (a killed hop before the first tree window; probabilities instead of logits)."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import torch

from dsd.node.head.backend import Capabilities
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams, warp
from dsd.node.route.backend import RouteBackend


def swarm_of(node, model: str, num_layers: int, blocks: tuple[int, int] | None = None):
    """The test head's view of the swarm (one per head, as in a head process): what its routes plan failovers on."""
    from dsd.discovery.swarm import SwarmWatch

    return SwarmWatch(node, model, num_layers, blocks=blocks)


async def generate_on(node, legs, setup, prompt: list[int], cfg, *, hops=None, local_span=None, tokenizer=None,
                      wire=None):
    """One generation from a test head already in the swarm over a route (`hops`, else planned), the head serving
    `local_span` itself and sending hidden states as `wire` says: a `GenerationReport` (`GenerationFailed` comes
    out as itself)."""
    from dsd.node.peer.generation import RouteTarget, generate_over_swarm, swarm_watch

    target = RouteTarget(hops=hops, local=local_span, wire=wire)
    return await generate_over_swarm(node, legs, swarm_watch(node, setup, target.local_blocks), setup, prompt, cfg,
                                     target=target, tokenizer=tokenizer)


class KillOnTree(RouteBackend):
    """A route backend that kills the route's last hop (SIGKILL, by `pids[peer_id]`) just before the first
    tree window goes out, and notes whether the tree was replayed on the new route."""

    def __init__(self, *args, pids: dict[str, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pids = pids
        self.killed: str | None = None
        self.replayed_tree = False

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
                     parents: Sequence[int] | None = None, keep: Sequence[int] | None = None) -> None:
        if parents is not None and self.killed is None:
            self.killed = self.session.hops[-1].peer_id
            os.kill(self.pids[self.killed], signal.SIGKILL)
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)

    async def _replay(self, epoch: int) -> None:
        self.replayed_tree = self.replayed_tree or self._parents is not None
        await super()._replay(epoch)


class ProbsBackend(LocalBackend):
    """The whole model in-process, answering with warped probabilities as a federated worker would."""

    capabilities = Capabilities(trees=True, pipeline=True, probs=True)

    def __init__(self, head, spans, temperature: float) -> None:
        super().__init__(head, spans)
        self.temperature = temperature

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        logits = await super().collect(epoch=epoch, rows=rows)
        return warp(logits, SamplingParams(temperature=self.temperature or 1.0))
