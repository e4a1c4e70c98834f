"""Growing draft trees by path probability (EAGLE-2 style): the best paths kept within budget, depth and width."""


from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from dsd.node.head.draft_tree import MAX_TREE_NODES, DraftTree, expand_tree

torch.set_num_threads(1)

def _path_dist(path: tuple[int, ...], vocab: int) -> torch.Tensor:
    """A fixed pseudo-random next-token distribution for each drafted path (a context-dependent draft)."""
    seed = 1 + sum((t + 1) * (vocab + 1) ** i for i, t in enumerate(path))
    return torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)


def _recording_step(vocab: int, calls: list[tuple[DraftTree, list[int]]]) -> Callable[[DraftTree, list[int]], torch.Tensor]:
    def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        calls.append((tree, frontier))
        return torch.stack([_path_dist(tuple(tree.tokens[k] for k in tree.path(f)), vocab) for f in frontier])

    return step


def _value(tree: DraftTree, node: int, vocab: int) -> float:
    toks = [tree.tokens[k] for k in tree.path(node)]
    return math.prod(float(_path_dist(tuple(toks[:i]), vocab)[toks[i]]) for i in range(len(toks)))


def test_expand_tree_with_full_width_keeps_the_globally_best_paths() -> None:
    vocab, depth, budget = 3, 3, 10
    calls: list = []
    tree = expand_tree(_path_dist((), vocab), _recording_step(vocab, calls), budget=budget, depth=depth, top_k=vocab, width=vocab ** (depth - 1))
    everything: dict[tuple[int, ...], float] = {}
    layer: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    for _ in range(depth):
        nxt = []
        for path, v in layer:
            dist = _path_dist(path, vocab)
            for t in range(vocab):
                nxt.append((path + (t,), v * float(dist[t])))
        everything.update(nxt)
        layer = nxt
    best = sorted(everything, key=lambda k: -everything[k])[:budget]
    got = [tuple(tree.tokens[k] for k in tree.path(n)) for n in range(len(tree))]
    assert sorted(got) == sorted(best)
    assert len(calls) <= depth - 1


def test_expand_tree_respects_budget_depth_width_and_order() -> None:
    vocab = 8
    for budget, depth, top_k, width in [(12, 4, 3, 2), (5, 6, 2, 2), (30, 3, 4, 4), (1, 3, 2, 1)]:
        calls: list = []
        tree = expand_tree(_path_dist((), vocab), _recording_step(vocab, calls), budget=budget, depth=depth, top_k=top_k, width=width, keep_q=True)
        assert len(tree) == budget
        assert max(tree.depths()) <= depth and len(calls) <= depth - 1
        assert all(p < i for i, p in enumerate(tree.parents))  # parents first: a connected tree
        assert all(len(tree.children_of(n)) <= top_k for n in range(-1, len(tree)))
        values = [_value(tree, n, vocab) for n in range(len(tree))]
        for n in range(-1, len(tree)):
            kid_values = [values[c] for c in tree.children_of(n)]
            assert kid_values == sorted(kid_values, reverse=True)
        for prev_tree, frontier in calls:
            assert len(frontier) <= width
            newest = max(prev_tree.depths())
            layer = [n for n in range(len(prev_tree)) if prev_tree.depths()[n] == newest]
            lv = {n: _value(prev_tree, n, vocab) for n in layer}
            ranked = sorted(layer, key=lambda n: -lv[n])
            assert frontier == ranked[: len(frontier)]  # the most probable of the newest layer
        # Every node the expansion drafted but dropped is no more probable than every kept one:
        # the pool is the tree the last step saw plus the top_k children of its frontier.
        last_tree, last_frontier = calls[-1] if calls else (tree, [])
        kept = {tuple(tree.tokens[k] for k in tree.path(n)) for n in range(len(tree))}
        pool = {tuple(last_tree.tokens[k] for k in last_tree.path(n)): _value(last_tree, n, vocab) for n in range(len(last_tree))}
        for f in last_frontier:
            path = tuple(last_tree.tokens[k] for k in last_tree.path(f))
            dist = _path_dist(path, vocab)
            for t in torch.topk(dist, top_k).indices.tolist():
                pool[path + (t,)] = pool[path] * float(dist[t])
        assert kept <= set(pool)
        dropped = [v for path, v in pool.items() if path not in kept]
        if dropped:
            assert max(dropped) <= min(values) * (1 + 1e-9)
        assert tree.q is not None and tree.q.shape == (len(tree), vocab)
        for n in range(len(tree)):
            parent_path = tuple(tree.tokens[k] for k in tree.path(n))[:-1]
            assert torch.allclose(tree.q[n], _path_dist(parent_path, vocab))


def test_expand_tree_hand_case_expands_only_the_best_and_stops_early() -> None:
    root = torch.tensor([0.5, 0.25, 0.2, 0.05])
    calls: list = []

    def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        calls.append(list(frontier))
        return torch.tensor([[0.6, 0.3, 0.1, 0.0]] * len(frontier))

    tree = expand_tree(root, step, budget=4, depth=3, top_k=2, width=1)
    # Pool: a=.5, b=.25 (layer 1); c=.3, d=.15 under a; e=.18, f=.09 under c. Best 4: a, c, b, e.
    assert (tree.tokens, tree.parents) == ((0, 1, 0, 0), (-1, -1, 0, 2))
    assert calls == [[0], [2]]
    calls.clear()
    tree = expand_tree(root, step, budget=2, depth=3, top_k=2, width=1)
    assert (tree.tokens, tree.parents) == ((0, 0), (-1, 0))
    assert calls == [[0]]  # c (.3) cannot beat the 2nd best (.3, shallower): no third layer
    tree = expand_tree(torch.tensor([0.5, 0.5, 0.0, 0.0]), step, budget=9, depth=1, top_k=4)
    assert tree.tokens == (0, 1)  # zero-probability tokens are never drafted; ties go to the lower id


def test_expand_tree_refuses_bad_arguments() -> None:
    root = torch.full((4,), 0.25)

    def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        return torch.full((len(frontier), 4), 0.25)

    for kwargs in (dict(budget=0, depth=2, top_k=2), dict(budget=2, depth=0, top_k=2), dict(budget=2, depth=2, top_k=0)):
        with pytest.raises(ValueError):
            expand_tree(root, step, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="budget"):
        expand_tree(root, step, budget=MAX_TREE_NODES + 1, depth=2, top_k=2)
    with pytest.raises(ValueError, match="drafted nodes"):
        expand_tree(root, step, budget=60, depth=12, top_k=10, width=10)  # 1090 candidates
    assert len(expand_tree(root, step, budget=60, depth=7, top_k=10, width=10)) == 60  # EAGLE-2 defaults fit
    with pytest.raises(ValueError, match="frontier"):
        expand_tree(root, lambda t, f: torch.full((1, 4), 0.25), budget=9, depth=2, top_k=2, width=2)
