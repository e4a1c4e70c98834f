"""Token trees: DraftTree helpers, greedy and rejection-sampling tree verification (dsd-adaptive's rules at τ = 0; the
lossless modes' Gumbel-max walk: test_head_logic_coupled; expansion: test_head_tree_expand)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest
import torch
from support.sampling import chi2_pvalue

from dsd.node.head.draft_tree import MAX_TREE_NODES, Children, DraftTree, check_parents, expand_tree
from dsd.node.head.sampling import SamplingParams, sample, warp
from dsd.node.head.tree_verify import TreeVerdict, verify_tree
from dsd.node.head.verify import verify_window

torch.set_num_threads(1)
GREEDY = SamplingParams()
HOT = SamplingParams(temperature=1.0)




def rows_with_top(tops: list[int], vocab: int = 8) -> torch.Tensor:
    """Target logits [len(tops), V] whose argmax per row is the given token."""
    out = torch.zeros(len(tops), vocab)
    for i, t in enumerate(tops):
        out[i, t] = 5.0
    return out


# --- the data type ----------------------------------------------------------------------------

#        root
#       /    \
#     0:5    1:2
#     /  \
#   2:7  3:1
#         |
#        4:4
TREE = DraftTree((5, 2, 7, 1, 4), (-1, -1, 0, 0, 3))


def test_tree_helpers() -> None:
    assert len(TREE) == 5
    assert TREE.depths() == [1, 1, 2, 2, 3]
    assert TREE.children_of(-1) == (0, 1) and TREE.children_of(0) == (2, 3) and TREE.children_of(4) == ()
    assert TREE.path(4) == [0, 3, 4] and TREE.path(1) == [1] and TREE.path(-1) == []
    assert TREE.leaves() == [1, 2, 4]
    assert TREE.predicting_rows() == [0, 0, 1, 1, 4]
    mask = TREE.ancestor_mask()
    assert mask[4].tolist() == [True, False, False, True, True]
    assert mask[1].tolist() == [False, True, False, False, False]
    chain = DraftTree.as_chain([3, 1, 4])
    assert chain.parents == (-1, 0, 1) and chain.children is Children.TOPK
    q = torch.full((3, 8), 1 / 8)
    assert DraftTree.as_chain([3, 1, 4], q).children is Children.SAMPLED
    assert len(DraftTree((), ())) == 0


def test_tree_validation_refuses_bad_trees() -> None:
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2), (-1, 1))  # self reference
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1, 2, 3), (-1, 2, 0))  # forward reference
    with pytest.raises(ValueError, match="earlier node"):
        DraftTree((1,), (-2,))
    with pytest.raises(ValueError, match="same length"):
        DraftTree((1, 2), (-1,))
    with pytest.raises(ValueError, match="negative"):
        DraftTree((-1,), (-1,))
    with pytest.raises(ValueError, match="must be an int"):
        DraftTree((1.0,), (-1,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be an int"):
        check_parents([True])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="siblings must be distinct"):
        DraftTree((3, 3), (-1, -1))
    with pytest.raises(ValueError, match="at most"):
        check_parents([-1] * (MAX_TREE_NODES + 1))
    with pytest.raises(ValueError, match="at most 2"):
        TREE.validate(max_nodes=2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TREE.validate(vocab=6)
    TREE.validate(vocab=8, max_nodes=5)
    with pytest.raises(ValueError, match="needs q"):
        DraftTree((1,), (-1,), Children.SAMPLED)
    with pytest.raises(ValueError, match="n = 2 rows"):
        DraftTree((1, 2), (-1, 0), Children.SAMPLED, torch.full((3, 8), 1 / 8))
    q = torch.full((2, 8), 1 / 8)
    q[1] = torch.softmax(torch.arange(8.0), 0)
    with pytest.raises(ValueError, match="siblings with different q"):
        DraftTree((1, 2), (-1, -1), Children.SAMPLED, q)
    DraftTree((1, 2), (-1, 0), Children.SAMPLED, q)  # parent and child may differ


def test_verify_tree_refuses_bad_inputs() -> None:
    with pytest.raises(ValueError, match="n\\+1 = 6 rows"):
        verify_tree(torch.zeros(5, 8), TREE, GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_tree(torch.zeros(6, 7), TREE, GREEDY)
    with pytest.raises(ValueError, match="NaN"):
        verify_tree(torch.full((6, 8), float("nan")), TREE, GREEDY)
    with pytest.raises(ValueError, match="tau must have shape"):
        verify_tree(torch.zeros(6, 8), TREE, GREEDY, tau=torch.zeros(4))
    with pytest.raises(ValueError, match="tau values"):
        verify_tree(torch.zeros(6, 8), TREE, GREEDY, tau=torch.full((5,), 2.0))
    with pytest.raises(TypeError):
        verify_tree(torch.zeros(6, 8), TREE, None)  # type: ignore[arg-type]
    q = torch.zeros(2, 8)
    q[:, 1] = 1.0
    tree = DraftTree((1, 2), (-1, -1), Children.SAMPLED, q)  # token 2 cannot have been drawn from q
    with pytest.raises(ValueError, match="draft probability"):
        for seed in range(50):  # the first child is rejected whenever u ≥ p(1)
            verify_tree(torch.zeros(3, 8), tree, HOT, torch.Generator().manual_seed(seed))


# --- greedy -----------------------------------------------------------------------------------


def test_greedy_accepts_a_deep_branch_and_takes_the_bonus_at_its_leaf() -> None:
    # Rows: root, then one per node; node 0 (5) -> node 3 (1) -> node 4 (4) is the target's path.
    rows = rows_with_top([5, 1, 0, 0, 4, 6])
    v = verify_tree(rows, TREE, GREEDY)
    assert v == TreeVerdict(accepted=3, next_token=6, tokens=[5, 1, 4, 6], path=[0, 3, 4])


def test_greedy_rejects_at_the_root() -> None:
    v = verify_tree(rows_with_top([3, 1, 0, 0, 4, 6]), TREE, GREEDY)
    assert v == TreeVerdict(accepted=0, next_token=3, tokens=[3], path=[])


def test_greedy_second_root_child_and_mid_tree_correction() -> None:
    v = verify_tree(rows_with_top([2, 0, 6, 0, 0, 0]), TREE, GREEDY)
    assert (v.path, v.tokens) == ([1], [2, 6])  # node 1 is a leaf: bonus from its row
    v = verify_tree(rows_with_top([5, 3, 0, 0, 0, 0]), TREE, GREEDY)
    assert (v.path, v.tokens) == ([0], [5, 3])  # neither 7 nor 1 is the argmax 3: correction


def test_greedy_empty_tree_is_plain_decoding() -> None:
    assert verify_tree(rows_with_top([6]), DraftTree((), ()), GREEDY).tokens == [6]


def _depth_of(parents: list[int], node: int) -> int:
    depth = 0
    while node >= 0:
        depth += 1
        node = parents[node]
    return depth


def test_greedy_tree_matches_target_argmax_decoding_on_random_trees() -> None:
    """Context-dependent (bigram) target: the verdict is the greedy continuation, as deep as the tree allows."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab = 5
    for _ in range(200):
        table = torch.randn(vocab, vocab, generator=gen)  # row c: target logits after token c
        start = rng.randrange(vocab)
        best = [start]
        for _ in range(10):
            best.append(int(table[best[-1]].argmax()))
        tokens: list[int] = []
        parents: list[int] = []
        for _ in range(rng.randint(0, 9)):
            p = rng.randint(-1, len(tokens) - 1)
            want = best[_depth_of(parents, p) + 1]
            siblings = {tokens[j] for j in range(len(tokens)) if parents[j] == p}
            choices = [t for t in range(vocab) if t not in siblings]
            if choices:
                tokens.append(want if want in choices and rng.random() < 0.6 else rng.choice(choices))
                parents.append(p)
        tree = DraftTree(tuple(tokens), tuple(parents))
        v = verify_tree(table[[start, *tokens]], tree, GREEDY)
        paths = [[tree.tokens[k] for k in tree.path(n)] for n in range(len(tree))]
        deepest = max((len(path) for path in paths if path == best[1 : len(path) + 1]), default=0)
        assert v.accepted == deepest and v.tokens == best[1 : deepest + 2]
        assert [tokens[k] for k in v.path] == v.tokens[:-1]


def test_greedy_tau_accepts_a_near_argmax_child_only_when_relaxed() -> None:
    rows = torch.zeros(3, 8)
    rows[0, 3], rows[0, 4] = 2.0, 1.9  # child token 4 is just below the argmax 3
    tree = DraftTree((4, 6), (-1, -1))
    assert verify_tree(rows, tree, GREEDY).tokens == [3]
    assert verify_tree(rows, tree, GREEDY, tau=torch.tensor([0.0, 0.0])).tokens == [3]
    assert verify_tree(rows, tree, GREEDY, tau=torch.tensor([0.2, 0.0])).path == [0]
    assert verify_tree(rows, tree, GREEDY, tau=torch.tensor([0.0, 0.2])).tokens == [3]  # token 6 is far off


# --- chains reduce to verify_window -----------------------------------------------------------


@pytest.mark.parametrize(
    "params", [GREEDY, HOT, SamplingParams(temperature=0.7, top_k=5, top_p=0.8)], ids=["greedy", "t1", "warped"]
)
def test_chain_gives_verify_windows_verdict_for_the_same_draws(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(3)
    for trial in range(120):
        gamma = trial % 5
        logits = torch.randn(gamma + 1, 8, generator=gen) * 2
        q = torch.softmax(torch.randn(gamma, 8, generator=gen) * 2, -1)
        q = q if params.greedy else warp(torch.log(q), params)
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(gamma)]
        tau = None if trial % 3 else torch.rand(gamma, generator=gen, dtype=torch.float64) * 0.6
        for probs in (q, None):
            for seed in range(4):
                want = verify_window(logits, drafts, probs, params, torch.Generator().manual_seed(seed), tau)
                got = verify_tree(logits, DraftTree.as_chain(drafts, probs), params, torch.Generator().manual_seed(seed), tau)
                assert (got.accepted, got.tokens, got.path) == (want.accepted, want.tokens, list(range(want.accepted)))


def test_zero_tau_is_the_lossless_rule_with_the_same_draws() -> None:
    gen = torch.Generator().manual_seed(4)
    tree = DraftTree((5, 2, 7, 1, 4), (-1, -1, 0, 0, 3))
    q = torch.softmax(torch.randn(5, 8, generator=gen), -1)
    q[1], q[3] = q[0], q[2]
    for children in (Children.TOPK, Children.SAMPLED):
        t = DraftTree(tree.tokens, tree.parents, children, q)
        for seed in range(100):
            logits = torch.randn(6, 8, generator=gen)
            a = verify_tree(logits, t, HOT, torch.Generator().manual_seed(seed))
            b = verify_tree(logits, t, HOT, torch.Generator().manual_seed(seed), tau=torch.zeros(5))
            assert a == b


def test_full_tau_accepts_any_child_the_target_allows() -> None:
    logits = torch.zeros(6, 8)
    logits[0, 5] = -3.0  # p(5) small but positive
    logits[1, 7] = -math.inf  # node 0's child 7 has p = 0
    for seed in range(20):
        v = verify_tree(logits, TREE, HOT, torch.Generator().manual_seed(seed), tau=torch.ones(5))
        assert v.path[:2] == [0, 3]


def test_probability_rows_verify_like_log_probs_at_temperature_one() -> None:
    gen = torch.Generator().manual_seed(6)
    probs = warp(torch.randn(6, 8, generator=gen), SamplingParams(temperature=1.0, top_p=0.7))
    for seed in range(30):
        a = verify_tree(probs, TREE, SamplingParams(temperature=0.3, top_p=0.5), torch.Generator().manual_seed(seed), returns_probs=True)
        b = verify_tree(torch.log(probs), TREE, HOT, torch.Generator().manual_seed(seed))
        assert a == b
    best = [int(r.argmax()) for r in probs]
    assert verify_tree(probs, TREE, GREEDY, returns_probs=True).tokens[0] == best[0]


# --- sampling: the emitted tokens follow the target exactly -----------------------------------

V = 6
RUNS = 3000
_g = torch.Generator().manual_seed(21)
P_LOGITS = torch.randn(V, V, generator=_g) * 1.5  # bigram target: row c = logits after token c
Q_LOGITS = 0.5 * P_LOGITS + torch.randn(V, V, generator=_g) * 1.5  # a draft that often disagrees
# A context where the subtle rule-(b) mistakes (q_res(x) not zeroed, q_res not renormalised)
# move the first token's law by total variation ≈ 0.24 with three children: the test has power.
START = 3


class SampledTrees:
    """RUNS trees of one shape per context token, children drawn from q without replacement.

    Gumbel-top-k of log q gives the children of a node in draw order (the law of sequential
    draws without replacement); the trees are built only when used, each at most once.
    """

    def __init__(self, params: SamplingParams, shape: tuple[int, ...], seed: int) -> None:
        self.q = warp(Q_LOGITS, params).double()
        self.shape = shape
        g = torch.Generator().manual_seed(seed)
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(shape):
            kids.setdefault(p, []).append(i)
        self.tokens = []
        for ctx in range(V):
            tok = torch.zeros(RUNS, len(shape), dtype=torch.long)
            for parent in sorted(kids):
                ptok = torch.full((RUNS,), ctx) if parent < 0 else tok[:, parent]
                gumbel = -torch.log(-torch.log(torch.rand(RUNS, V, generator=g, dtype=torch.float64)))
                tok[:, kids[parent]] = torch.topk(torch.log(self.q[ptok]) + gumbel, len(kids[parent]), dim=1).indices
            self.tokens.append(tok.tolist())

    def __call__(self, ctx: int, run: int) -> DraftTree:
        t = self.tokens[ctx][run]
        q = self.q[[ctx if p < 0 else t[p] for p in self.shape]].float()
        return DraftTree(tuple(t), self.shape, Children.SAMPLED, q)


def _topk_trees(params: SamplingParams) -> list[DraftTree]:
    """One EAGLE-2 tree per context token, built on the draft's untempered distribution."""
    q_raw = torch.softmax(Q_LOGITS, -1)

    def step(tree: DraftTree, frontier: list[int]) -> torch.Tensor:
        return q_raw[[tree.tokens[f] for f in frontier]]

    return [expand_tree(q_raw[c], step, budget=7, depth=3, top_k=3, keep_q=True) for c in range(V)]


Verifier = Callable[[torch.Tensor, DraftTree, SamplingParams, torch.Generator], list[int]]


def _tree_verifier(rows: torch.Tensor, tree: DraftTree, params: SamplingParams, g: torch.Generator) -> list[int]:
    return verify_tree(rows, tree, params, g).tokens


def _chain_verifier(rows: torch.Tensor, tree: DraftTree, params: SamplingParams, g: torch.Generator) -> list[int]:
    return verify_window(rows, list(tree.tokens), tree.q, params, g).tokens


def _no_residual_verifier(rows: torch.Tensor, tree: DraftTree, params: SamplingParams, g: torch.Generator) -> list[int]:
    """WRONG on purpose: rule (c) without zeroing a rejected child, so the correction can repeat it."""
    out: list[int] = []
    node = -1
    while True:
        p = warp(rows[node + 1], params).double()
        for c in tree.children_of(node):
            if float(torch.rand((), generator=g, dtype=torch.float64)) < float(p[tree.tokens[c]]):
                out.append(tree.tokens[c])
                node = c
                break
        else:
            return out + [sample(p, g)]


def _as_sampled(tree: DraftTree) -> DraftTree:
    """WRONG on purpose: label deterministic top-k children as draws from q, so rule (b) runs on them."""
    return DraftTree(tree.tokens, tree.parents, Children.SAMPLED, tree.q)


def _emit_two(trees: Callable[[int, int], DraftTree], verifier: Verifier, params: SamplingParams, seed: int) -> torch.Tensor:
    """Counts [V, V] of the first two generated tokens over RUNS generations starting after START."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for r in range(RUNS):
        out: list[int] = []
        while len(out) < 2:
            ctx = START if not out else out[-1]
            tree = trees(ctx, r)
            out.extend(verifier(P_LOGITS[[ctx, *tree.tokens]], tree, params, g))
        counts[out[0], out[1]] += 1
    return counts


def _target_law(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    p = warp(P_LOGITS, params).double()
    return p[START], p[START][:, None] * p  # first token; joint of the first two


def _pvalues(counts: torch.Tensor, params: SamplingParams) -> tuple[float, float]:
    first, joint = _target_law(params)
    return chi2_pvalue(counts.sum(1), first), chi2_pvalue(counts, joint)


ALPHA = 1e-4
WARPED = SamplingParams(temperature=0.8, top_p=0.85)


@pytest.mark.parametrize("params", [HOT, WARPED], ids=["t1", "top-p"])
def test_topk_tree_rule_c_emits_the_target_distribution(params: SamplingParams) -> None:
    trees = _topk_trees(params)
    counts = _emit_two(lambda ctx, r: trees[ctx], _tree_verifier, params, seed=1)
    p1, p2 = _pvalues(counts, params)
    assert p1 > ALPHA and p2 > ALPHA, (p1, p2)


def test_sampled_tree_rule_b_emits_the_target_distribution() -> None:
    counts = _emit_two(SampledTrees(HOT, (-1, -1, -1, 0, 0, 1, 3), seed=2), _tree_verifier, HOT, seed=3)
    p1, p2 = _pvalues(counts, HOT)
    assert p1 > ALPHA and p2 > ALPHA, (p1, p2)


def test_chain_verifier_passes_the_same_test() -> None:
    counts = _emit_two(SampledTrees(HOT, (-1, 0, 1), seed=4), _chain_verifier, HOT, seed=5)
    p1, p2 = _pvalues(counts, HOT)
    assert p1 > ALPHA and p2 > ALPHA, (p1, p2)


def test_wrong_rules_fail_the_same_test() -> None:
    """The test can fail: a missing residual update, or rule (b) on deterministic children, is caught."""
    trees = _topk_trees(HOT)
    counts = _emit_two(lambda ctx, r: trees[ctx], _no_residual_verifier, HOT, seed=1)
    assert max(_pvalues(counts, HOT)) < 1e-6
    wrong = [_as_sampled(t) for t in trees]
    counts = _emit_two(lambda ctx, r: wrong[ctx], _tree_verifier, HOT, seed=1)
    assert max(_pvalues(counts, HOT)) < 1e-6


def test_rule_c_accepts_some_root_child_with_the_targets_mass_on_them() -> None:
    """P(a child of the root is accepted) = Σ p(children): the cover property of rule (c)."""
    tree = _topk_trees(HOT)[START]
    rows = P_LOGITS[[START, *tree.tokens]]
    g = torch.Generator().manual_seed(8)
    hits = sum(verify_tree(rows, tree, HOT, g).accepted > 0 for _ in range(RUNS))
    p = warp(P_LOGITS[START], HOT).double()
    expected = float(sum(p[tree.tokens[c]] for c in tree.children_of(-1)))
    sd = math.sqrt(expected * (1 - expected) / RUNS)
    assert abs(hits / RUNS - expected) < 4 * sd


# --- EAGLE-2 expansion --------------------------------------------------------------------------
