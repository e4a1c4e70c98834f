"""Lossless sampling through the engine: a tiny 1-layer target and another draft (vocabulary 12), the exact law
of the first two tokens, and a chi-square test against it."""

from __future__ import annotations

import torch

from dsd.node.head.sampling import SamplingParams


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value; cells expecting < 5 draws are pooled into one."""
    probs = probs.double().flatten() / probs.double().sum()
    counts = counts.double().flatten()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"emitted tokens outside the target support: {counts.tolist()}"
    expected = n * probs
    big = expected >= 5
    small = support & ~big
    obs = counts[big].tolist()
    exp = expected[big].tolist()
    if small.any():
        obs.append(float(counts[small].sum()))
        exp.append(float(expected[small].sum()))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(obs) - 1
    if dof == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))


SAMPLING_VOCAB = 12


SAMPLING_PROMPT = [1, 5, 7]


SAMPLING_RUNS = 2000  # a correct rule passes at alpha; each broken rule fails at 1200 already (below)


SAMPLING_BROKEN_RUNS = 1200  # plenty: each broken rule scores p < 1e-8 with these


SAMPLING_ALPHA = 1e-3  # a correct rule fails with this probability (the seeds are fixed: it passes or fails for good)


SAMPLING_TREE_NODES = 4  # the tree case: the second window is the draft's 4 likeliest tokens, siblings of the root


T1 = SamplingParams(temperature=1.0)


def pair_counts(pairs: list[tuple[int, int]], vocab: int = SAMPLING_VOCAB) -> torch.Tensor:
    """Counts [V, V] of (first, second) token pairs."""
    counts = torch.zeros(vocab, vocab)
    for a, b in pairs:
        counts[a, b] += 1
    return counts


def sampling_p_values(models, pairs: list[tuple[int, int]]) -> tuple[float, float]:
    """p-values of the first tokens and of the first two of `pairs` against the target's exact distributions."""
    joint = models[3]
    counts = pair_counts(pairs, joint.shape[0])
    return chi2_pvalue(counts.sum(1), joint.sum(1)), chi2_pvalue(counts, joint)
