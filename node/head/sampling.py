"""Sampling warps shared by the target and the drafter.

Speculative sampling is only lossless when the draft distribution q and the
target distribution p are shaped by the same temperature/top-k/top-p rule, so
both sides call `warp` from here. The rule and its order (temperature, then
top-k, then top-p) follow HF `generate`, tie rules included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SamplingParams", "warp", "sample", "softmax"]


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from logits; temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p!r}")

    @property
    def greedy(self) -> bool:
        """True when tokens are chosen by argmax (temperature 0)."""
        return self.temperature == 0.0


def _check_logits(logits: torch.Tensor) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have a non-empty last (vocabulary) dimension, got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")


def softmax(logits: torch.Tensor) -> torch.Tensor:
    """Untempered float32 softmax over the last dimension (the raw model distribution)."""
    _check_logits(logits)
    return torch.softmax(logits.float(), dim=-1)


def _top_p_remove(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Mask of tokens outside the nucleus: keep rank r iff the mass ranked above it is < top_p.

    Same rule as HF's TopPLogitsWarper (which drops the ascending tail of mass
    <= 1 - top_p), computed from a growing top-k instead of a full sort of the
    vocabulary; tokens tied with the last kept one are all kept.
    """
    vocab = scores.shape[-1]
    probs = torch.softmax(scores, dim=-1)
    flat = probs.reshape(-1, vocab)
    thresholds = torch.empty(flat.shape[0], 1, dtype=flat.dtype)
    for r in range(flat.shape[0]):
        k = min(vocab, 128)
        while True:
            if k < vocab:
                vals = torch.topk(flat[r], k).values
            else:
                vals = torch.sort(flat[r], descending=True).values
            mass_above = vals.double().cumsum(0) - vals.double()
            kept = int((mass_above < top_p).sum())
            if kept < k or k == vocab:
                break
            k = vocab if 4 * k > 2048 else 4 * k
        thresholds[r, 0] = vals[max(kept, 1) - 1]
    return probs < thresholds.reshape(*scores.shape[:-1], 1)


def warp(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits [..., V] into float32 probabilities [..., V] under `params`.

    Greedy gives a one-hot at `torch.argmax` (first maximal index, as HF greedy
    search). Otherwise: divide by temperature, mask below the k-th largest
    logit (ties with it kept), then drop the smallest-probability tail whose
    cumulative mass is <= 1 - top_p (always keeping the most likely token; a
    tie at the nucleus boundary keeps every tied token).
    """
    _check_logits(logits)
    scores = logits.float()
    if params.greedy:
        idx = torch.argmax(scores, dim=-1, keepdim=True)
        return torch.zeros_like(scores).scatter_(-1, idx, 1.0)
    scores = scores / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        scores = scores.masked_fill(_top_p_remove(scores, params.top_p), float("-inf"))
    return torch.softmax(scores, dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from a 1-D probability vector (need not be normalised).

    Inverse-CDF with exactly one uniform draw from `generator`, so the number of
    random numbers consumed is predictable; tokens of zero mass are never chosen.
    """
    if probs.dim() != 1 or probs.numel() == 0:
        raise ValueError(f"probs must be a non-empty 1-D tensor, got shape {tuple(probs.shape)}")
    cdf = probs.double().cumsum(0)
    total = cdf[-1]
    if not bool(torch.isfinite(total)) or float(total) <= 0.0:
        raise ValueError(f"probs must have positive finite total mass, got {float(total)!r}")
    u = torch.rand((), generator=generator, dtype=torch.float64)
    idx = min(int(torch.searchsorted(cdf, u * total, right=True)), probs.numel() - 1)
    # Float rounding can land on a trailing zero-mass entry: step back to mass.
    while idx > 0 and float(probs[idx]) <= 0.0:
        idx -= 1
    return idx
