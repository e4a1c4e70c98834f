"""Sampling warps shared by the target and the drafter, and the Gumbel noise that couples them.

Speculative sampling is only lossless when the draft distribution q and the
target distribution p are shaped by the same temperature/top-k/top-p rule, so
both sides call `warp` from here. The rule and its order (temperature, then
top-k, then top-p) follow HF `generate`, tie rules included.

When sampling, the token at absolute position `pos` of a generation seeded `seed`
is argmax(log p + G_pos) (Gumbel-max: an exact draw from p), with G_pos a noise
vector keyed by (seed, pos) alone; the drafter proposes argmax(log q + G_pos) with
the same noise. The text then depends on the context, the seed and the params
only, never on drafts, windows or timing (docs/sampling.md).
"""

from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "SamplingParams",
    "warp",
    "sample",
    "softmax",
    "gumbel",
    "GumbelNoise",
    "perturbed",
    "coupled_token",
    "coupled_dist",
]


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


_U64 = (1 << 64) - 1
NOISE_CACHE = 32  # noise vectors a generation keeps (0.6 MB each at a 150k vocabulary)


def gumbel(seed: int, pos: int, vocab: int) -> torch.Tensor:
    """G_pos: standard Gumbel noise [vocab] (float32) for position `pos` of a generation seeded `seed`.

    Drawn from numpy's Philox, a counter-based generator, keyed by (seed mod 2^64, pos): every pair has
    its own stream, so the vector is the same whoever asks for it and whenever. (torch's CPU generator
    keeps only the low 32 bits of a seed, so seeding it with a mix of seed and pos would make pairs
    collide.) U in [0, 1) is drawn in float64 and clamped into (0, 1) before G = −log(−log U).
    """
    if isinstance(pos, bool) or not isinstance(pos, int) or pos < 0 or pos > _U64:
        raise ValueError(f"pos must be an integer in [0, 2^64), got {pos!r}")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"vocab must be an integer >= 1, got {vocab!r}")
    key = ((int(seed) & _U64) << 64) | pos
    u = np.random.Generator(np.random.Philox(key=key)).random(vocab)
    np.maximum(u, np.finfo(np.float64).tiny, out=u)
    np.log(u, out=u)
    np.negative(u, out=u)
    np.log(u, out=u)
    np.negative(u, out=u)
    return torch.from_numpy(u).float()


class GumbelNoise:
    """The noise of one generation: G_pos on demand for any position, the last `cache` vectors kept.

    Shared by the drafter (in a worker thread) and the verifier, so a position drafted and then verified
    costs one draw; a lock keeps the cache consistent across threads.
    """

    def __init__(self, seed: int, cache: int = NOISE_CACHE) -> None:
        if isinstance(seed, bool):
            raise TypeError("seed must be an int, got bool")
        if cache < 0:
            raise ValueError(f"cache must be >= 0, got {cache}")
        self.seed = operator.index(seed)
        self.cache = cache
        self._kept: OrderedDict[tuple[int, int], torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, pos: int, vocab: int) -> torch.Tensor:
        """G_pos over a vocabulary of `vocab` tokens (do not modify it: it may be shared)."""
        key = (pos, vocab)
        with self._lock:
            hit = self._kept.get(key)
            if hit is not None:
                self._kept.move_to_end(key)
                return hit
        g = gumbel(self.seed, pos, vocab)
        with self._lock:
            self._kept[key] = g
            while len(self._kept) > self.cache:
                self._kept.popitem(last=False)
        return g

    def __len__(self) -> int:
        return len(self._kept)


def perturbed(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """log warp(logits) + noise: the scores whose argmax is the Gumbel-max draw from warp(logits).

    Tokens outside the top-k / nucleus score −inf, so they are never drawn."""
    if params.greedy:
        raise ValueError("Gumbel-max draws are for sampling; greedy decoding takes the argmax of the logits")
    return torch.log(warp(logits, params)) + noise


def coupled_token(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> int:
    """The token drawn from warp(logits [V]) with noise G: argmax(log p + G) (first index on a tie)."""
    return int(torch.argmax(perturbed(logits, params, noise)))


def coupled_dist(q: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """softmax(log q + G) of a draft distribution q [V] (or rows [n, V] with noise rows [n, V]).

    Once G is known the draft's token is fixed (the argmax); this row ranks the other tokens by how
    close they came, which is what the head bets on (alternatives, tree children, ranks): the target
    emits its own argmax(log p + G), usually the draft's or one of its runners-up.
    """
    return torch.softmax(torch.log(q.float()) + noise, dim=-1)
