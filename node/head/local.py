"""The whole target in this process: the one-machine reference backend."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import torch
import trio

from dsd.shard_store import HeadModule

from .backend import Capabilities, TargetBackend

log = logging.getLogger(__name__)


class LocalBackend(TargetBackend):
    """The whole target on this machine (head + every layer in-process): the one-machine reference.

    Used to measure t0 (one peer's compute for a decoding step) and to check the
    engine's logic without a network. Runs token-tree windows as the peers do: the spans
    take `parents`, and `keep` compacts every cache to the accepted path of the last tree.
    Windows may be sent before earlier results are collected (pipelining); their results queue in
    order, and `collect` skips those of an older epoch, as a route does.
    """

    capabilities = Capabilities(trees=True, pipeline=True)

    def __init__(self, head: HeadModule, spans: Sequence) -> None:
        self.head = head
        self.spans = list(spans)
        self.caches = [s.new_cache() for s in self.spans]
        self._pending: deque[tuple[int, torch.Tensor]] = deque()

    @property
    def length(self) -> int:
        return self.caches[0].length

    def _run(
        self, tokens: Sequence[int], start: int, commit: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.head.embed(torch.tensor([list(tokens)], dtype=torch.long))
            for span, cache in zip(self.spans, self.caches, strict=True):
                hidden = span.step(hidden, start, cache, commit=commit, keep=keep,
                                   parents=None if parents is None else list(parents))
            return hidden[0]

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        hidden = await trio.to_thread.run_sync(self._run, tokens, start, commit, parents, keep)
        self._pending.append((epoch, hidden))

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        while self._pending and self._pending[0][0] < epoch:
            self._pending.popleft()
        assert self._pending, "collect() with no window of this epoch submitted"
        hidden = self._pending.popleft()[1]
        with torch.inference_mode():
            return self.head.logits(hidden[-rows:].unsqueeze(0))[0].to("cpu").to(torch.float32)
