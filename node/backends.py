"""Target backends for the head engine: where a window's target logits come from."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
import trio

from dsd.shard_store import HeadModule

from .client import RouteError

if TYPE_CHECKING:
    from .client import RouteSession
    from .failover import RouteKeeper


class RouteBackend:
    """DSD over a route of block peers: embed on the head, layers on the peers, logits on the head.

    Only hidden states cross the wire, and the head computes the target logits
    itself, so verification sees exactly the target's distribution. The backend
    remembers every token it has placed in the peers' caches; when a `RouteKeeper`
    replaces a failed route, it replays them into the new peers (in chunks) and
    re-sends the window, so the engine never notices beyond the delay.
    """

    def __init__(self, head: HeadModule, keeper: RouteKeeper, *, timeout_s: float = 300.0, replay_chunk: int = 128) -> None:
        self.head = head
        self.keeper = keeper
        self.timeout_s = timeout_s
        self.replay_chunk = replay_chunk
        self._limiter = trio.CapacityLimiter(1)
        self.head_compute_s = 0.0
        self._tokens: list[int] = []  # token at each position the peers hold (or are computing)
        self._failure: RouteError | None = None

    @property
    def session(self) -> RouteSession:
        assert self.keeper.session is not None
        return self.keeper.session

    def _embed(self, tokens: Sequence[int]) -> np.ndarray:
        with torch.inference_mode():
            ids = torch.tensor([list(tokens)], dtype=torch.long)
            return self.head.embed(ids)[0].to(torch.float32).numpy()

    def _logits(self, hidden: np.ndarray, rows: int) -> torch.Tensor:
        with torch.inference_mode():
            h = torch.from_numpy(np.ascontiguousarray(hidden[-rows:], dtype=np.float32)).unsqueeze(0)
            return self.head.logits(h)[0].to(torch.float32)

    async def _send(self, tokens: Sequence[int], start: int, commit: int | None, epoch: int) -> None:
        t0 = time.perf_counter()
        hidden = await trio.to_thread.run_sync(self._embed, tokens, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        await self.session.send_window(hidden, start=start, commit=commit, epoch=epoch)

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int) -> None:
        """Send a window; a long one (a prompt) goes in chunks, all but the last awaited here."""
        self._tokens = self._tokens[:start] + list(tokens)
        self._failure = None
        try:
            at = start
            while len(tokens) - (at - start) > self.replay_chunk:
                await self._send(tokens[at - start : at - start + self.replay_chunk], at, at if at > start else commit, epoch)
                await self.session.receive_result(epoch=epoch, timeout=self.timeout_s)
                at += self.replay_chunk
            await self._send(tokens[at - start :], at, at if at > start else commit, epoch)
        except RouteError as exc:
            self._failure = exc  # handled in collect(): fail over, replay everything, re-send the window

    async def _replay(self, epoch: int) -> None:
        """Fill a fresh route's caches with every held token; the last chunk's result is the window's."""
        for at in range(0, len(self._tokens), self.replay_chunk):
            chunk = self._tokens[at : at + self.replay_chunk]
            await self._send(chunk, at, at, epoch)
            if at + len(chunk) < len(self._tokens):
                await self.session.receive_result(epoch=epoch, timeout=self.timeout_s)

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        while True:
            if self._failure is None:
                try:
                    _, hidden = await self.session.receive_result(epoch=epoch, timeout=self.timeout_s)
                    break
                except RouteError as exc:
                    self._failure = exc
            failure, self._failure = self._failure, None
            await self.keeper.replace(failure)
            try:
                await self._replay(epoch)
            except RouteError as exc:
                self._failure = exc
        t0 = time.perf_counter()
        logits = await trio.to_thread.run_sync(self._logits, hidden, rows, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        return logits


class LocalBackend:
    """The whole target on this machine (head + every layer in-process): the one-machine reference.

    Used to measure t0 (one peer's compute for a decoding step) and to check the
    engine's logic without a network.
    """

    def __init__(self, head: HeadModule, spans: Sequence) -> None:
        self.head = head
        self.spans = list(spans)
        self.caches = [s.new_cache() for s in self.spans]
        self._pending: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.caches[0].length

    def _run(self, tokens: Sequence[int], start: int, commit: int) -> torch.Tensor:
        with torch.inference_mode():
            for cache in self.caches:
                cache.truncate(commit)
            if start != self.length:
                raise ValueError(f"window starts at {start} but {self.length} tokens are cached")
            hidden = self.head.embed(torch.tensor([list(tokens)], dtype=torch.long))
            for span, cache in zip(self.spans, self.caches, strict=True):
                hidden = span(hidden, start, cache)
            return hidden[0]

    async def submit(self, tokens: Sequence[int], *, start: int, commit: int, epoch: int) -> None:
        self._pending = await trio.to_thread.run_sync(self._run, tokens, start, commit)

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        assert self._pending is not None, "collect() before submit()"
        hidden, self._pending = self._pending, None
        with torch.inference_mode():
            return self.head.logits(hidden[-rows:].unsqueeze(0))[0].to(torch.float32)
