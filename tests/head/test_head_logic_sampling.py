"""Sampling warps: identical to HF generate's warpers, greedy tie rule, validation, the sampler."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dsd.node.head.sampling import SamplingParams, sample, softmax, warp

torch.set_num_threads(1)


def hf_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities HF generate samples from (its warper order: temperature, top-k, top-p)."""
    scores = logits.float()
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k:
        scores = TopKLogitsWarper(top_k=p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(top_p=p.top_p)(ids, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.5),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(temperature=0.5, top_p=0.01),
    ],
)
def test_warp_equals_hf_warpers(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=gen) * 3
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1  # a tie at the top
    logits[1, :] = torch.round(logits[1])  # many ties
    ours = warp(logits, params)
    ref = hf_probs(logits, params)
    assert ours.dtype == torch.float32
    # HF keeps an arbitrary one of several tokens tied at the nucleus boundary (sort order);
    # we keep them all, so with top-p only tie-free rows must agree exactly.
    rows = slice(2, None) if params.top_p < 1.0 else slice(None)
    assert torch.equal(ours[rows] > 0, ref[rows] > 0), "support differs from HF"
    assert torch.allclose(ours[rows], ref[rows], atol=1e-6)
    assert torch.allclose(ours.sum(-1), torch.ones(6), atol=1e-5)


def test_top_p_keeps_every_token_tied_at_the_boundary() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1], [0.5, 0.5, 0.0, 0.0, 0.0]]) + 1e-12)
    probs = warp(logits, SamplingParams(temperature=1.0, top_p=0.5))
    # Row 0: 0.4 < 0.5, so the next rank is needed; tokens 1 and 2 tie there and both stay.
    assert (probs[0] > 0).tolist() == [True, True, True, False, False]
    assert (probs[1] > 0).tolist() == [True, True, False, False, False]
    assert torch.allclose(probs[0, :3], torch.tensor([0.5, 0.25, 0.25]))


def test_top_p_on_a_large_flat_vocabulary_uses_the_full_sort_path() -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 20_000, generator=gen) * 0.3
    params = SamplingParams(temperature=1.0, top_p=0.9)
    ours, ref = warp(logits, params), hf_probs(logits, params)
    assert int((ours[0] > 0).sum()) > 2048  # beyond the top-k fast path
    assert torch.equal(ours > 0, ref > 0)
    assert torch.allclose(ours, ref, atol=1e-7)


def test_greedy_is_one_hot_at_first_maximum() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0], [-3.0, -2.0, -1.0, -1.0]])
    probs = warp(logits, SamplingParams())
    assert probs.tolist() == [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]]
    assert torch.equal(probs.argmax(-1), torch.argmax(logits, dim=-1))


def test_warp_keeps_leading_shape_and_bf16_input() -> None:
    logits = torch.randn(2, 3, 11).to(torch.bfloat16)
    out = warp(logits, SamplingParams(temperature=1.0, top_k=3))
    assert out.shape == (2, 3, 11) and out.dtype == torch.float32
    assert ((out > 0).sum(-1) >= 3).all()


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_params_are_validated(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kwargs)


def test_bad_logits_are_refused() -> None:
    with pytest.raises(ValueError, match="NaN"):
        warp(torch.tensor([[0.0, float("nan")]]), SamplingParams(temperature=1.0))
    with pytest.raises(ValueError, match="floating"):
        warp(torch.tensor([[1, 2]]), SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        softmax(torch.zeros(3, 0))


def test_sample_consumes_one_draw_and_avoids_zero_mass() -> None:
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    g1 = torch.Generator().manual_seed(7)
    g2 = torch.Generator().manual_seed(7)
    seen = set()
    for _ in range(400):
        seen.add(sample(probs, g1))
        torch.rand((), generator=g2, dtype=torch.float64)
    assert seen == {1, 3}
    assert torch.equal(g1.get_state(), g2.get_state())


def test_sample_frequencies_and_unnormalised_input() -> None:
    probs = torch.tensor([1.0, 3.0, 0.0, 4.0])  # unnormalised: 1/8, 3/8, 0, 1/2
    g = torch.Generator().manual_seed(3)
    counts = torch.zeros(4)
    for _ in range(4000):
        counts[sample(probs, g)] += 1
    freq = counts / counts.sum()
    assert freq[2] == 0
    assert torch.allclose(freq, probs / probs.sum(), atol=0.03)


def test_sample_refuses_empty_or_massless() -> None:
    with pytest.raises(ValueError, match="mass"):
        sample(torch.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        sample(torch.ones(2, 2))
