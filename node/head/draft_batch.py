"""Draft forwards of a serving head's generations run as one: one token tree for all, continuous batching.

Every generation of a `dsd-node serve` head drafts with the same draft model, and a CPU forward over a few dozen
rows costs little more than over one. `JointDrafts` holds ONE token-tree KV cache (`DraftCache`) for all of them:
each generation's contexts are paths in it (identical prefixes share their columns) and a forward feeds the new
tokens of every generation waiting at that moment, each attending only to its own ancestors (the tree's mask).

Batching is continuous and needs no timer: a generation that asks while no forward runs runs its own at once (a lone
generation waits for nothing); requests made while a forward runs queue, and the next forward takes them all, up to
`max_contexts` contexts, oldest first (none waits more than its turn). Whichever asking thread finds the model free
runs that forward (leader and followers on one condition), so it works from any worker thread, trio's or not.

A generation holds a `SessionTree` (what `ModelDrafter` drafts through): its `settle` and `extend` only record which
contexts it may still continue from; the tree drops columns no live generation's contexts reach, inside a forward,
once it holds twice what they need. Batching changes no output: drafts only propose, the target's verification
decides every token (greedy: its argmax; sampling: argmax(log p + G), coupled to the generation's own noise).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .draft_cache import DraftCache

MAX_CONTEXTS = 64  # contexts per joint forward: in steady state each feeds one new token (a prompt feeds all of its)
PRUNE_SLACK = 256  # columns the tree may hold beyond twice what live generations need before it prunes


@dataclass
class _Request:
    """One generation's contexts waiting for a forward, and what came back."""

    session: int
    contexts: list[list[int]]
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class JointStats:
    """What the joint forwards did (for metrics and benchmarks)."""

    forwards: int = 0
    requests: int = 0
    contexts: int = 0
    sessions_per_forward: dict[int, int] = field(default_factory=dict)  # sessions in a forward -> forwards
    prunes: int = 0


class JointDrafts:
    """One draft model's token tree shared by every generation of a head, forwards batched across them."""

    def __init__(self, model: torch.nn.Module, max_contexts: int = MAX_CONTEXTS) -> None:
        if max_contexts < 1:
            raise ValueError(f"max_contexts must be >= 1, got {max_contexts}")
        self.model = model
        self.tree = DraftCache(model)
        self.max_contexts = max_contexts
        self.stats = JointStats()
        self._cond = threading.Condition()
        self._queue: deque[_Request] = deque()
        self._running = False
        self._keep: dict[int, list[list[int]]] = {}  # session -> contexts it may continue from
        self._ids = itertools.count()

    def session(self) -> SessionTree:
        """A new generation's view of the tree (forgotten when the view is)."""
        key = next(self._ids)
        view = SessionTree(self, key)
        weakref.finalize(view, self._forget, key)
        return view

    def extend(self, session: int, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        """Next-token logits [len(contexts), V] after each of `session`'s contexts, from a forward that may hold
        other generations' contexts too (see the module doc). Blocks the calling thread until it is done."""
        ctxs = [[int(t) for t in c] for c in contexts]
        if not ctxs:
            raise ValueError("extend needs at least one context")
        request = _Request(session, ctxs)
        with self._cond:
            self._keep[session] = self._keep.get(session, [])[:1] + ctxs
            self._queue.append(request)
            while not request.done and self._running:
                self._cond.wait()
            if not request.done:
                self._running = True
                batch = self._take()
        if not request.done:
            try:
                self._forward(batch)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def settle(self, session: int, context: Sequence[int]) -> None:
        """`session` continues from `context` only: the tree may drop its other branches."""
        with self._cond:
            self._keep[session] = [[int(t) for t in context]]

    def _forget(self, session: int) -> None:
        with self._cond:
            self._keep.pop(session, None)

    def _take(self) -> list[_Request]:
        """The oldest queued requests within the context budget (always at least one). Under the lock."""
        batch = [self._queue.popleft()]
        rows = len(batch[0].contexts)
        while self._queue and rows + len(self._queue[0].contexts) <= self.max_contexts:
            rows += len(self._queue[0].contexts)
            batch.append(self._queue.popleft())
        return batch

    def _forward(self, batch: list[_Request]) -> None:
        """Run one joint forward for `batch` (the caller owns the tree: no other forward runs)."""
        try:
            self._prune()
            contexts = [c for r in batch for c in r.contexts]
            with torch.inference_mode():
                logits = self.tree.extend(contexts)
            start = 0
            for r in batch:
                r.logits = logits[start : start + len(r.contexts)]
                start += len(r.contexts)
        except BaseException as exc:  # every generation in the forward sees it; the tree was reset by extend
            for r in batch:
                r.error = exc
        finally:
            with self._cond:
                for r in batch:
                    r.done = True
                stats = self.stats
                stats.forwards += 1
                stats.requests += len(batch)
                stats.contexts += sum(len(r.contexts) for r in batch)
                sessions = len({r.session for r in batch})
                stats.sessions_per_forward[sessions] = stats.sessions_per_forward.get(sessions, 0) + 1

    def _prune(self) -> None:
        """Drop the columns no live generation's contexts reach, once the tree holds twice what they need."""
        with self._cond:
            keep = [c for ctxs in self._keep.values() for c in ctxs]
        needed = {col for c in keep for col in self.tree.match(c)}
        if len(self.tree) > 2 * len(needed) + PRUNE_SLACK:
            self.tree.keep(keep)
            self.stats.prunes += 1


class SessionTree:
    """One generation's handle on a `JointDrafts` tree: what `ModelDrafter` drafts through."""

    def __init__(self, joint: JointDrafts, key: int) -> None:
        self.joint = joint
        self.key = key
        self._settled: list[int] = []

    @property
    def tokens(self) -> list[int]:
        """The context this generation last settled on (its own columns of the shared tree)."""
        return list(self._settled)

    def reset(self) -> None:
        """Forget what this generation settled on (the shared tree keeps other generations' columns)."""
        self._settled = []
        self.joint.settle(self.key, [])

    def settle(self, context: Sequence[int]) -> None:
        """Continue from `context` only (its columns stay; the next joint forward may drop this generation's others)."""
        self._settled = [int(t) for t in context]
        self.joint.settle(self.key, self._settled)

    def extend(self, contexts: Sequence[Sequence[int]]) -> torch.Tensor:
        return self.joint.extend(self.key, contexts)
