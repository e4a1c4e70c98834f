"""Drafting for the head: chains and token trees on the critical path, and outcome branches while a
window is in flight (`predraft`), with the time each costs kept in the engine's `TimeBreakdown`.

In the lossless sampling modes every draft row the head bets on is the coupled row softmax(log q + G_pos)
(`coupled_dist`) instead of q: the target's token at pos is argmax(log p + G_pos), so the draft's runners-up
on the perturbed scores are its best guesses of a correction, the children of a tree node, the branches
to pre-draft, and the ranks the window controller learns from. A row drafted after context c is for
position len(c)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import trio

from dsd.protocol.deadlines import cost_line

from .config import TREE_DEPTH_CAP, TREE_TOP_K, Drafter, GenerationConfig, TreeDrafter
from .draft_tree import DraftTree, expand_tree
from .outcomes import Branch, bonus_alternatives
from .report import TimeBreakdown
from .sampling import GumbelNoise, coupled_dist


@dataclass
class Draft:
    """A window's drafts: a chain (`tree` None) or a token tree (tokens = tree.tokens, probs = its q rows)."""

    tokens: list[int]
    probs: list[torch.Tensor | None]
    tree: DraftTree | None = None

    def stacked_probs(self, skip: int = 0) -> torch.Tensor | None:
        rows = self.probs[skip:]
        if not rows or any(p is None for p in rows):
            return None
        return torch.stack([p for p in rows if p is not None])

    @property
    def depth(self) -> int:
        """Positions the window reaches past its root (a chain's γ, a tree's depth)."""
        return len(self.tokens) if self.tree is None else max(self.tree.depths(), default=0)

    def ranks(self, tokens: list[int], path: list[int], full: bool) -> list[int | None]:
        """Ranks of the tokens the target emitted (`tokens`, along the accepted `path`; `full`: it ended with a
        bonus) in the draft rows they were checked against: every accepted draft, and the correction (the
        bonus after a leaf had no draft row)."""
        if self.tree is None:
            tested = len(path) + (0 if full else 1)
            return [_rank(self.probs[i], tokens[i]) for i in range(tested) if self.probs[i] is not None]
        tree = self.tree
        if tree.q is None:
            return []
        out = [_rank(tree.q[i], tree.tokens[i]) for i in path]
        if not full:
            kids = tree.children_of(path[-1] if path else -1)
            out.append(_rank(tree.q[kids[0]], tokens[-1]))
        return out

    @property
    def wire_parents(self) -> list[int] | None:
        """The window's parents on the wire (root = node 0, tree node i = node i + 1); None for a chain,
        and for a tree shaped like one (sent, and committed after, exactly as a chain)."""
        if self.tree is None or all(p == i - 1 for i, p in enumerate(self.tree.parents)):
            return None
        return [-1, *(p + 1 for p in self.tree.parents)]


def _rank(q: torch.Tensor | None, token: int) -> int | None:
    """1 + how many tokens the draft found likelier than `token` (None: no q, or q(token) = 0)."""
    if q is None:
        return None
    p = float(q[token])
    return 1 + int((q > p).sum()) if p > 0.0 else None


class Arrival:
    """Set when a window's verdict arrives, remembering when (perf_counter): drafting that runs past
    that moment delays the verdict's use, so it counts on the critical path, not as hidden."""

    def __init__(self) -> None:
        self._event = trio.Event()
        self.at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.perf_counter()
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class Bets:
    """The branches pre-drafted during one trip and what drafting them cost (seconds per branch)."""

    branches: list[Branch]
    cost: dict[int, float]  # id(branch) -> drafting seconds spent on it
    late: float = 0.0  # seconds of that drafting that ran after a verdict had arrived (not hidden)
    dead: set[int] = field(default_factory=set)  # id(branch) of branches no longer advanced

    @property
    def main(self) -> Branch | None:
        """The full-acceptance bet (the likeliest outcome), if there is one."""
        return next((b for b in self.branches if b.main), None)

    def is_dead(self, branch: Branch) -> bool:
        return id(branch) in self.dead

    @property
    def spent(self) -> float:
        return sum(self.cost.values())

    def hidden(self, branch: Branch | None = None) -> float:
        """Seconds of drafting hidden behind trips: on `branch` (the late part shared in proportion), or in all."""
        spent = self.spent
        if spent <= 0:
            return 0.0
        share = 1.0 if branch is None else self.cost.get(id(branch), 0.0) / spent
        return max(0.0, spent - self.late) * share


class Drafting:
    """The head's drafter at work: what it drafts, batched how, and what that costs."""

    def __init__(self, drafter: Drafter | None, cfg: GenerationConfig, times: TimeBreakdown,
                 coupled: GumbelNoise | None = None) -> None:
        self.drafter = drafter
        self.cfg = cfg
        self.times = times
        self.coupled = coupled  # the generation's noise in the lossless sampling modes: rows become coupled rows
        self.draft_token_s = 0.0  # last measured seconds per drafted token (or per batched branch step)
        self.tree_layer_s = 0.0  # last measured seconds per drafted tree layer
        self.single_token_s = 0.0  # last measured seconds per token of a single (unbatched) draft step
        self._steps: deque[tuple[int, float]] = deque(maxlen=32)  # (rows, seconds) of recent pre-drafting steps

    def step_cost(self) -> tuple[float, float] | None:
        """(a, m) of a batched pre-drafting step's seconds = a + m·rows, fitted on recent steps (None until rows
        varied): m is what one more branch adds to a step."""
        return cost_line((float(n), t) for n, t in self._steps)

    def _row(self, q: torch.Tensor, pos: int) -> torch.Tensor:
        """The row the head bets on for position `pos`: q, or its coupled row when the noise is set."""
        return q if self.coupled is None else coupled_dist(q, self.coupled(pos, q.shape[-1]))

    def _propose(self, context: Sequence[int], gamma: int) -> tuple[list[int], torch.Tensor | None]:
        assert self.drafter is not None
        toks, probs = self.drafter.propose(context, gamma)
        if probs is None or self.coupled is None or not toks:
            return toks, probs
        return toks, torch.stack([self._row(q, len(context) + j) for j, q in enumerate(probs)])

    def _step(self, contexts: list[list[int]]) -> list[tuple[int | None, torch.Tensor | None]]:
        """One draft token after each context: batched when the drafter can, else one call each."""
        assert self.drafter is not None
        step_many = getattr(self.drafter, "step_many", None)
        out: list[tuple[int | None, torch.Tensor | None]] = []
        if step_many is not None:
            out = list(step_many(contexts))
        else:
            for ctx in contexts:
                toks, probs = self.drafter.propose(ctx, 1)
                out.append((toks[0], None if probs is None else probs[0]) if toks else (None, None))
        return [(tok, q if q is None else self._row(q, len(ctx))) for (tok, q), ctx in zip(out, contexts, strict=True)]

    def _dists(self, contexts: list[list[int]]) -> torch.Tensor:
        """The draft's rows after each context in one batched forward (tree expansion), coupled when sampling."""
        rows = cast(TreeDrafter, self.drafter).dists_many(contexts)
        if self.coupled is None:
            return rows
        return torch.stack([self._row(q, len(ctx)) for q, ctx in zip(rows, contexts, strict=True)])

    async def draft(self, context: list[int], gamma: int) -> Draft:
        """Draft `gamma` tokens after `context` on the critical path (after a trip, or in `sd`)."""
        t0 = time.perf_counter()
        toks, probs = await trio.to_thread.run_sync(self._propose, context, gamma)
        dt = time.perf_counter() - t0
        self.times.drafting += dt
        if toks:
            self.draft_token_s = self.single_token_s = dt / len(toks)
        return Draft(list(toks), list(probs) if probs is not None else [None] * len(toks))

    def _expand(self, context: list[int], nodes: int, depth: int) -> tuple[DraftTree, int]:
        """Grow a tree of at most `nodes` drafts after `context` (worker thread); returns it and the number
        of batched draft forwards it took. When sampling, a node's children are the top-k of its coupled
        row (the top-k of log q + G): the draft's own Gumbel-max draw is always its first child."""
        cast(TreeDrafter, self.drafter).settle(context[:-1])  # as propose: keep the cached prefix, feed the last token
        root = self._dists([context])[0]
        layers = 1

        def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
            nonlocal layers
            layers += 1
            return self._dists([context + [tree.tokens[j] for j in tree.path(f)] for f in frontier])

        tree = expand_tree(root, step, budget=nodes, depth=min(depth, TREE_DEPTH_CAP), top_k=TREE_TOP_K, keep_q=True)
        return tree, layers

    async def draft_tree(self, context: list[int], nodes: int, depth: int) -> Draft:
        """Draft a token tree after `context` on the critical path."""
        t0 = time.perf_counter()
        tree, layers = await trio.to_thread.run_sync(self._expand, context, nodes, depth)
        dt = time.perf_counter() - t0
        self.times.drafting += dt
        self.tree_layer_s = dt / layers
        q = tree.q
        return Draft(list(tree.tokens), [None if q is None else q[i] for i in range(len(tree))], tree)

    def bets(self, branches: list[Branch]) -> Bets:
        """Bets on `branches`, nothing drafted yet."""
        return Bets(branches, {id(b): 0.0 for b in branches})

    async def predraft(self, bets: Bets, gamma: int, arrived: Arrival, due: float | None, *,
                       main_only: bool = False, worth: Callable[[Branch, int], bool] | None = None) -> Bets:
        """While a window flies: advance every outcome branch of `bets` one batched step at a time until the
        verdict arrives (the step under way is finished) or every branch holds `gamma` tokens; with
        `main_only`, just the full-acceptance bet (to send it ahead before the others are drafted).

        A batched step costs more than a single one, so when the steps still needed would run past
        the trip's expected end (`due`, a perf_counter time), the least likely half of the other
        branches is dropped: the main branch must be ready first. A later call continues the bets
        where an earlier one stopped (cut short by a verdict).

        `worth` (the engine's budget): before each step, a branch other than the main one that it says is not worth
        the tokens it still needs is dropped, and so are all of them when the step would end after `due`: the head
        idles until the verdict rather than draft what is unlikely to be used and late."""
        branches, dead = bets.branches, bets.dead
        first = True
        while True:
            active = [b for b in branches if id(b) not in dead and (b.root is None or len(b.tokens) < gamma)
                      and (b.main or not main_only)]
            if worth is not None and active:
                active = self._within_budget(active, gamma, due, worth, dead)
            if not active or (arrived.is_set() and not first):
                break
            t0 = time.perf_counter()
            rows = await trio.to_thread.run_sync(self._step, [b.context for b in active])
            t1 = time.perf_counter()
            dt = t1 - t0
            self.times.drafting += dt
            if arrived.at is not None:  # the verdict came during this step: the rest of it was not hidden
                bets.late += t1 - max(t0, arrived.at)
            if due is not None and len(active) > 1:
                left = max(gamma - len(b.tokens) + (b.root is None) for b in active) - 1
                if time.perf_counter() + left * dt > due:
                    others = sorted((b for b in active if not b.main), key=lambda b: b.value)
                    dead.update(id(b) for b in others[: max(1, len(others) // 2)])
            for b, (tok, q) in zip(active, rows, strict=True):
                bets.cost[id(b)] += dt / len(active)
                if tok is None:
                    dead.add(id(b))
                elif b.root is None:
                    b.root, b.value = tok, b.value * (float(q[tok]) if q is not None else 1.0)
                    if q is not None:
                        extra = bonus_alternatives(b, q, room=self.cfg.branches + 1 - len(branches),
                                                   alternatives=self.cfg.alternatives)
                        branches.extend(extra)
                        bets.cost.update({id(x): 0.0 for x in extra})
                else:
                    b.tokens.append(tok)
                    b.probs.append(q)
            self.draft_token_s = dt  # one batched step extends every branch by one token
            self._steps.append((len(active), dt))
            if len(active) == 1:
                self.single_token_s = dt
            first = False
        return bets

    def _within_budget(self, active: list[Branch], gamma: int, due: float | None,
                       worth: Callable[[Branch, int], bool], dead: set[int]) -> list[Branch]:
        """The branches of `active` worth their next step (the main one always): those `worth` rejects, and every
        other one when the step would end after `due`, are marked dead."""
        keep = [b for b in active if b.main or worth(b, gamma - len(b.tokens) + (b.root is None))]
        if due is not None and len(keep) > 1:
            fit = self.step_cost()
            step = None if fit is None else fit[0] + fit[1] * len(keep)
            if step is not None and time.perf_counter() + step > due:
                keep = [b for b in keep if b.main]
        kept = {id(b) for b in keep}
        dead.update(id(b) for b in active if id(b) not in kept)
        return keep
