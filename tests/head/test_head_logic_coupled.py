"""Drafter-invariant sampling by Gumbel-max coupling (docs/sampling.md): the noise is keyed by (seed, position)
and Gumbel-max draws follow p; the chain and tree rules emit the target's own draws whatever was drafted; a
sampled tree always holds the draft's own draw; and what the coupling costs in acceptance against the standard
rule, exactly, on random distributions and on the tiny target with its noisy draft."""

from __future__ import annotations

import math
import random

import pytest
import torch
from support.sampling import chi2_pvalue

from dsd.node.head.config import GenerationConfig
from dsd.node.head.draft_tree import Children, DraftTree
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.drafting import Drafting
from dsd.node.head.report import TimeBreakdown
from dsd.node.head.sampling import (
    GumbelNoise,
    SamplingParams,
    coupled_dist,
    coupled_token,
    gumbel,
    warp,
)
from dsd.node.head.tree_verify import verify_tree
from dsd.node.head.verify import verify_window

torch.set_num_threads(1)
HOT = SamplingParams(temperature=1.0)
WARM = SamplingParams(temperature=0.8)
NUCLEUS = SamplingParams(temperature=0.8, top_p=0.9)


# --- the noise ----------------------------------------------------------------------------------


def test_noise_is_keyed_by_seed_and_position() -> None:
    a = gumbel(3, 10, 50)
    assert a.dtype == torch.float32 and a.shape == (50,) and bool(torch.isfinite(a).all())
    assert torch.equal(a, gumbel(3, 10, 50))
    assert not torch.equal(a, gumbel(3, 11, 50))
    assert not torch.equal(a, gumbel(4, 10, 50))
    # Every bit of a 64-bit seed counts (torch's CPU generator would keep only the low 32).
    assert not torch.equal(gumbel(1, 5, 50), gumbel(1 + 2**32, 5, 50))
    assert torch.equal(gumbel(-1, 5, 50), gumbel(2**64 - 1, 5, 50))  # seeds are taken mod 2^64
    with pytest.raises(ValueError, match="pos"):
        gumbel(0, -1, 50)
    with pytest.raises(ValueError, match="vocab"):
        gumbel(0, 0, 0)


def test_noise_of_a_generation_is_cached_for_a_few_positions() -> None:
    noise = GumbelNoise(9, cache=4)
    first = noise(100, 30)
    assert torch.equal(first, gumbel(9, 100, 30)) and noise(100, 30) is first
    for pos in range(101, 110):
        assert torch.equal(noise(pos, 30), gumbel(9, pos, 30))
    assert len(noise) == 4  # only the most recent vectors are held
    assert torch.equal(noise(100, 30), first) and noise(100, 30) is not first  # recomputed, the same


def test_noise_is_standard_gumbel() -> None:
    g = gumbel(5, 0, 400_000).double()
    assert abs(float(g.mean()) - 0.5772157) < 0.01  # Euler–Mascheroni
    assert abs(float(g.var()) - math.pi**2 / 6) < 0.02
    u = torch.exp(-torch.exp(-g))  # back to the uniforms: their deciles are flat
    assert chi2_pvalue(torch.histc(u, bins=10, min=0.0, max=1.0), torch.ones(10)) > 1e-3


@pytest.mark.parametrize("params", [HOT, SamplingParams(temperature=0.7, top_k=5), NUCLEUS], ids=["t1", "top-k", "top-p"])
def test_gumbel_max_draws_follow_p_over_seeds_and_over_positions(params: SamplingParams) -> None:
    logits = torch.randn(12, generator=torch.Generator().manual_seed(1)) * 1.5
    p = warp(logits, params)
    draws = 4000
    over_seeds = torch.bincount(torch.tensor([coupled_token(logits, params, gumbel(s, 7, 12)) for s in range(draws)]),
                                minlength=12)
    over_positions = torch.bincount(torch.tensor([coupled_token(logits, params, gumbel(7, pos, 12))
                                                  for pos in range(draws)]), minlength=12)
    for counts in (over_seeds, over_positions):  # tokens outside the top-k / nucleus are never drawn (checked there)
        assert chi2_pvalue(counts, p) > 1e-3, (counts.tolist(), p.tolist())


# --- the chain rule -------------------------------------------------------------------------------


def _targets(logits: torch.Tensor, params: SamplingParams, seed: int, start: int) -> list[int]:
    """The target's own draws at each row: argmax(log warp(row) + G_{start + i})."""
    return [int(torch.argmax(torch.log(warp(row, params)) + gumbel(seed, start + i, row.numel())))
            for i, row in enumerate(logits)]


@pytest.mark.parametrize("params", [WARM, NUCLEUS], ids=["t0.8", "top-p"])
def test_chain_keeps_the_drafts_equal_to_the_targets_draws_and_emits_its_draw(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(2)
    rng = random.Random(2)
    for trial in range(200):
        gamma = trial % 6
        logits = torch.randn(gamma + 1, 10, generator=gen) * 2
        start = rng.randrange(1, 500)
        want = _targets(logits, params, seed=trial, start=start)
        drafts = [t if rng.random() < 0.7 else rng.randrange(10) for t in want[:gamma]]
        q = torch.softmax(torch.randn(gamma, 10, generator=gen), -1)  # not used by the rule
        v = verify_window(logits, drafts, q, params, noise=GumbelNoise(trial), start=start)
        k = next((i for i, (d, t) in enumerate(zip(drafts, want, strict=False)) if d != t), gamma)
        assert (v.accepted, v.tokens) == (k, want[: k + 1])  # a prefix of the target's own draws, whatever was drafted
        assert v == verify_window(logits, drafts, None, params, noise=GumbelNoise(trial), start=start)


def test_greedy_ignores_the_noise_and_the_relaxed_rule_refuses_it() -> None:
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(3))
    best = logits.argmax(-1).tolist()
    assert verify_window(logits, best[:2], None, SamplingParams(), noise=GumbelNoise(1), start=4).tokens == best
    with pytest.raises(ValueError, match="lossless only"):
        verify_window(logits, best[:2], None, WARM, tau=torch.zeros(2), noise=GumbelNoise(1), start=4)
    with pytest.raises(ValueError, match="lossless only"):
        verify_tree(logits, DraftTree.as_chain(best[:2]), WARM, tau=torch.zeros(2), noise=GumbelNoise(1), start=4)


# --- the tree rule --------------------------------------------------------------------------------


def _depth(parents: list[int], node: int) -> int:
    d = 0
    while node >= 0:
        d, node = d + 1, parents[node]
    return d


@pytest.mark.parametrize("params", [WARM, NUCLEUS], ids=["t0.8", "top-p"])
def test_tree_walk_follows_the_targets_draws_on_random_trees(params: SamplingParams) -> None:
    """Bigram target: the verdict is the target's own sampled continuation, as deep as the tree holds it."""
    rng = random.Random(4)
    gen = torch.Generator().manual_seed(4)
    vocab = 5
    for trial in range(200):
        table = torch.randn(vocab, vocab, generator=gen) * 2  # row c: target logits after token c
        first, start = rng.randrange(vocab), rng.randrange(1, 300)
        want = [first]
        for d in range(10):
            want.append(coupled_token(table[want[-1]], params, gumbel(trial, start + d, vocab)))
        tokens: list[int] = []
        parents: list[int] = []
        for _ in range(rng.randint(0, 9)):
            p = rng.randint(-1, len(tokens) - 1)
            siblings = {tokens[j] for j in range(len(tokens)) if parents[j] == p}
            choices = [t for t in range(vocab) if t not in siblings]
            good = want[_depth(parents, p) + 1]
            if choices:
                tokens.append(good if good in choices and rng.random() < 0.6 else rng.choice(choices))
                parents.append(p)
        for children in (Children.TOPK, Children.SAMPLED):
            q = torch.full((len(tokens), vocab), 1 / vocab)
            tree = DraftTree(tuple(tokens), tuple(parents), children, q)
            v = verify_tree(table[[first, *tokens]], tree, params, noise=GumbelNoise(trial), start=start)
            paths = [[tree.tokens[k] for k in tree.path(n)] for n in range(len(tree))]
            deepest = max((len(path) for path in paths if path == want[1 : len(path) + 1]), default=0)
            assert v.accepted == deepest and v.tokens == want[1 : deepest + 2]
            assert [tokens[k] for k in v.path] == v.tokens[:-1]


def test_a_chain_through_the_tree_rule_gives_the_chain_rules_verdict() -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(100):
        gamma = trial % 5
        logits = torch.randn(gamma + 1, 8, generator=gen) * 2
        want = _targets(logits, WARM, seed=trial, start=20)
        drafts = [t if trial % 3 else (t + 1) % 8 for t in want[:gamma]]
        a = verify_window(logits, drafts, None, WARM, noise=GumbelNoise(trial), start=20)
        b = verify_tree(logits, DraftTree.as_chain(drafts), WARM, noise=GumbelNoise(trial), start=20)
        assert (b.accepted, b.tokens, b.path) == (a.accepted, a.tokens, list(range(a.accepted)))


def test_probability_rows_use_the_same_rule_on_their_log() -> None:
    probs = warp(torch.randn(6, 8, generator=torch.Generator().manual_seed(6)), SamplingParams(temperature=0.7))
    tree = DraftTree((5, 2, 7, 1, 4), (-1, -1, 0, 0, 3))
    for seed in range(30):
        a = verify_tree(probs, tree, WARM, returns_probs=True, noise=GumbelNoise(seed), start=9)
        b = verify_tree(torch.log(probs), tree, HOT, noise=GumbelNoise(seed), start=9)
        assert a == b and a.tokens[0] == coupled_token(torch.log(probs[0]), HOT, gumbel(seed, 9, 8))


# --- drafting: the draft's draw, and tree children on the perturbed scores --------------------------


def test_sampled_trees_hold_the_drafts_own_draw_first_under_every_expanded_node(noisy_draft) -> None:
    params = WARM
    noise = GumbelNoise(11)
    drafter = ModelDrafter(noisy_draft, params, noise)
    drafting = Drafting(drafter, GenerationConfig(params=params), TimeBreakdown(), coupled=noise)
    context = [1, 17, 42, 99, 5, 17, 42]
    tree, _ = drafting._expand(context, nodes=20, depth=4)
    assert tree.children is Children.TOPK and len(tree) == 20
    with torch.inference_mode():
        for node in [-1, *range(len(tree))]:
            kids = tree.children_of(node)
            if not kids:
                continue
            ctx = context + [tree.tokens[j] for j in tree.path(node)]
            q = warp(noisy_draft(torch.tensor([ctx])).logits[0, -1].float(), params)
            g = gumbel(11, len(ctx), q.numel())
            assert tree.tokens[kids[0]] == int(torch.argmax(torch.log(q) + g)), node  # the draft's Gumbel-max draw
            assert torch.allclose(tree.q[kids[0]], coupled_dist(q, g), atol=1e-4)  # rows are the coupled rows
    drafts, _ = drafter.propose(context, 4)
    assert drafts[0] == tree.tokens[tree.children_of(-1)[0]]  # a chain drafts the same draw


# --- the cost: acceptance under Gumbel coupling against the standard rule ----------------------------


def coupled_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax(log p + G) == argmax(log q + G)) exactly: Σ_x 1 / Σ_y max(p_y/p_x, q_y/q_x) over the common
    support (the token x wins both races of exponential clocks E_y/p_y and E_y/q_y)."""
    p, q = p.double(), q.double()
    both = (p > 0) & (q > 0)
    px, qx = p[both], q[both]
    ratio = torch.maximum(p[None, :] / px[:, None], q[None, :] / qx[:, None])
    return float((1.0 / ratio.sum(1)).sum())


def test_coupled_agreement_formula_and_its_bounds() -> None:
    """Monte Carlo agrees with the formula, which sits between (1 − δ)/(1 + δ) (Daliri et al.) and the
    standard rule's 1 − δ = Σ min(p, q) (δ: total variation)."""
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        p = torch.softmax(torch.randn(6, generator=gen) * 2, -1)
        q = torch.softmax(torch.randn(6, generator=gen) * 2, -1)
        exact = coupled_agreement(p, q)
        standard = float(torch.minimum(p, q).sum())
        tv = 1.0 - standard
        assert (1 - tv) / (1 + tv) - 1e-9 <= exact <= standard + 1e-9
        if trial < 4:
            runs = 4000
            hits = sum(int(torch.argmax(torch.log(p) + g)) == int(torch.argmax(torch.log(q) + g))
                       for g in (gumbel(trial, pos, 6) for pos in range(runs)))
            assert abs(hits / runs - exact) < 4 * math.sqrt(exact * (1 - exact) / runs) + 1e-9


@pytest.mark.parametrize("params", [HOT, WARM], ids=["t1", "t0.8"])
def test_acceptance_cost_on_the_tiny_target_and_its_noisy_draft(tiny_qwen2_hf, noisy_draft, params: SamplingParams) -> None:
    """Per position along 64 sampled tokens: the chance a draft is accepted under both rules (printed)."""
    seq = [1, 17, 42, 99, 5, 17, 42]
    standard, coupled = [], []
    with torch.inference_mode():
        for pos in range(len(seq), len(seq) + 64):
            p = warp(tiny_qwen2_hf(torch.tensor([seq])).logits[0, -1].float(), params)
            q = warp(noisy_draft(torch.tensor([seq])).logits[0, -1].float(), params)
            standard.append(float(torch.minimum(p, q).sum()))
            coupled.append(coupled_agreement(p, q))
            seq.append(coupled_token(torch.log(p), HOT, gumbel(0, pos, p.numel())))
    s, c = sum(standard) / len(standard), sum(coupled) / len(coupled)
    print(f"\nT={params.temperature}: accepted per draft, standard rule {s:.3f}, Gumbel coupling {c:.3f} "
          f"(ratio {c / s:.3f})")
    assert all(b / (2 - b) - 1e-9 <= a <= b + 1e-9 for a, b in zip(coupled, standard, strict=True))
    assert 0.8 * s < c <= s
