"""Draft forwards of a serving head's generations run as one: one token tree for all, continuous batching.

Every generation of a `dsd-node serve` head drafts with the same draft model, and a CPU forward over a few dozen
rows costs little more than over one. `JointDrafts` holds ONE token-tree KV cache (`DraftCache`) for all of them:
each generation's contexts are paths in it (identical prefixes share their columns) and a forward feeds the new
tokens of every generation waiting at that moment, each attending only to its own ancestors (the tree's mask).

Batching is continuous and needs no timer (`joint.Joiner`): a generation that asks while no forward runs runs its own
at once (a lone generation waits for nothing); requests made while a forward runs queue, and the next forward takes
them all, up to `max_contexts` contexts, oldest first (none waits more than its turn).

A generation holds a `SessionTree` (what `ModelDrafter` drafts through): its `settle` and `extend` only record which
contexts it may still continue from; the tree drops columns no live generation's contexts reach, inside a forward,
once it holds twice what they need. Batching changes no output: drafts only propose, the target's verification
decides every token (greedy: its argmax; sampling: argmax(log p + G), coupled to the generation's own noise).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Sequence

import torch

from dsd.protocol.load import LoadMeter

from .draft_cache import DraftCache
from .joint import Joiner

MAX_CONTEXTS = 64  # contexts per joint forward: in steady state each feeds one new token (a prompt feeds all of its)
PRUNE_SLACK = 256  # columns the tree may hold beyond twice what live generations need before it prunes

_Request = tuple[int, list[list[int]]]  # a generation's key and its contexts


class JointDrafts:
    """One draft model's token tree shared by every generation of a head, forwards batched across them."""

    def __init__(self, model: torch.nn.Module, max_contexts: int = MAX_CONTEXTS) -> None:
        self.tree = DraftCache(model)
        self.prunes = 0
        # the joint forwards as steps of the head's CPU (the head's own load), the others' emitted tokens as their rate
        self.meter = LoadMeter(count="tokens")
        self.joiner: Joiner[_Request, torch.Tensor] = Joiner(self._forward, budget=max_contexts,
                                                              size=lambda r: len(r[1]))
        self._lock = threading.Lock()  # guards `_keep` (settles come from any generation's thread)
        self._keep: dict[int, list[list[int]]] = {}  # generation -> contexts it may continue from
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
        with self._lock:
            self._keep[session] = self._keep.get(session, [])[:1] + ctxs
        return self.joiner.call((session, ctxs))

    def load(self, session: int) -> float:
        """What one more drafted row of `session` costs the head's other live generations, in their tokens: a
        block peer's rule (`protocol/load.py`) over the joint forwards, the head's CPU being the shared part."""
        with self._lock:
            live = [str(k) for k in self._keep]
        return self.meter.load(str(session), live)

    def emitted(self, session: int, tokens: int) -> None:
        """`session` emitted `tokens` tokens (the rate `load` weighs a drafted row against)."""
        self.meter.emitted(str(session), tokens)

    def settle(self, session: int, context: Sequence[int]) -> None:
        """`session` continues from `context` only: the tree may drop its other branches."""
        with self._lock:
            self._keep[session] = [[int(t) for t in context]]

    def _forget(self, session: int) -> None:
        with self._lock:
            self._keep.pop(session, None)

    def _forward(self, batch: list[_Request]) -> list[torch.Tensor]:
        """One joint forward over every request's contexts (the joiner runs one at a time: it owns the tree)."""
        self._prune()
        contexts = [c for _, ctxs in batch for c in ctxs]
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.tree.extend(contexts)
        rows: dict[str, int] = {}
        for key, ctxs in batch:
            rows[str(key)] = rows.get(str(key), 0) + len(ctxs)
        self.meter.observe(time.perf_counter() - t0, rows)
        return list(torch.split(logits, [len(ctxs) for _, ctxs in batch]))

    def _prune(self) -> None:
        """Drop the columns no live generation's contexts reach, once the tree holds twice what they need."""
        with self._lock:
            keep = [c for ctxs in self._keep.values() for c in ctxs]
        needed = {col for c in keep for col in self.tree.match(c)}
        if len(self.tree) > 2 * len(needed) + PRUNE_SLACK:
            self.tree.keep(keep)
            self.prunes += 1


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

    @property
    def load(self) -> float:
        """This generation's share of the head's load (`JointDrafts.load`)."""
        return self.joint.load(self.key)

    def emitted(self, tokens: int) -> None:
        """This generation emitted `tokens` tokens (`JointDrafts.emitted`)."""
        self.joint.emitted(self.key, tokens)

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
