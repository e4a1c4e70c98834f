"""Lossless verification of a draft tree against the target's rows, one trip for the whole tree.

Row 0 of the target output belongs to the last committed token, row i + 1 to
node i. The walk starts at the root; at each accepted node its children are
tried in order, the first accepted one is descended into, and the walk ends with
one correction (every child rejected) or bonus (a leaf was reached) token. When
sampling with the generation's Gumbel noise (the lossless modes) the target's
token at each depth is fixed by its row and the noise of its position, and the walk
follows the child holding it (docs/sampling.md). The rejection-sampling rules
(dsd-adaptive) and their proofs are in docs/tree_verification.md; on a chain every
rule is exactly `verify_window`'s, consuming the same random draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import Children, DraftTree
from .sampling import GumbelNoise, SamplingParams, coupled_token, sample, softmax, warp
from .verify import Verdict

__all__ = ["TreeVerdict", "verify_tree", "tree_verify_params"]


@dataclass(frozen=True)
class TreeVerdict(Verdict):
    """A `Verdict` plus `path`: the accepted node indices, root to deepest (len(path) == accepted)."""

    path: list[int]


def tree_verify_params(params: SamplingParams, returns_probs: bool) -> SamplingParams:
    """The rule the head verifies with: a probability backend already warped, so sample at T = 1."""
    if returns_probs and not params.greedy:
        return SamplingParams(temperature=1.0, top_k=params.top_k)
    return params


def _check(target: torch.Tensor, tree: DraftTree, tau: torch.Tensor | None) -> None:
    if not isinstance(tree, DraftTree):
        raise TypeError(f"tree must be a DraftTree, got {type(tree).__name__}")
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        shape = tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__
        raise ValueError(f"target must be a 2-D tensor [n+1, V], got {shape}")
    if not target.is_floating_point() or torch.isnan(target).any():
        raise ValueError("target must be floating point and free of NaN")
    n = len(tree)
    rows, vocab = target.shape
    if rows != n + 1:
        raise ValueError(f"target must have n+1 = {n + 1} rows for a tree of {n} nodes, got {rows}")
    if tree.tokens and max(tree.tokens) >= vocab:
        raise ValueError(f"a node's token {max(tree.tokens)} is outside the vocabulary [0, {vocab})")
    if tree.q is not None and tree.q.shape[1] != vocab:
        raise ValueError(f"q has {tree.q.shape[1]} columns, the target's vocabulary has {vocab}")
    if tau is not None:
        if tuple(tau.shape) != (n,):
            raise ValueError(f"tau must have shape [n] = ({n},), got {tuple(tau.shape)}")
        if torch.isnan(tau).any() or (tau < 0).any() or (tau > 1).any():
            raise ValueError(f"tau values must lie in [0, 1], got {tau.tolist()}")


def verify_tree(
    target: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    tau: torch.Tensor | None = None,
    *,
    returns_probs: bool = False,
    noise: GumbelNoise | None = None,
    start: int = 0,
) -> TreeVerdict:
    """Verify a draft tree against target rows [n+1, V] (row 0: last committed token; row i+1: node i).

    Greedy: descend into the child equal to the row's argmax; emit the argmax as
    the correction when no child matches, or the leaf row's argmax as the bonus.
    Sampling with `noise` (lossless modes): row 0 predicts absolute position `start`,
    the row of a node at depth d position `start + d`; the target's token there is
    argmax(log warp(row) + G_pos). Descend into the child holding it, else emit it
    (the correction); at a leaf emit the leaf row's token (the bonus). Any tree
    gives the same tokens; the children kind and q are not used.
    Sampling without `noise` (dsd-adaptive; p = warp(row)): TOPK children use rule (c), accept x with prob
    p_res(x), else p_res(x) ← 0 and renormalise; SAMPLED children use rule (b),
    accept x with prob min(1, p_res(x)/q_res(x)), else p_res ← norm(max(p_res − q_res, 0))
    and q_res(x) ← 0, renormalised. All children rejected: the correction is drawn
    from p_res; an accepted leaf: the bonus is drawn from p of its row.

    `returns_probs`: the rows are probabilities already warped by the backend; as
    the engine does for chains, verify against log(p) at temperature 1 (keeping the
    user's top-k); greedy takes argmax of p.

    `tau` [n] (adaptive, lossy, opt-in) relaxes node i's test exactly as verify_window
    relaxes a position: greedy also accepts when softmax(row)[x] ≥ (1 − τ)·max (the
    exact match is preferred, then the first relaxed child); sampling uses
    min(1, p_res(x)/((1 − τ)·q_res(x))) with q_res = 1 for TOPK children. For the
    per-node τ, give AdaptiveVerifier rows `target[tree.predicting_rows()]`. Nodes with
    τ = 0 run the lossless test with the same random draws.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    _check(target, tree, tau)
    logits = torch.log(target) if returns_probs else target
    params = tree_verify_params(params, returns_probs)
    taus = [0.0] * len(tree) if tau is None else [float(t) for t in tau.double()]
    if params.greedy:
        return _greedy(logits, tree, taus)
    if noise is not None:
        if tau is not None:
            raise ValueError("the Gumbel-max rule is lossless only: relax (tau) with the rejection-sampling rules")
        return _coupled(logits, tree, params, noise, start)
    return _sampling(logits, tree, params, generator, taus)


def _verdict(tree: DraftTree, path: list[int], nxt: int) -> TreeVerdict:
    toks = [tree.tokens[i] for i in path]
    return TreeVerdict(accepted=len(path), next_token=nxt, tokens=toks + [nxt], path=path)


def _greedy(logits: torch.Tensor, tree: DraftTree, taus: list[float]) -> TreeVerdict:
    path: list[int] = []
    node = -1
    while True:
        row = logits[node + 1]
        best = int(torch.argmax(row.float()))
        kids = tree.children_of(node)
        nxt = next((c for c in kids if tree.tokens[c] == best), None)
        if nxt is None and any(taus[c] > 0.0 for c in kids):
            probs = softmax(row)
            top = float(probs.max())
            nxt = next(
                (c for c in kids if taus[c] > 0.0 and float(probs[tree.tokens[c]]) >= (1.0 - taus[c]) * top), None
            )
        if nxt is None:
            return _verdict(tree, path, best)
        path.append(nxt)
        node = nxt


def _coupled(logits: torch.Tensor, tree: DraftTree, params: SamplingParams, noise: GumbelNoise, start: int) -> TreeVerdict:
    """Greedy walk on perturbed scores: a depth's noise is computed only when the walk reaches it."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    vocab = logits.shape[1]
    path: list[int] = []
    node = -1
    while True:
        t = coupled_token(logits[node + 1], params, noise(start + len(path), vocab))
        nxt = next((c for c in tree.children_of(node) if tree.tokens[c] == t), None)
        if nxt is None:
            return _verdict(tree, path, t)
        path.append(nxt)
        node = nxt


def _threshold(px: float, qx: float, t: float) -> float:
    if t <= 0.0:
        return min(1.0, px / qx)
    if t >= 1.0:
        return 1.0 if px > 0.0 else 0.0
    return min(1.0, px / ((1.0 - t) * qx))


def _sampling(
    logits: torch.Tensor,
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None,
    taus: list[float],
) -> TreeVerdict:
    sampled = tree.children is Children.SAMPLED
    q_all = tree.q.double() if sampled and tree.q is not None else None
    path: list[int] = []
    node = -1
    while True:
        p = warp(logits[node + 1], params).double()
        kids = tree.children_of(node)
        if not kids:
            return _verdict(tree, path, sample(p, generator))
        # Residuals are kept unnormalised with their mass; the first test uses p and q as given
        # (mass 1), exactly as verify_window does, so a chain consumes and decides identically.
        p_res, p_mass = p, 1.0
        q_res, q_mass = (q_all[kids[0]], 1.0) if q_all is not None else (None, 1.0)
        chosen = None
        for c in kids:
            x = tree.tokens[c]
            px = float(p_res[x]) / p_mass
            qx = 1.0 if q_res is None else (float(q_res[x]) / q_mass if q_mass > 0.0 else 0.0)
            if qx <= 0.0:
                raise ValueError(
                    f"node {c} (token {x}) has draft probability {qx} after its earlier siblings were drawn; "
                    "q must be the distribution the children were drawn from, without replacement"
                )
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if u < _threshold(px, qx, taus[c]):
                chosen = c
                break
            if q_res is None:
                residual = p_res.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p_res / p_mass - q_res / q_mass, min=0.0)
                q_res = q_res.clone()
                q_res[x] = 0.0
                q_mass = float(q_res.sum())
            mass = float(residual.sum())
            # Zero mass is only reachable through float rounding (p_res ≈ q_res) or a relaxed
            # test; the current p_res is then the answer, as in verify_window.
            if mass > 0.0:
                p_res, p_mass = residual, mass
        if chosen is None:
            return _verdict(tree, path, sample(p_res, generator))
        path.append(chosen)
        node = chosen
