"""Outcome pre-drafting: the likely outcomes of the window in flight, each with a next window drafted ahead.

A window `[c, d1..dγ]` ends in one of γ+1 ways: the first k drafts are accepted and
the target adds one token t (the correction at k+1, or the bonus after dγ). While the
window is in flight the head bets on the likeliest (k, t) pairs: full acceptance with
the draft's own guess of the bonus (the *main* branch), and for the positions where
the draft was least sure, the draft's best alternative token there (the likely
correction). Each bet is a `Branch`; all branches advance together, one batched
draft forward per step (`DraftCache.extend`). When the verdict lands, the branch
whose (k, t) matches is the next window at once.

Why this stays lossless: a branch's tokens after its root are drawn from the draft's
distribution q given exactly the context the branch bets on, before the target's
verdict is known — a valid draft of that context; the root itself is never a draft
(it is the target's own token when the branch is used).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .draft_tree import DraftTree


@dataclass
class Branch:
    """A bet on one outcome (k accepted drafts, then token `root`) and the window drafted after it."""

    prefix: list[int]  # committed tokens + the k accepted drafts
    k: int  # drafts of the window in flight this branch assumes accepted
    root: int | None  # the target's next token it bets on (main branch: set by its first draft step)
    value: float  # estimated probability that this outcome happens
    tokens: list[int] = field(default_factory=list)  # drafted after the root
    probs: list[torch.Tensor | None] = field(default_factory=list)
    main: bool = False

    @property
    def context(self) -> list[int]:
        """What the next draft step continues: prefix, root (once known) and the tokens so far."""
        return self.prefix + ([] if self.root is None else [self.root]) + self.tokens

    def matches(self, k: int, token: int) -> bool:
        return self.k == k and self.root == token


def plan_branches(
    committed: Sequence[int],
    drafts: Sequence[int],
    probs: Sequence[torch.Tensor | None],
    *,
    max_branches: int,
    alternatives: int = 2,
) -> list[Branch]:
    """The main branch first, then up to `max_branches` rejection outcomes ordered by estimated probability.

    The draft's confidence q(d_i) stands in for the chance that d_i is accepted (drafts are
    well calibrated, EAGLE-2 §3.2), so the outcome "d1..d_{j-1} accepted, target says a at j"
    is worth Π_{i<j} q(d_i) · q_j(a) for the draft's top alternatives a ≠ d_j.
    """
    committed, drafts = list(committed), list(drafts)
    reach = 1.0
    bets: list[Branch] = []
    for j, (d, q) in enumerate(zip(drafts, probs, strict=True)):
        if q is None:  # a model-free draft (n-gram) gives no alternatives
            break
        top = torch.topk(q, min(alternatives + 1, q.numel()))
        for p, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            if tok != d and p > 0 and len([b for b in bets if b.k == j]) < alternatives:
                bets.append(Branch(committed + drafts[:j], j, int(tok), reach * p))
        reach *= float(q[d])
    bets.sort(key=lambda b: -b.value)
    main = Branch(committed + drafts, len(drafts), None, reach, main=True)
    return [main, *bets[: max(0, max_branches)]]


def bonus_alternatives(main: Branch, q: torch.Tensor, *, room: int, alternatives: int = 2) -> list[Branch]:
    """After the main branch's first step: other guesses of the bonus token (full acceptance, token ≠ the guess)."""
    if room <= 0 or main.root is None:
        return []
    reach = main.value
    top = torch.topk(q, min(alternatives + 1, q.numel()))
    out = [
        Branch(list(main.prefix), main.k, int(tok), reach * p)
        for p, tok in zip(top.values.tolist(), top.indices.tolist(), strict=True)
        if tok != main.root and p > 0
    ]
    return out[: min(room, alternatives)]


def pick(branches: Sequence[Branch], k: int, token: int) -> Branch | None:
    """The branch that bet on outcome (k, token), if any held a drafted window."""
    for b in branches:
        if b.matches(k, token) and b.tokens:
            return b
    return None


def pick_after_tree(branches: Sequence[Branch], k: int, committed: list[int]) -> Branch | None:
    """The branch that bet on a tree's outcome: the same k accepted nodes (as tokens) and the same next token."""
    path = committed[len(committed) - 1 - k : -1]
    for b in branches:
        if b.tokens and b.k == k and b.root == committed[-1] and b.prefix[len(b.prefix) - k :] == path:
            return b
    return None


def tree_branches(committed: Sequence[int], tree: DraftTree, *, max_branches: int, alternatives: int = 2) -> list[Branch]:
    """Outcome branches of a tree window in flight, the likeliest first (at most max_branches + 1).

    A node's value is the product of the draft's probabilities along its path (≈ the chance it is
    accepted, EAGLE-2 §3.2). A leaf fully accepted is worth its value, with the bonus token guessed by
    the branch's first draft step (as the main branch of a chain); a rejection below a node with
    children is worth value · q(a) for the draft's best tokens a outside its children (children
    themselves are outcomes deeper in the tree). The likeliest outcome is the `main` branch.
    """
    committed = list(committed)
    q = tree.q
    if q is None:
        return []
    value: list[float] = []
    for i, (p, t) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
        value.append((1.0 if p < 0 else value[p]) * float(q[i][t]))
    bets: list[Branch] = []
    for node in range(-1, len(tree)):
        path = tree.path(node)
        prefix = committed + [tree.tokens[j] for j in path]
        v = 1.0 if node < 0 else value[node]
        kids = tree.children_of(node)
        if not kids:
            bets.append(Branch(prefix, len(path), None, v))
            continue
        taken = {tree.tokens[c] for c in kids}
        row = q[kids[0]]
        top = torch.topk(row, min(alternatives + len(kids), row.numel()))
        alts = [(p, t) for p, t in zip(top.values.tolist(), top.indices.tolist(), strict=True) if t not in taken and p > 0]
        bets.extend(Branch(list(prefix), len(path), int(t), v * p) for p, t in alts[:alternatives])
    bets.sort(key=lambda b: -b.value)
    bets = bets[: max(0, max_branches) + 1]
    if bets:
        bets[0].main = True
    return bets
