"""Speculative sampling through the whole engine is lossless at temperature 1: over thousands of seeds,
the first generated token and the first two follow the target's own distribution (chi-square), in
`sd`, in `sd` with token-tree windows (the draft's top 4 as siblings, rule (c)) and in `dsd` (with
pre-drafted windows reused), while a deliberately broken verifier fails the same test, for chains and
for trees.

A tiny 1-layer target and a different tiny draft (vocabulary 12) keep every run to a few ms; the
exact target distribution is computed by running the target on the prompt and on prompt + each
first token. Seeds are fixed, so the outcome is deterministic."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import trio
from support.sampling import (
    SAMPLING_ALPHA,
    SAMPLING_BROKEN_RUNS,
    SAMPLING_PROMPT,
    SAMPLING_RUNS,
    SAMPLING_TREE_NODES,
    T1,
    chi2_pvalue,
    pair_counts,
    sampling_p_values,
)

from dsd.node.head import engine as engine_module
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.local import LocalBackend
from dsd.node.head.sampling import SamplingParams, sample, warp
from dsd.node.head.tree_verify import TreeVerdict
from dsd.node.head.verify import Verdict, verify_window
from dsd.shard_store import HeadModule, SpanModule


class BoundedDrafter(ModelDrafter):
    """A model drafter that pre-drafts at most `limit` batched steps per generation (outcome branches
    get no token after that: the engine drops them) and counts the steps it made."""

    def __init__(self, model: torch.nn.Module, params: SamplingParams, generator: torch.Generator, limit: int) -> None:
        super().__init__(model, params, generator)
        self.limit = limit
        self.steps = 0

    def step_many(self, contexts: Sequence[Sequence[int]]) -> list[tuple[int | None, torch.Tensor | None]]:
        if self.steps >= self.limit:
            return [(None, None)] * len(contexts)
        self.steps += 1
        return list(super().step_many(contexts))


class HeldBackend(LocalBackend):
    """The whole target in-process, but the prompt's result lands only once the drafter has made its
    pre-drafting steps.

    In-process the result is ready at once, so `dsd` would never hold a drafted branch when the
    verdict arrives; holding it like a slow route makes reused branches happen. With the drafter's
    steps bounded, how far the branches get never depends on timing: every run is deterministic.
    """

    def __init__(self, head: HeadModule, spans: Sequence[SpanModule], drafter: BoundedDrafter, hold: bool) -> None:
        super().__init__(head, spans)
        self.drafter = drafter
        self.hold = hold

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        if self.hold:
            with trio.fail_after(10):
                while self.drafter.steps < self.drafter.limit:
                    await trio.sleep(0.0005)
            self.hold = False
        return await super().collect(epoch=epoch, rows=rows)


def generate_many(sampling_models, mode: str, runs: int, tree_nodes: int = 0) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The first two tokens of `runs` generations (seed i for the engine, 10**6 + i for the drafter), and
    those of the runs whose second window was a pre-drafted branch (with `tree_nodes`: a tree window)."""
    head, span, draft, _ = sampling_models

    async def main() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        pairs: list[tuple[int, int]] = []
        reused: list[tuple[int, int]] = []
        for seed in range(runs):
            # dsd: while the prompt is in flight, one step for the main branch's root (the bet on the
            # first token; alternatives join it), one for each branch's draft token.
            drafter = BoundedDrafter(draft, T1, torch.Generator().manual_seed(10**6 + seed), limit=2)
            backend = HeldBackend(head, [span], drafter, hold=mode == "dsd")
            # Three tokens: the prompt's result gives the first; the second window carries one draft
            # (none would be drafted for a last token), so the second token is a verified one.
            cfg = GenerationConfig(mode=mode, max_new_tokens=3, params=T1, gamma=1, seed=seed, tree_nodes=tree_nodes)
            result = await HeadEngine(backend, drafter, cfg).run(SAMPLING_PROMPT)
            pairs.append((result.tokens[0], result.tokens[1]))
            if result.ready_rounds or result.tree_windows:
                reused.append(pairs[-1])
        return pairs, reused

    return trio.run(main)


def p_second_given_first(sampling_models, pairs: list[tuple[int, int]]) -> float:
    """p-value of the second tokens against the target's, given the first tokens seen (a conservative
    test: the expected counts are sums of the rows' multinomials)."""
    joint = sampling_models[3]
    second = joint / joint.sum(1, keepdim=True)
    counts = pair_counts(pairs)
    return chi2_pvalue(counts.sum(0), (counts.sum(1).double()[:, None] * second).sum(0))


@pytest.mark.parametrize("mode", ["sd", "sd-tree", "dsd"])
def test_first_tokens_follow_the_target_distribution(sampling_models, mode: str) -> None:
    tree = mode == "sd-tree"
    pairs, reused = generate_many(sampling_models, "sd" if tree else mode, SAMPLING_RUNS, SAMPLING_TREE_NODES if tree else 0)
    p_first, p_joint = sampling_p_values(sampling_models, pairs)
    print(f"\n{mode}: p(first) = {p_first:.3g}, p(first two) = {p_joint:.3g}, reused windows {len(reused)}/{SAMPLING_RUNS}")
    assert p_first > SAMPLING_ALPHA and p_joint > SAMPLING_ALPHA
    if tree:
        assert len(reused) == SAMPLING_RUNS  # every second window went out as a tree of SAMPLING_TREE_NODES siblings
    elif mode == "sd":
        assert not reused
    else:
        # A branch is reused when the target's first token is one of the draft's guesses (about 1 in 4
        # here); the second tokens drawn from those reused windows follow the target too.
        assert len(reused) > SAMPLING_RUNS // 10
        p_reused = p_second_given_first(sampling_models, reused)
        print(f"dsd, reused windows only: p(second | first) = {p_reused:.3g}")
        assert p_reused > SAMPLING_ALPHA


def accept_every_draft(target_logits, draft_tokens, draft_probs, params, generator=None, tau=None) -> Verdict:
    """A broken rule: keep every draft, then the bonus token."""
    nxt = sample(warp(target_logits, params)[len(draft_tokens)], generator)
    return Verdict(len(draft_tokens), nxt, [*draft_tokens, nxt])


def skip_the_residual(target_logits, draft_tokens, draft_probs, params, generator=None, tau=None) -> Verdict:
    """A broken rule: after a rejection, sample the correction from p instead of norm(max(0, p - q))."""
    verdict = verify_window(target_logits, draft_tokens, draft_probs, params, generator, tau)
    k = verdict.accepted
    if k == len(draft_tokens):
        return verdict
    nxt = sample(warp(target_logits, params)[k], generator)
    return Verdict(k, nxt, [*draft_tokens[:k], nxt])


def no_elimination(target, tree, params, generator=None, tau=None, **_) -> TreeVerdict:
    """A broken tree rule (for the star trees of this test): try the root's children with p(x) but never
    remove a rejected child from p, so the correction may repeat a rejected child."""
    p = warp(target[0], params).double()
    for c in tree.children_of(-1):
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[tree.tokens[c]]):
            nxt = sample(warp(target[c + 1], params), generator)
            return TreeVerdict(accepted=1, next_token=nxt, tokens=[tree.tokens[c], nxt], path=[c])
    nxt = sample(p, generator)
    return TreeVerdict(accepted=0, next_token=nxt, tokens=[nxt], path=[])


@pytest.mark.parametrize("broken", [accept_every_draft, skip_the_residual, no_elimination], ids=lambda f: f.__name__)
def test_a_broken_rule_fails_the_same_test(sampling_models, monkeypatch: pytest.MonkeyPatch, broken) -> None:
    tree = broken is no_elimination
    monkeypatch.setattr(engine_module, "verify_tree" if tree else "verify_window", broken)
    pairs, _ = generate_many(sampling_models, "sd", SAMPLING_BROKEN_RUNS, SAMPLING_TREE_NODES if tree else 0)
    p_first, p_joint = sampling_p_values(sampling_models, pairs)
    print(f"\n{broken.__name__}: p(first) = {p_first:.3g}, p(first two) = {p_joint:.3g}")
    assert p_first > SAMPLING_ALPHA  # the first token is sampled from the prompt's logits: no draft involved
    assert p_joint < SAMPLING_ALPHA
