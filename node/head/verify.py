"""Verification of a draft window against the target's logits, and stop detection.

Pure functions over tensors: `verify_window` decides how many drafted tokens
the target keeps and which token it emits next (lossless unless an adaptive
relaxation `tau` is passed); `find_stop` says where EOS or a stop string ends
generation, exactly where plain decoding with the target would have ended it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .sampling import GumbelNoise, SamplingParams, coupled_token, sample, softmax, warp

__all__ = [
    "Verdict",
    "verify_window",
    "Decoder",
    "StopMatch",
    "find_stop",
    "stream_safe_length",
]


@dataclass(frozen=True)
class Verdict:
    """Outcome of one window: `tokens` = the accepted drafts + `next_token`.

    `next_token` is the correction sampled at the first rejection, or the bonus
    token from the last target position when every draft was accepted.
    """

    accepted: int
    next_token: int
    tokens: list[int]


def _check_window(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    tau: torch.Tensor | None,
) -> tuple[int, int, list[int]]:
    if not isinstance(target_logits, torch.Tensor) or target_logits.dim() != 2:
        shape = tuple(target_logits.shape) if isinstance(target_logits, torch.Tensor) else type(target_logits).__name__
        raise ValueError(f"target_logits must be a 2-D tensor [gamma+1, V], got {shape}")
    if not target_logits.is_floating_point() or torch.isnan(target_logits).any():
        raise ValueError("target_logits must be floating point and free of NaN")
    drafts = [int(t) for t in draft_tokens]
    gamma = len(drafts)
    rows, vocab = target_logits.shape
    if rows != gamma + 1:
        raise ValueError(
            f"target_logits must have gamma+1 = {gamma + 1} rows for {gamma} draft tokens, got {rows}"
        )
    for i, t in enumerate(drafts):
        if not 0 <= t < vocab:
            raise ValueError(f"draft token {t} at position {i} is outside the vocabulary [0, {vocab})")
    if draft_probs is not None and tuple(draft_probs.shape) != (gamma, vocab):
        raise ValueError(
            f"draft_probs must have shape [gamma, V] = {(gamma, vocab)}, got {tuple(draft_probs.shape)}"
        )
    if tau is not None:
        if tuple(tau.shape) != (gamma,):
            raise ValueError(f"tau must have shape [gamma] = ({gamma},), got {tuple(tau.shape)}")
        if torch.isnan(tau).any() or (tau < 0).any() or (tau > 1).any():
            raise ValueError(f"tau values must lie in [0, 1], got {tau.tolist()}")
    return gamma, vocab, drafts


def verify_window(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    tau: torch.Tensor | None = None,
    *,
    noise: GumbelNoise | None = None,
    start: int = 0,
) -> Verdict:
    """Verify γ drafted tokens against target logits [γ+1, V] (row i predicts draft i).

    Greedy: accept while the draft equals argmax of the target row; emit the
    target argmax at the first mismatch, or the bonus argmax of row γ.

    Sampling with `noise` (the lossless modes): row i predicts absolute position
    `start + i`, where the target's token is t_i = argmax(log warp(row i) + G_{start+i}),
    an exact draw from p that depends on the context and the seed only. Accept x_i
    iff x_i == t_i; emit t_i at the first mismatch, or t_γ as the bonus. `draft_probs`
    is not needed: however the drafts were made, the emitted tokens are the t_i.

    Sampling without `noise` (dsd-adaptive's rule; p = warp(target), q = draft_probs,
    already warped the same way): accept x_i when u_i < min(1, p(x_i)/q(x_i)) with u_i
    from `generator`; on rejection sample from norm(max(0, p − q)); when all are accepted
    sample the bonus from p[γ]. `draft_probs=None` means a deterministic drafter: q is
    one-hot at x_i.

    `tau` (adaptive verification, lossy, opt-in; see dsd.node.adaptive) relaxes
    position i when tau[i] > 0: greedy also accepts x_i when
    softmax(target)[x_i] >= (1 − τ)·max softmax(target); sampling accepts with
    min(1, p(x_i) / ((1 − τ)·q(x_i))) (τ = 1: any x_i with p(x_i) > 0).
    Positions with τ = 0 (and `tau=None`) run the lossless test unchanged,
    consuming the same random draws, so an all-zero `tau` gives the identical
    verdict.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    gamma, vocab, drafts = _check_window(target_logits, draft_tokens, draft_probs, tau)
    taus = [0.0] * gamma if tau is None else [float(t) for t in tau.double()]

    if params.greedy:
        return _verify_greedy(target_logits, drafts, taus)
    if noise is not None:
        if tau is not None:
            raise ValueError("the Gumbel-max rule is lossless only: relax (tau) with the rejection-sampling rule")
        return _verify_coupled(target_logits, drafts, params, noise, start)
    return _verify_sampling(target_logits, drafts, draft_probs, params, generator, taus)


def _verify_coupled(
    target_logits: torch.Tensor, drafts: list[int], params: SamplingParams, noise: GumbelNoise, start: int
) -> Verdict:
    """Greedy verification on the perturbed scores: the noise of a row is computed only when it is reached."""
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    vocab = target_logits.shape[1]

    def target(i: int) -> int:
        return coupled_token(target_logits[i], params, noise(start + i, vocab))

    for i, x in enumerate(drafts):
        t = target(i)
        if x != t:
            return Verdict(accepted=i, next_token=t, tokens=drafts[:i] + [t])
    t = target(len(drafts))
    return Verdict(accepted=len(drafts), next_token=t, tokens=drafts + [t])


def _verify_greedy(target_logits: torch.Tensor, drafts: list[int], taus: list[float]) -> Verdict:
    best = torch.argmax(target_logits.float(), dim=-1).tolist()
    raw: torch.Tensor | None = None
    accepted = 0
    for i, x in enumerate(drafts):
        if x == best[i]:
            accepted += 1
            continue
        if taus[i] > 0.0:
            if raw is None:
                raw = softmax(target_logits)
            row = raw[i]
            if float(row[x]) >= (1.0 - taus[i]) * float(row.max()):
                accepted += 1
                continue
        return Verdict(accepted=accepted, next_token=best[i], tokens=drafts[:accepted] + [best[i]])
    nxt = best[len(drafts)]
    return Verdict(accepted=accepted, next_token=nxt, tokens=drafts + [nxt])


def _verify_sampling(
    target_logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    taus: list[float],
) -> Verdict:
    p = warp(target_logits, params).double()
    q = None if draft_probs is None else draft_probs.double()
    for i, x in enumerate(drafts):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if qx <= 0.0:
            raise ValueError(
                f"draft token {x} at position {i} has draft probability {qx}; draft_probs must be the "
                "distribution the drafter sampled from"
            )
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        t = taus[i]
        if t <= 0.0:
            threshold = min(1.0, px / qx)
        elif t >= 1.0:
            threshold = 1.0 if px > 0.0 else 0.0
        else:
            threshold = min(1.0, px / ((1.0 - t) * qx))
        if u < threshold:
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0
        else:
            residual = torch.clamp(p[i] - q[i], min=0.0)
        if float(residual.sum()) <= 0.0:
            # Only reachable through float rounding (p ≈ q) or a relaxed test; p is then the answer.
            residual = p[i]
        nxt = sample(residual, generator)
        return Verdict(accepted=i, next_token=nxt, tokens=drafts[:i] + [nxt])
    nxt = sample(p[len(drafts)], generator)
    return Verdict(accepted=len(drafts), next_token=nxt, tokens=drafts + [nxt])


class Decoder(Protocol):
    """Anything with a tokenizer-like `decode(ids) -> str` (e.g. a transformers tokenizer)."""

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class StopMatch:
    """Where generation ends: keep `length` generated tokens; `reason` is "eos" or "stop"."""

    length: int
    reason: str
    stop_string: str | None = None


def find_stop(
    tokens: Sequence[int],
    eos_ids: Collection[int],
    *,
    stop_strings: Sequence[str] = (),
    tokenizer: Decoder | Callable[[list[int]], str] | None = None,
    start: int = 0,
) -> StopMatch | None:
    """Find the first token among `tokens[start:]` that ends generation, or None.

    `tokens` are all generated tokens so far (prompt excluded); `start` is how
    many of them were already checked (a stop there would have been found).
    A stop is the first EOS id (kept, as HF `generate` keeps it) or the first
    token whose addition makes the decoded generated text contain a stop string
    (that token is kept, as HF's StopStringCriteria does). The generated prefix
    is decoded as a whole at every candidate position, so a stop string that
    spans a window boundary, or a token boundary, is found at the token that
    completes it, exactly where one-token-at-a-time decoding would stop; the
    tokens after it (the rest of the window) are dropped by the caller.
    """
    ids = [int(t) for t in tokens]
    if not 0 <= start <= len(ids):
        raise ValueError(f"start must be in [0, {len(ids)}], got {start}")
    stops = [s for s in stop_strings]
    for s in stops:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop strings must be non-empty str, got {s!r}")
    if stops and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (or decode function) to decode the generated tokens")
    decode: Callable[[list[int]], str] | None = None
    if tokenizer is not None:
        decode = tokenizer.decode if hasattr(tokenizer, "decode") else tokenizer  # type: ignore[assignment]
    eos = {int(e) for e in eos_ids}
    for i in range(start, len(ids)):
        if ids[i] in eos:
            return StopMatch(length=i + 1, reason="eos")
        if stops and decode is not None:
            text = decode(ids[: i + 1])
            for s in stops:
                if s in text:
                    return StopMatch(length=i + 1, reason="stop", stop_string=s)
    return None


def stream_safe_length(text: str, stop_strings: Sequence[str]) -> int:
    """How many leading characters of `text` can be streamed now.

    Holds back a tail that could still grow into a stop string (a prefix of one
    at the very end), so streamed text never shows the start of a stop string
    the next window completes. Text from a stop string onward is never safe.
    """
    safe = len(text)
    for s in stop_strings:
        if not s:
            raise ValueError("stop strings must be non-empty")
        at = text.find(s)
        if at != -1:
            safe = min(safe, at)
            continue
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                safe = min(safe, len(text) - k)
                break
    return safe


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """The text before the first stop string (left out, as OpenAI and HumanEval do) and whether one was found."""
    at = min((i for i in (text.find(s) for s in stops) if i != -1), default=-1)
    return (text, False) if at == -1 else (text[:at], True)
