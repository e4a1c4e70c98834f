"""Adaptive verification: τ_max = 0 is exactly lossless; τ is bounded, strict on important tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch

from dsd.node.head.adaptive import AdaptiveVerifier
from dsd.node.head.sampling import SamplingParams, warp
from dsd.node.head.verify import verify_window

torch.set_num_threads(1)
GREEDY = SamplingParams()
SAMPLE = SamplingParams(temperature=1.0, top_k=6)


@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
def test_tau_max_zero_gives_identical_verdicts_and_draws(params: SamplingParams) -> None:
    ad = AdaptiveVerifier(tau_max=0.0, params=params)
    ad.match_rate = 1.0  # even a perfect track record must not relax anything
    rng = random.Random(1)
    data = torch.Generator().manual_seed(2)
    for trial in range(400):
        gamma = rng.randint(0, 5)
        tl = torch.randn(gamma + 1, 8, generator=data) * 2
        q = warp(torch.randn(gamma, 8, generator=data) * 2, params) if gamma else torch.zeros(0, 8)
        drafts = torch.randint(0, 8, (gamma,), generator=data).tolist()
        if not params.greedy:
            drafts = [int(torch.multinomial(q[i], 1, generator=data)) for i in range(gamma)]
        if not params.greedy:
            q_use = q
        else:
            q_use = None if trial % 2 else torch.softmax(torch.randn(gamma, 8, generator=data), -1)
        tau = ad.taus(tl, q_use, drafts)
        assert tau.shape == (gamma,) and bool((tau == 0).all())
        g1, g2 = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        lossless = verify_window(tl, drafts, q_use, params, g1)
        relaxed = verify_window(tl, drafts, q_use, params, g2, tau=tau)
        assert lossless == relaxed
        assert torch.equal(g1.get_state(), g2.get_state())
        ad.observe(tl, q_use, drafts, lossless.accepted)


@pytest.mark.parametrize("params", [GREEDY, SAMPLE], ids=["greedy", "sampling"])
def test_tau_is_within_bounds(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(3)
    for tau_max in (0.1, 0.5, 1.0):
        ad = AdaptiveVerifier(tau_max=tau_max, params=params)
        ad.match_rate = 1.0
        for _ in range(50):
            tl = torch.randn(5, 16, generator=gen) * 4
            tl[0, :8] = float("-inf")  # masked vocabulary entries
            q = warp(torch.randn(4, 16, generator=gen) * 4, SAMPLE)
            drafts = torch.randint(0, 16, (4,), generator=gen).tolist()
            for qq in (q, None):
                tau = ad.taus(tl, qq, drafts)
                assert tau.shape == (4,)
                assert bool(torch.isfinite(tau).all())
                assert bool(((tau >= 0) & (tau <= tau_max)).all())


def test_formula_on_a_hand_computed_position() -> None:
    ad = AdaptiveVerifier(tau_max=0.5)
    ad.match_rate = 0.8
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([[0.25, 0.5, 0.25]])
    tau = ad.taus(torch.log(p)[None], q, [1])
    entropy = -(p * p.log()).sum()
    contrast = max(0.0, -math.log(0.25) - float(entropy))
    expected = 0.5 * 0.8 * (0.25 + 0.25 + 0.25) * math.exp(-contrast)
    assert float(tau[0]) == pytest.approx(expected, rel=1e-6)


def test_confident_target_disagreeing_gets_tau_near_zero() -> None:
    ad = AdaptiveVerifier(tau_max=0.9)
    ad.match_rate = 1.0
    tl = torch.zeros(2, 10)
    tl[0, 4] = 12.0  # the target is sure of token 4
    q = torch.full((1, 10), 0.01)
    q[0, 7] = 0.91  # the draft is sure of token 7
    tau = ad.taus(tl, q, [7])
    assert float(tau[0]) < 1e-3 * ad.tau_max
    # ...and even the loosest relaxation keeps the target's choice there.
    v = verify_window(tl, [7], q, GREEDY, None, tau=tau)
    assert v.tokens == [4]


def test_flat_target_agreeing_draft_gets_large_tau() -> None:
    ad = AdaptiveVerifier(tau_max=0.5)
    ad.match_rate = 1.0
    tl = torch.tensor([[1.0, 1.0, 0.9, 0.95, -5.0, -5.0]])
    p = torch.softmax(tl, -1)
    tau = ad.taus(tl, p, [2])
    assert float(tau[0]) > 0.9 * ad.tau_max


def test_tau_grows_with_match_rate_and_observe_tracks_it() -> None:
    ad = AdaptiveVerifier(tau_max=0.5, match_decay=0.5, match_prior=0.5)
    tl = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [1.0, 0.0, 2.0]])
    q = torch.softmax(tl[:2], -1)
    before = ad.taus(tl, q, [0, 1])
    ad.observe(tl, q, [0, 1])  # both top-1 agree
    assert ad.match_rate == pytest.approx(0.875)
    after = ad.taus(tl, q, [0, 1])
    assert bool((after > before).all())
    ad.observe(tl, None, [2, 2])  # deterministic drafter: its token is its top-1; both disagree
    assert ad.match_rate == pytest.approx(0.875 * 0.25)
    ad.observe(tl, None, [0, 2, 0], accepted=0)  # only the first (rejected) position counts
    assert ad.match_rate == pytest.approx(0.875 * 0.25 * 0.5 + 0.5)


def test_relaxed_greedy_accepts_near_ties_only() -> None:
    tl = torch.tensor([[2.0, 1.95, -3.0, -3.0], [0.0, 0.0, 0.0, 0.0]])
    assert verify_window(tl, [1], None, GREEDY, None).accepted == 0
    assert verify_window(tl, [1], None, GREEDY, None, tau=torch.tensor([0.1])).accepted == 1
    assert verify_window(tl, [2], None, GREEDY, None, tau=torch.tensor([0.1])).accepted == 0


def test_relaxed_sampling_accepts_more_on_low_importance_tokens() -> None:
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(4)
    tl = torch.randn(2, 8, generator=gen) * 0.5  # flat-ish target: low importance
    q = warp(torch.randn(1, 8, generator=gen), params)
    ad = AdaptiveVerifier(tau_max=0.6, params=params)
    ad.match_rate = 1.0
    draws = 3000
    xs = torch.multinomial(q[0], draws, replacement=True, generator=gen).tolist()
    strict = relaxed = 0
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    taus = {x: ad.taus(tl, q, [x]) for x in range(8)}
    for x in xs:
        tau = taus[x]
        strict += verify_window(tl, [x], q, params, g1).accepted
        relaxed += verify_window(tl, [x], q, params, g2, tau=tau).accepted
    assert relaxed > strict * 1.05


def test_relaxed_sampling_never_accepts_tokens_outside_the_target_support() -> None:
    params = SamplingParams(temperature=1.0, top_k=2)
    tl = torch.tensor([[3.0, 2.9, 2.8, -1.0], [0.0, 0.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    for s in range(200):
        v = verify_window(tl, [2], q, params, torch.Generator().manual_seed(s), tau=torch.tensor([1.0]))
        assert v.accepted == 0 and v.tokens[0] in (0, 1)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="tau_max"):
        AdaptiveVerifier(tau_max=1.5)
    with pytest.raises(ValueError, match="tau_max"):
        AdaptiveVerifier(tau_max=-0.1)
    ad = AdaptiveVerifier(tau_max=0.3)
    with pytest.raises(ValueError, match="rows"):
        ad.taus(torch.zeros(1, 4), None, [0, 1])
    with pytest.raises(ValueError, match="draft_probs"):
        ad.taus(torch.zeros(3, 4), torch.zeros(2, 5), [0, 1])
    with pytest.raises(ValueError, match="accepted"):
        ad.observe(torch.zeros(3, 4), None, [0, 1], accepted=3)
