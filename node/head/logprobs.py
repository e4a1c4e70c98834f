"""The target's log-probabilities of the tokens a generation emits, read from the very logits that verified them.

Every emitted token — an accepted draft, a correction or a bonus token — was checked against one row of the
target's logits for its window: the row of the position before it. Its log-probability is that row's log-softmax,
the target's own distribution (before temperature and top-p, as OpenAI reports them), so a draft that was accepted
reports the target's number, never the draft's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target, and the `top` likeliest tokens there (likeliest first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def emitted_rows(path: Sequence[int], n: int) -> list[int]:
    """The logits rows that predicted a window's first `n` emitted tokens. Row 0 is the window's root; a drafted node
    `i` (a chain's position or a tree's node) owns row i + 1. The tokens follow the accepted `path` and end with the
    correction or bonus token, predicted by the last accepted node's row."""
    return [0, *(p + 1 for p in path)][:n]


def token_logprobs(logits: torch.Tensor, rows: Sequence[int], tokens: Sequence[int], top: int, *,
                   probs: bool = False) -> list[TokenLogprob]:
    """Log-probabilities of `tokens` under `logits[rows]` (row k predicted tokens[k]) with `top` alternatives each.
    `probs`: the rows are probabilities (federated workers send them), taken as they are."""
    if len(rows) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens need as many rows, got {len(rows)}")
    if not tokens:
        return []
    picked = logits[list(rows)].float()
    logp = torch.log_softmax(torch.log(picked) if probs else picked, dim=-1)
    chosen = logp[torch.arange(len(tokens)), torch.tensor(list(tokens))].tolist()
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
        alts = [tuple(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(ids, values, strict=True)]
    else:
        alts = [()] * len(tokens)
    return [TokenLogprob(int(t), float(lp), alt) for t, lp, alt in zip(tokens, chosen, alts, strict=True)]
