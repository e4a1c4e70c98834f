"""Token trees of drafts: the `DraftTree` data type and EAGLE-2-style tree expansion.

A tree holds n drafted nodes in topological order: `parents[i]` is the index of
node i's parent, or −1 when node i is a child of the last committed token (the
root). Target row 0 is the root's output and row i + 1 is node i's, so row
`parents[i] + 1` predicts node i. A chain is the tree with parents −1, 0, 1, …
How the children were chosen decides the lossless acceptance rule
(see dsd.node.head.tree_verify and docs/tree_verification.md).
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsd.protocol.limits import DEFAULT_LIMITS

__all__ = ["MAX_TREE_NODES", "Children", "DraftTree", "check_parents", "expand_tree", "StepFn"]

# A window on the wire is the last committed token plus the tree's nodes.
MAX_TREE_NODES = DEFAULT_LIMITS.max_tree_nodes  # what the wire accepts (protocol/limits.py)
# A tree held on the head while drafting (the candidate pool) may be larger: only `budget` nodes are sent.
MAX_POOL_NODES = DEFAULT_LIMITS.max_tokens_per_window - 1


class Children(enum.Enum):
    """How a node's children were chosen, which picks the verification rule."""

    # Chosen without looking at the target's random draws (top-k of the draft, EAGLE-2 rerank,
    # n-gram lookups): verified by sequential elimination on the target residual, rule (c). (In the
    # lossless sampling modes the children are the top-k of the perturbed scores log q + G, which the
    # target's draws share: those trees are verified only by the Gumbel-max walk, which takes any tree.)
    TOPK = "topk"
    # Drawn from the draft distribution q without replacement, in draw order: rule (b), which
    # needs q (`DraftTree.q`) and reduces to Leviathan/Chen's rule on a chain.
    SAMPLED = "sampled"


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{what} must be an int, got {type(value).__name__}") from None


def check_parents(parents: Sequence[int], max_nodes: int = MAX_TREE_NODES) -> list[int]:
    """Check a parent array as the wire does (≤ max_nodes, −1 ≤ parents[i] < i); return it as ints."""
    if len(parents) > max_nodes:
        raise ValueError(f"a tree may hold at most {max_nodes} nodes, got {len(parents)}")
    out: list[int] = []
    for i, raw in enumerate(parents):
        p = _as_int(raw, f"parents[{i}]")
        if not -1 <= p < i:
            raise ValueError(
                f"parents[{i}] = {p}: a parent must be −1 (the last committed token) or an earlier node in [0, {i})"
            )
        out.append(p)
    return out


@dataclass(frozen=True)
class DraftTree:
    """Drafted nodes (`tokens`, `parents` in topological order) and how their children were chosen.

    `q`, optional for TOPK and required for SAMPLED, is [n, V] with q[i] the draft
    distribution node i was chosen from (its parent's next-token distribution), as
    `draft_probs` in verify_window; siblings therefore share one row.
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    children: Children = Children.TOPK
    q: torch.Tensor | None = field(default=None, compare=False, repr=False)
    _kids: tuple[tuple[int, ...], ...] = field(init=False, compare=False, repr=False)
    _depths: tuple[int, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        tokens = tuple(_as_int(t, f"tokens[{i}]") for i, t in enumerate(self.tokens))
        parents = tuple(check_parents(self.parents, MAX_POOL_NODES))
        if len(tokens) != len(parents):
            raise ValueError(f"tokens and parents must have the same length, got {len(tokens)} and {len(parents)}")
        for i, t in enumerate(tokens):
            if t < 0:
                raise ValueError(f"tokens[{i}] = {t} is negative")
        if not isinstance(self.children, Children):
            raise ValueError(f"children must be a Children value, got {self.children!r}")
        kids: list[list[int]] = [[] for _ in range(len(tokens) + 1)]
        depths: list[int] = []
        for i, p in enumerate(parents):
            siblings = kids[p + 1]
            if any(tokens[s] == tokens[i] for s in siblings):
                raise ValueError(f"node {i} repeats token {tokens[i]} of a sibling: siblings must be distinct tokens")
            siblings.append(i)
            depths.append(1 if p < 0 else depths[p] + 1)
        self._check_q(tokens, kids)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)
        object.__setattr__(self, "_kids", tuple(tuple(k) for k in kids))
        object.__setattr__(self, "_depths", tuple(depths))

    def _check_q(self, tokens: tuple[int, ...], kids: list[list[int]]) -> None:
        q = self.q
        if q is None:
            if self.children is Children.SAMPLED and tokens:
                raise ValueError("a tree with SAMPLED children needs q, the distributions they were drawn from")
            return
        if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != len(tokens) or not q.is_floating_point():
            shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"q must be a floating [n, V] tensor with n = {len(tokens)} rows, got {shape}")
        if torch.isnan(q).any() or (q < 0).any():
            raise ValueError("q must be free of NaN and non-negative")
        for i, t in enumerate(tokens):
            if t >= q.shape[1]:
                raise ValueError(f"tokens[{i}] = {t} is outside the vocabulary [0, {q.shape[1]}) of q")
        if self.children is Children.SAMPLED:
            for siblings in kids:
                for s in siblings[1:]:
                    if not torch.equal(q[s], q[siblings[0]]):
                        raise ValueError(f"nodes {siblings[0]} and {s} are siblings with different q rows")

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def as_chain(cls, tokens: Sequence[int], q: torch.Tensor | None = None) -> DraftTree:
        """A chain d1..dγ (parents −1, 0, 1, …); with q [γ, V] its drafts count as sampled from q."""
        n = len(tokens)
        children = Children.TOPK if q is None else Children.SAMPLED
        return cls(tuple(tokens), tuple(range(-1, n - 1)), children, q)

    def validate(self, vocab: int | None = None, max_nodes: int = MAX_TREE_NODES) -> None:
        """Raise ValueError unless the tree fits `max_nodes` and every token is below `vocab`."""
        check_parents(self.parents, max_nodes)
        if vocab is not None:
            for i, t in enumerate(self.tokens):
                if t >= vocab:
                    raise ValueError(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab})")

    def children_of(self, node: int) -> tuple[int, ...]:
        """Children of `node` (−1 = the root) in the order they are tried."""
        if not -1 <= node < len(self.tokens):
            raise IndexError(f"node {node} is not in [-1, {len(self.tokens)})")
        return self._kids[node + 1]

    def depths(self) -> list[int]:
        """Depth of each node: 1 for a child of the root (its position offset after the committed tokens)."""
        return list(self._depths)

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` (empty for −1)."""
        if not -1 <= node < len(self.tokens):
            raise IndexError(f"node {node} is not in [-1, {len(self.tokens)})")
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        return [i for i in range(len(self.tokens)) if not self._kids[i + 1]]

    def predicting_rows(self) -> list[int]:
        """For each node, the target row that predicts it (its parent's row: parents[i] + 1)."""
        return [p + 1 for p in self.parents]

    def ancestor_mask(self) -> torch.Tensor:
        """Bool [n, n]: row i is True at node i and its ancestors (what node i attends to in the tree)."""
        n = len(self.tokens)
        mask = torch.zeros(n, n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask


StepFn = Callable[[DraftTree, list[int]], torch.Tensor]


def expand_tree(
    root_probs: torch.Tensor,
    step_fn: StepFn,
    *,
    budget: int,
    depth: int,
    top_k: int,
    width: int | None = None,
    keep_q: bool = False,
) -> DraftTree:
    """Grow a draft tree EAGLE-2 style and keep the `budget` nodes with the highest path probability.

    `root_probs` [V] is the draft's next-token distribution after the last committed
    token. Layer 1 is its top_k tokens. Each further step takes the `width` (default
    top_k) nodes of the newest layer with the highest path probability (product of
    draft probabilities from the root) and calls `step_fn(tree_so_far, frontier)`, which
    returns their next-token distributions [len(frontier), V] in one batched draft
    forward; their top_k children join the pool. At most `depth` layers are drafted.
    The result holds the best `budget` pool nodes (ties to the shallower, then older
    node): a connected tree, since a child's value never exceeds its parent's, in
    creation order (parents first, siblings by falling draft probability). Tokens of
    zero draft probability are never added. Layers stop early once no frontier node
    can beat the budget-th best node already found, which leaves the result unchanged.
    Every drafted node (top_k + (depth − 1)·width·top_k at most) must fit MAX_POOL_NODES; the kept
    `budget` must fit MAX_TREE_NODES (what a window may carry).
    `keep_q` stores each node's parent distribution as q (TOPK children; for τ).
    When sampling, the head passes coupled rows softmax(log q + G_pos) (`drafting.py`): children are then the
    top-k of the perturbed scores, the draft's own Gumbel-max draw first, and path values their products.
    """
    for name, value in (("budget", budget), ("depth", depth), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if budget > MAX_TREE_NODES:
        raise ValueError(f"budget must be <= {MAX_TREE_NODES}, got {budget}")
    width = top_k if width is None else width
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be an integer >= 1, got {width!r}")
    pool_max = top_k + (depth - 1) * width * top_k
    if pool_max > MAX_POOL_NODES:
        raise ValueError(
            f"up to top_k + (depth − 1)·width·top_k = {pool_max} drafted nodes; at most {MAX_POOL_NODES} fit a tree"
        )
    if not isinstance(root_probs, torch.Tensor) or root_probs.dim() != 1 or root_probs.numel() == 0:
        raise ValueError("root_probs must be a non-empty 1-D tensor [V]")
    vocab = root_probs.numel()

    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    logv: list[float] = []  # log path probability, so deep products do not underflow to ties
    qrows: list[torch.Tensor] = []

    def grow(parent: int, probs: torch.Tensor) -> list[int]:
        if probs.dim() != 1 or probs.numel() != vocab:
            raise ValueError(f"step_fn must return one distribution of {vocab} entries per frontier node")
        if not probs.is_floating_point() or torch.isnan(probs).any():
            raise ValueError("step_fn returned non-floating or NaN probabilities")
        vals, idx = torch.topk(probs.double(), min(top_k, vocab))
        base = 0.0 if parent < 0 else logv[parent]
        added = []
        # Ties in draft probability go to the lower token id, whatever order topk returned.
        for v, t in sorted(zip(vals.tolist(), idx.tolist(), strict=True), key=lambda vt: (-vt[0], vt[1])):
            if v <= 0.0:
                break
            tokens.append(int(t))
            parents.append(parent)
            depths.append(1 if parent < 0 else depths[parent] + 1)
            logv.append(base + min(0.0, math.log(v)))
            qrows.append(probs)
            added.append(len(tokens) - 1)
        return added

    newest = grow(-1, root_probs)
    for _ in range(depth - 1):
        frontier = sorted(newest, key=lambda i: (-logv[i], i))[:width]
        if len(logv) >= budget:
            bar = sorted(logv, reverse=True)[budget - 1]
            frontier = [f for f in frontier if logv[f] > bar]
        if not frontier:
            break
        so_far = DraftTree(tuple(tokens), tuple(parents))
        out = step_fn(so_far, list(frontier))
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != len(frontier):
            raise ValueError(f"step_fn must return a [{len(frontier)}, V] tensor for {len(frontier)} frontier nodes")
        newest = []
        for f, row in zip(frontier, out, strict=True):
            newest.extend(grow(f, row))
        if not newest:
            break

    keep = sorted(sorted(range(len(tokens)), key=lambda i: (-logv[i], depths[i], i))[:budget])
    new_index = {old: new for new, old in enumerate(keep)}
    q = torch.stack([qrows[i] for i in keep]).float() if keep_q and keep else None
    return DraftTree(
        tuple(tokens[i] for i in keep),
        tuple(-1 if parents[i] < 0 else new_index[parents[i]] for i in keep),
        Children.TOPK,
        q,
    )
