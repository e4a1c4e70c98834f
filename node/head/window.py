"""Window-size control: pick γ so drafting fills the round trip without exceeding it.

Model (per round, i.i.d. acceptance α per draft token, estimated online):

    E(γ)  = (1 − α^{γ+1}) / (1 − α)          expected tokens emitted per round
    T(γ)  = P·max(R(γ), (γ+1)·d) + (1 − P)·(R(γ) + γ·d)   (overlap=True: DSD drafts the next
                               window — γ tokens after a guessed root — for the likely outcomes while
                               this one flies; it is usable when the verdict matches a branch. P is
                               the measured share of ready windows (EWMA) once rounds have been
                               seen; before that, α^{γ+1}: only the full-acceptance guess counts)
          = R(γ) + γ·d         (overlap=False: draft-then-wait speculative decoding)
    R(γ)  = a + b·(γ+1)        round time of a window of γ+1 tokens: a = links, b = the peers'
                               per-token verification compute (large on CPUs, ~0 on GPUs)
    γ*    = argmax_{γ_min ≤ γ ≤ min(γ_max, γ_use)} E(γ) / T(γ)     (smallest γ on ties)
    γ_use = smallest γ with α^γ < θ            (deeper tokens are almost never reached)

a and b are a least-squares fit over the last rounds' (tokens, round time)
pairs (b clamped to [0, mean R / mean tokens]; b = 0 until the window sizes
seen vary), d = measured drafting time per token (EWMA); α = EWMA(accepted) / EWMA(trials), where a round with k accepted
out of γ counts k successes in k trials plus one failed trial if k < γ (the
truncated-geometric MLE); θ = `useful_threshold` (0.05). R should be the time
from sending a window to having its target logits (network + peers' compute).
Before any observation γ = `initial` (clamped into the bounds); a fixed
`gamma` overrides everything.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["WindowController"]


class WindowController:
    """Adapts γ to measured acceptance and round time, bounded to [gamma_min, gamma_max]."""

    def __init__(
        self,
        gamma: int | None = None,
        gamma_min: int = 1,
        gamma_max: int = 16,
        initial: int = 4,
        *,
        overlap: bool = True,
        decay: float = 0.8,
        prior_alpha: float = 0.6,
        prior_weight: float = 4.0,
        useful_threshold: float = 0.05,
    ) -> None:
        if not (isinstance(gamma_min, int) and isinstance(gamma_max, int) and 1 <= gamma_min <= gamma_max):
            raise ValueError(f"need integers 1 <= gamma_min <= gamma_max, got {gamma_min!r}, {gamma_max!r}")
        if gamma is not None and (not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1):
            raise ValueError(f"fixed gamma must be an integer >= 1, got {gamma!r}")
        if not isinstance(initial, int) or isinstance(initial, bool) or initial < 1:
            raise ValueError(f"initial gamma must be an integer >= 1, got {initial!r}")
        if not (0.0 <= decay < 1.0):
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        if not (0.0 <= prior_alpha <= 1.0) or prior_weight < 0:
            raise ValueError("prior_alpha must be in [0, 1] and prior_weight >= 0")
        if not (0.0 < useful_threshold < 1.0):
            raise ValueError(f"useful_threshold must be in (0, 1), got {useful_threshold!r}")
        self.fixed = gamma
        self.gamma_min = gamma_min
        self.gamma_max = gamma_max
        self.initial = min(max(initial, gamma_min), gamma_max)  # a default must not clash with bounds
        self.overlap = overlap
        self.decay = decay
        self.useful_threshold = useful_threshold
        self._succ = prior_alpha * prior_weight
        self._trials = prior_weight
        self._draft_s: float | None = None
        self._round_s: float | None = None
        self._rounds: deque[tuple[int, float]] = deque(maxlen=16)  # (window tokens, round seconds)
        self._ready: float | None = None  # EWMA of "the next window was pre-drafted" (dsd)

    @property
    def alpha(self) -> float:
        """Current estimate of the per-token acceptance probability."""
        if self._trials <= 0:
            return 0.0
        return min(1.0, max(0.0, self._succ / self._trials))

    @property
    def draft_s_per_token(self) -> float | None:
        """Smoothed drafting time per token (None before any observation)."""
        return self._draft_s

    @property
    def round_s(self) -> float | None:
        """Smoothed round time of a window (None before any observation)."""
        return self._round_s

    @staticmethod
    def expected_tokens(alpha: float, gamma: int) -> float:
        """E(γ) = (1 − α^{γ+1}) / (1 − α): expected tokens emitted by a window of γ drafts."""
        if alpha >= 1.0:
            return float(gamma + 1)
        return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)

    def observe(self, *, gamma: int, accepted: int, draft_s_per_token: float, round_s: float) -> None:
        """Record one verified window: γ drafted, `accepted` kept, and the measured times."""
        if gamma < 0 or not 0 <= accepted <= gamma:
            raise ValueError(f"need 0 <= accepted <= gamma, got accepted={accepted}, gamma={gamma}")
        for name, v in (("draft_s_per_token", draft_s_per_token), ("round_s", round_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        trials = accepted + (1 if accepted < gamma else 0)
        self._succ = self.decay * self._succ + accepted
        self._trials = self.decay * self._trials + trials
        w = 1.0 - self.decay
        if gamma > 0:
            self._draft_s = draft_s_per_token if self._draft_s is None else (
                self.decay * self._draft_s + w * draft_s_per_token
            )
        self._round_s = round_s if self._round_s is None else self.decay * self._round_s + w * round_s
        self._rounds.append((gamma + 1, round_s))

    def observe_ready(self, ready: bool) -> None:
        """Record whether the window after a trip was ready (a pre-drafted branch matched the verdict)."""
        x = 1.0 if ready else 0.0
        self._ready = x if self._ready is None else self.decay * self._ready + (1.0 - self.decay) * x

    @property
    def ready_share(self) -> float | None:
        """Smoothed share of ready windows (None before any observation)."""
        return self._ready

    def round_model(self) -> tuple[float, float]:
        """(a, b) of R(γ) = a + b·(γ+1), fitted on recent rounds; b = 0 while window sizes have not varied."""
        r = self._round_s or 0.0
        if len(self._rounds) < 3:
            return r, 0.0
        xs = [float(n) for n, _ in self._rounds]
        ys = [t for _, t in self._rounds]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx) ** 2 for x in xs)
        if var < 1.0:
            return r, 0.0
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
        slope = min(max(slope, 0.0), my / mx)
        return max(my - slope * mx, 0.0), slope

    def expected_round_s(self, gamma: int) -> float | None:
        """R(γ): the expected trip of a window of γ drafts (None before any round was seen)."""
        if self._round_s is None:
            return None
        a, b = self.round_model()
        return a + b * (gamma + 1) if b > 0 else self._round_s

    def _round_time(self, gamma: int) -> float:
        r = self.expected_round_s(gamma) or 0.0
        d = self._draft_s or 0.0
        if not self.overlap:
            return r + gamma * d
        p_hidden = self._ready if self._ready is not None else self.alpha ** (gamma + 1)
        return p_hidden * max(r, (gamma + 1) * d) + (1.0 - p_hidden) * (r + gamma * d)

    def next_gamma(self) -> int:
        """γ for the next window (the fixed override if one was given)."""
        if self.fixed is not None:
            return self.fixed
        if self._round_s is None or self._draft_s is None:
            return self.initial
        alpha = self.alpha
        if alpha <= 0.0:
            return self.gamma_min
        if alpha >= 1.0:
            use_cap = self.gamma_max
        else:
            use_cap = math.ceil(math.log(self.useful_threshold) / math.log(alpha))
        hi = max(self.gamma_min, min(self.gamma_max, use_cap))
        best_g, best_rate = self.gamma_min, -1.0
        for g in range(self.gamma_min, hi + 1):
            t = self._round_time(g)
            rate = self.expected_tokens(alpha, g) / t if t > 0 else float(g)
            if rate > best_rate * (1.0 + 1e-9):
                best_g, best_rate = g, rate
        return best_g
