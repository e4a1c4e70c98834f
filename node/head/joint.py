"""Calls from many threads run as one: how a serving head batches the work its generations share.

A CPU forward over a few dozen rows costs little more than over one (a forward reads every weight once), so a head
serving many generations runs their draft forwards, their lm_head rows, and the windows of the layers it serves itself
(`--blocks`) as joint calls. `Joiner.call(item)`
blocks the calling thread until `run` has processed its item: whichever caller finds no run under way runs
everything queued at that moment, up to `budget` (by `size`), oldest first, and hands each caller its result; calls
made meanwhile queue for the next run. No timer: a lone caller runs at once, and under load runs grow by themselves
(continuous batching, as the block server's `Batcher` does for windows). It works from any thread (trio's worker
threads included): callers wait on a `threading.Condition`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from threading import Condition
from typing import Any, Generic, TypeVar

import torch

from dsd.shard_store import SpanModule, SpanWindow

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class JoinStats:
    """What the joint runs did: runs, calls, and how many calls each run held."""

    runs: int = 0
    calls: int = 0
    calls_per_run: dict[int, int] = field(default_factory=dict)  # calls in a run -> runs


@dataclass
class _Call(Generic[T, R]):
    item: T
    result: R | None = None
    error: BaseException | None = None
    done: bool = False


class Joiner(Generic[T, R]):
    """Runs `run(items) -> results` (one result per item, in order) over the items of concurrent `call`s."""

    def __init__(self, run: Callable[[list[T]], Sequence[R]], *, budget: int, size: Callable[[T], int] = lambda _: 1
                 ) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        self._run = run
        self.budget = budget
        self._size = size
        self.stats = JoinStats()
        self._cond = Condition()
        self._queue: deque[_Call[T, R]] = deque()
        self._running = False

    @property
    def queued(self) -> int:
        """Calls waiting for a run."""
        return len(self._queue)

    def call(self, item: T) -> R:
        """`item`'s result, from a run that may hold other callers' items; its exception if that run failed."""
        me: _Call[T, R] = _Call(item)
        with self._cond:
            self._queue.append(me)
            while not me.done and self._running:
                self._cond.wait()
            batch = None
            if not me.done:
                self._running = True
                batch = self._take()
        if batch is not None:
            try:
                self._process(batch)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
        if me.error is not None:
            raise me.error
        return me.result  # type: ignore[return-value]

    def _take(self) -> list[_Call[T, R]]:
        """The oldest queued calls within the budget (always at least one). Under the lock."""
        batch = [self._queue.popleft()]
        used = self._size(batch[0].item)
        while self._queue and used + self._size(self._queue[0].item) <= self.budget:
            used += self._size(self._queue[0].item)
            batch.append(self._queue.popleft())
        return batch

    def _process(self, batch: list[_Call[T, R]]) -> None:
        try:
            results = self._run([c.item for c in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"a joint run returned {len(results)} results for {len(batch)} calls")
            for c, r in zip(batch, results, strict=True):
                c.result = r
        except BaseException as exc:  # every caller in the run sees it
            for c in batch:
                c.error = exc
        finally:
            with self._cond:
                for c in batch:
                    c.done = True
                s = self.stats
                s.runs += 1
                s.calls += len(batch)
                s.calls_per_run[len(batch)] = s.calls_per_run.get(len(batch), 0) + 1


MAX_HEAD_ROWS = 512  # rows per joint lm_head call


class JointHead:
    """A head module whose final norm and lm_head run over the rows of every generation waiting on them in one call
    (`serve --head-batching`): the lm_head reads its whole vocabulary matrix per call, however few rows it is given.
    Everything else is the wrapped head's, as it is."""

    def __init__(self, head: Any, max_rows: int = MAX_HEAD_ROWS) -> None:
        self._head = head
        self.joiner: Joiner[torch.Tensor, torch.Tensor] = Joiner(self._run, budget=max_rows,
                                                                 size=lambda h: h.shape[0] * h.shape[1])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """As `HeadModule.logits` ([b, t, h] -> [b, t, V]), computed with other generations' rows."""
        if hidden.dim() != 3 or hidden.shape[-1] != self._head.hidden_size:  # its own error, before joining
            return self._head.logits(hidden)
        return self.joiner.call(hidden)

    def _run(self, items: list[torch.Tensor]) -> list[torch.Tensor]:
        rows = torch.cat([h.reshape(-1, h.shape[-1]).to(self._head.device) for h in items])
        with torch.inference_mode():
            logits = self._head.logits(rows.unsqueeze(0))[0]
        parts = torch.split(logits, [h.shape[0] * h.shape[1] for h in items])
        return [part.reshape(h.shape[0], h.shape[1], -1) for part, h in zip(parts, items, strict=True)]


MAX_SPAN_ROWS = 256  # window rows per joint step of the head's own span


class JointSpan:
    """The span a serving head serves itself (`--blocks`) whose windows, from every generation waiting on it, run as
    one step (`SpanModule.step_each`: projections and MLPs over the stacked rows, attention per generation against its
    own KV cache; one window its cache refuses fails only its own generation). Everything else is the wrapped span's."""

    def __init__(self, span: SpanModule, max_rows: int = MAX_SPAN_ROWS) -> None:
        self._span = span
        self.joiner: Joiner[SpanWindow, torch.Tensor | Exception] = Joiner(
            span.step_each, budget=max_rows, size=lambda w: int(w.hidden.shape[1]))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._span, name)

    def step(self, hidden: torch.Tensor, start_pos: int, cache: Any, *, commit: int | None = None,
             parents: Any = None, keep: Any = None) -> torch.Tensor:
        """As `SpanModule.step`, computed with other generations' windows."""
        out = self.joiner.call(SpanWindow(hidden, start_pos, cache, commit, parents, keep))
        if isinstance(out, Exception):
            raise out
        return out
