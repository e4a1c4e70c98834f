"""The head engine's target backend over a route of block peers (with failover replay)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import torch
import trio

from dsd.shard_store import HeadModule

from .errors import RouteError
from .keeper import RouteKeeper
from .session import RouteSession

log = logging.getLogger(__name__)


class RouteBackend:
    """DSD over a route of block peers: embed on the head, layers on the peers, logits on the head.

    Only hidden states cross the wire, and the head computes the target logits
    itself, so verification sees exactly the target's distribution. The backend
    remembers every token it has placed in the peers' caches; when a `RouteKeeper`
    replaces a failed route, it replays them into the new peers (in chunks) and
    re-sends the window, so the engine never notices beyond the delay.

    Whatever is sent in chunks (a long prompt, a replay, a window longer than a
    chunk), the result rows of the chunk before the last are kept: a window that
    straddles a chunk boundary still gets all its rows.

    Token trees: a window with `parents` goes out whole (at most 64 nodes), and the
    next one commits its accepted path with `keep`. A replay sends the committed
    tokens as a chain, then the tree window in flight again on the new route.
    """

    supports_trees = True

    def __init__(self, head: HeadModule, keeper: RouteKeeper, *, timeout_s: float = 300.0, replay_chunk: int = 128) -> None:
        self.head = head
        self.keeper = keeper
        self.timeout_s = timeout_s
        self.replay_chunk = replay_chunk
        self._limiter = trio.CapacityLimiter(1)
        self.head_compute_s = 0.0
        self._prefix: list[int] = []  # committed tokens the peers hold before the window in flight
        self._window: list[int] = []  # the window in flight (its nodes in order, for a tree)
        self._parents: list[int] | None = None  # the window's parents when it is a tree
        self._failure: RouteError | None = None
        self._before_last: np.ndarray | None = None  # result rows of the chunk before the last one sent

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

    async def _send(
        self, tokens: Sequence[int], start: int, commit: int | None, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        t0 = time.perf_counter()
        hidden = await trio.to_thread.run_sync(self._embed, tokens, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        await self.session.send_window(hidden, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)

    async def submit(
        self, tokens: Sequence[int], *, start: int, commit: int, epoch: int,
        parents: Sequence[int] | None = None, keep: Sequence[int] | None = None,
    ) -> None:
        """Send a window; a long chain (a prompt) goes in chunks, all but the last awaited here; a tree whole.

        `keep` (after a tree window, with commit = its start) names the accepted nodes, root first."""
        if keep is not None:
            held = self._prefix[:commit] + [self._window[i] for i in keep]
        else:
            held = self._prefix + self._window  # the rows as the peers hold them (a chain's positions)
        self._prefix = held[:start]
        self._window = list(tokens)
        self._parents = None if parents is None else list(parents)
        self._failure = None
        try:
            if parents is None:
                await self._send_chunks(tokens, start, commit, epoch, keep)
            else:
                self._before_last = None
                await self._send(tokens, start, commit, epoch, parents, keep)
        except RouteError as exc:
            self._failure = exc  # handled in collect(): fail over, replay everything, re-send the window

    async def _send_chunks(
        self, tokens: Sequence[int], start: int, commit: int, epoch: int, keep: Sequence[int] | None = None
    ) -> None:
        """Send `tokens` at positions start.. in chunks of `replay_chunk`, awaiting every result but the last's.

        The rows of the chunk before the last are kept: with them, the last `rows` positions are at
        hand for any window of up to `replay_chunk` + 1 tokens, wherever the chunk boundaries fall.
        `keep` goes with the first chunk (it commits the last tree window's path before it).
        """
        self._before_last = None
        at = start
        while len(tokens) - (at - start) > self.replay_chunk:
            first = at == start
            await self._send(tokens[at - start : at - start + self.replay_chunk], at, commit if first else at, epoch,
                             keep=keep if first else None)
            _, self._before_last = await self.session.receive_result(epoch=epoch, timeout=self.timeout_s)
            at += self.replay_chunk
        first = at == start
        await self._send(tokens[at - start :], at, commit if first else at, epoch, keep=keep if first else None)

    async def _replay(self, epoch: int) -> None:
        """On a new route: every committed token as a chain, then the window in flight (a tree whole, last)."""
        if self._parents is None:
            await self._send_chunks(self._prefix + self._window, 0, 0, epoch)
            return
        start = len(self._prefix)
        if start:
            await self._send_chunks(self._prefix, 0, 0, epoch)
            await self.session.receive_result(epoch=epoch, timeout=self.timeout_s)
        self._before_last = None
        await self._send(self._window, start, start, epoch, self._parents)

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
                await self._replay(epoch)  # replay every committed token, the window last
            except RouteError as exc:
                self._failure = exc
        if len(hidden) < rows and self._before_last is not None:
            hidden = np.concatenate([self._before_last, hidden])
        if len(hidden) < rows:
            raise ValueError(f"{rows} rows asked of a window sent in chunks of {self.replay_chunk} (at most chunk + 1)")
        t0 = time.perf_counter()
        logits = await trio.to_thread.run_sync(self._logits, hidden, rows, limiter=self._limiter)
        self.head_compute_s += time.perf_counter() - t0
        return logits
