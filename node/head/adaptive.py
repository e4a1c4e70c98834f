"""Adaptive verification (DSD paper, opt-in, lossy): a per-token relaxation τ.

For drafted token x at position i, with p the target distribution and q the
draft distribution at that position:

    c_i  = max(0, −log p(x) − H(p))           cross-entropy contrast: the target's
                                                surprise at the draft token beyond its
                                                own expected surprise H(p) = −Σ p log p
    s_i  = exp(−c_i) = min(1, p(x)·e^{H(p)})  token agreement in [0, 1]
    a_i  = Σ_v min(p(v), q(v))                 distributional agreement in [0, 1]
    m    = EWMA over verified positions of [argmax p == argmax q] (running top-1
           match rate; argmax q is x for a deterministic drafter)
    τ_i  = τ_max · m · a_i · s_i                 in [0, τ_max]

A confident target that disagrees with the draft (small H, small p(x)) gives a
large contrast, s_i ≈ 0 and τ_i ≈ 0: such tokens are verified strictly. A flat
target (many acceptable continuations, e.g. function words, punctuation) gives
c_i ≈ 0. τ enters the acceptance test in `dsd.node.verify.verify_window`.
p is softmax(logits) under greedy decoding and warp(logits, params) when
sampling; q is the drafter's distribution (one-hot at x for a deterministic
drafter). τ_max = 0 returns exact zeros, which makes verification lossless.
The full rationale is in docs/adaptive_verification.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams, softmax, warp

__all__ = ["AdaptiveVerifier"]


@dataclass
class AdaptiveVerifier:
    """Computes per-token relaxations τ ∈ [0, tau_max] and tracks the top-1 match rate."""

    tau_max: float
    params: SamplingParams = field(default_factory=SamplingParams)
    match_decay: float = 0.9
    match_prior: float = 0.5
    match_rate: float = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tau_max, int | float) or not (0.0 <= self.tau_max <= 1.0):
            raise ValueError(f"tau_max must be in [0, 1], got {self.tau_max!r}")
        if not (0.0 <= self.match_decay < 1.0):
            raise ValueError(f"match_decay must be in [0, 1), got {self.match_decay!r}")
        if not (0.0 <= self.match_prior <= 1.0):
            raise ValueError(f"match_prior must be in [0, 1], got {self.match_prior!r}")
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(self.params).__name__}")
        self.match_rate = float(self.match_prior)

    def _target_probs(self, target_logits: torch.Tensor, gamma: int) -> torch.Tensor:
        if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
            raise ValueError("target_logits must be a 2-D tensor [gamma (or gamma+1), V]")
        if target_logits.shape[0] < gamma:
            raise ValueError(
                f"target_logits has {target_logits.shape[0]} rows, need at least gamma = {gamma}"
            )
        rows = target_logits[:gamma]
        return softmax(rows) if self.params.greedy else warp(rows, self.params)

    def taus(
        self,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        draft_tokens: Sequence[int],
    ) -> torch.Tensor:
        """Per-token τ [γ] (float64) for a window; extra target rows (the bonus row) are ignored."""
        drafts = [int(t) for t in draft_tokens]
        gamma = len(drafts)
        if self.tau_max == 0.0 or gamma == 0:
            return torch.zeros(gamma, dtype=torch.float64)
        p = self._target_probs(target_logits, gamma)
        vocab = p.shape[1]
        for i, x in enumerate(drafts):
            if not 0 <= x < vocab:
                raise ValueError(f"draft token {x} at position {i} is outside the vocabulary [0, {vocab})")
        idx = torch.tensor(drafts, dtype=torch.long)
        if draft_probs is None:
            q = torch.zeros_like(p).scatter_(1, idx[:, None], 1.0)
        else:
            if tuple(draft_probs.shape) != (gamma, vocab):
                raise ValueError(
                    f"draft_probs must have shape [gamma, V] = {(gamma, vocab)}, got {tuple(draft_probs.shape)}"
                )
            q = draft_probs.float()
            q = q / q.sum(dim=1, keepdim=True).clamp_min(1e-30)
        entropy = -torch.special.xlogy(p, p).sum(dim=1)
        px = p.gather(1, idx[:, None]).squeeze(1)
        contrast = torch.clamp(-torch.log(px) - entropy, min=0.0)  # +inf where p(x) = 0
        token_agreement = torch.exp(-contrast)
        dist_agreement = torch.minimum(p, q).sum(dim=1).clamp(0.0, 1.0)
        tau = self.tau_max * self.match_rate * dist_agreement.double() * token_agreement.double()
        return tau.clamp(0.0, self.tau_max)

    def observe(
        self,
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        draft_tokens: Sequence[int],
        accepted: int | None = None,
    ) -> None:
        """Update the running top-1 match rate m from a verified window.

        A position matches when the target's top-1 equals the draft's top-1
        (argmax of `draft_probs`, or the drafted token when q is None). Rows are
        all conditioned on the same drafted prefix for both models, so every
        position is a fair comparison; pass `accepted` to count only the
        accepted positions and the first rejected one.
        """
        drafts = [int(t) for t in draft_tokens]
        gamma = len(drafts)
        if accepted is not None and not 0 <= accepted <= gamma:
            raise ValueError(f"accepted must be in [0, {gamma}], got {accepted}")
        compared = gamma if accepted is None else min(accepted + 1, gamma)
        if compared == 0:
            return
        if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
            raise ValueError("target_logits must be a 2-D tensor [gamma (or gamma+1), V]")
        if target_logits.shape[0] < compared:
            raise ValueError(f"target_logits has {target_logits.shape[0]} rows, need at least {compared}")
        best = torch.argmax(target_logits[:compared].float(), dim=-1).tolist()
        if draft_probs is None:
            draft_top = drafts[:compared]
        else:
            if draft_probs.dim() != 2 or draft_probs.shape[0] < compared:
                raise ValueError(f"draft_probs must be 2-D with at least {compared} rows")
            draft_top = torch.argmax(draft_probs[:compared].float(), dim=-1).tolist()
        m = self.match_rate
        for i in range(compared):
            m = self.match_decay * m + (1.0 - self.match_decay) * (1.0 if best[i] == draft_top[i] else 0.0)
        if not math.isfinite(m):
            raise ValueError("match rate became non-finite")
        self.match_rate = m
