"""Result deadlines from measured round times, one rule for the route and the federated backends.

A head waits for a window's result only as long as what it has measured says it should:

    expected(n) = the p-th percentile (p95) of the recent rounds in the size class of n tokens,
                  once that class holds `min_samples` rounds; before that, the largest of the
                  prior's estimate for n tokens, the slowest round of n's class so far and the
                  percentiles of the smaller classes (a larger window takes at least as long);
                  failing all of those, the smallest percentile of a larger class; else None
    deadline(n) = min(cap_s, k · expected(n) + floor_s)          (cap_s when expected is None)

Size classes are powers of two of the window's tokens (1, 2–3, 4–7, …). The prior is the route
planner's estimate `fixed_s + n · per_token_s` (links from measured RTTs, compute from the peers'
announced throughputs), so the first window after a route (re)opens — the prompt, or a replay of
the committed tokens — is given its compute. Every deadline that passes without the result
doubles that window's allowance (`WindowTimer.late`); what the head does meanwhile is the
backend's business (the route: `dsd.protocol.route_state`).

A round is slow when it took at least `slow_factor` times the prior's estimate and at least
`slow_floor_s` more; `slow_rounds` slow rounds in a row make the route slow. After a slow route
was looked at and kept, `slow_cooldown` rounds pass before it can be judged slow again.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["DeadlineRule", "RoundPrior", "RoundTimes", "WindowTimer", "cost_line"]


def cost_line(points: Iterable[tuple[float, float]]) -> tuple[float, float] | None:
    """(a, b) of seconds = a + b·tokens, least squares over (tokens, seconds) points, b clamped to [0, mean seconds /
    mean tokens] and a ≥ 0; None while there are fewer than 3 points or the token counts have not varied (variance
    below 1): a window's cost as a head measures its rounds and a peer its steps."""
    pts = list(points)
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var < 1.0 or mx <= 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / var
    slope = min(max(slope, 0.0), my / mx)
    return max(my - slope * mx, 0.0), slope


@dataclass(frozen=True)
class DeadlineRule:
    """The constants of the rule above (defaults in docs/failures.md)."""

    k: float = 3.0
    floor_s: float = 1.0
    cap_s: float = 30.0
    percentile: float = 0.95
    min_samples: int = 3
    history: int = 32
    slow_factor: float = 4.0
    slow_floor_s: float = 0.25
    slow_rounds: int = 3
    slow_cooldown: int = 12
    hole_wait_s: float = 60.0  # blocks no live peer serves (a peer left): how long a generation waits for them

    def __post_init__(self) -> None:
        if not (self.k >= 1.0 and self.floor_s >= 0.0 and self.cap_s > 0.0):
            raise ValueError(f"need k >= 1, floor_s >= 0 and cap_s > 0, got {self.k}, {self.floor_s}, {self.cap_s}")
        if not 0.0 < self.percentile <= 1.0:
            raise ValueError(f"percentile must be in (0, 1], got {self.percentile}")
        if self.min_samples < 1 or self.history < self.min_samples:
            raise ValueError("need 1 <= min_samples <= history")
        if self.slow_factor <= 1.0 or self.slow_floor_s < 0.0 or self.slow_rounds < 1 or self.slow_cooldown < 0:
            raise ValueError("need slow_factor > 1, slow_floor_s >= 0, slow_rounds >= 1 and slow_cooldown >= 0")
        if self.hole_wait_s < 0.0:
            raise ValueError(f"hole_wait_s must be >= 0, got {self.hole_wait_s}")

    def deadline_s(self, expected_s: float | None) -> float:
        """Seconds to wait for a round expected to take `expected_s` (the cap when unknown)."""
        if expected_s is None:
            return self.cap_s
        return min(self.cap_s, self.k * expected_s + self.floor_s)


@dataclass(frozen=True)
class RoundPrior:
    """A planner's estimate of a round: `fixed_s` (links, overheads) + tokens × `per_token_s` (compute)."""

    fixed_s: float
    per_token_s: float

    def estimate_s(self, tokens: int) -> float:
        return self.fixed_s + max(1, tokens) * self.per_token_s


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank method (no interpolation: one of the values)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class RoundTimes:
    """Measured round times of one route (or worker pool) by window size class; expected times,
    deadlines and slowness from them (see the module doc)."""

    def __init__(self, rule: DeadlineRule | None = None, prior: RoundPrior | None = None) -> None:
        self.rule = rule or DeadlineRule()
        self.prior = prior
        self.rounds = 0
        self.last_tokens = 1
        self._classes: dict[int, deque[float]] = {}
        self._streak = 0
        self._quiet_until = 0
        self.recent_slow: deque[float] = deque(maxlen=self.rule.slow_rounds)

    @staticmethod
    def size_class(tokens: int) -> int:
        """0 for 1 token, 1 for 2–3, 2 for 4–7, …"""
        return max(1, tokens).bit_length() - 1

    def observe(self, tokens: int, seconds: float) -> bool:
        """Record one round of a `tokens`-token window; True when it was slow."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a round takes a finite time >= 0, got {seconds!r}")
        self.rounds += 1
        self.last_tokens = max(1, tokens)
        cls = self._classes.setdefault(self.size_class(tokens), deque(maxlen=self.rule.history))
        cls.append(seconds)
        slow = self.is_slow(tokens, seconds)
        self._streak = self._streak + 1 if slow else 0
        if slow:
            self.recent_slow.append(seconds)
        return slow

    def is_slow(self, tokens: int, seconds: float) -> bool:
        """Did a round of `tokens` tokens taking `seconds` miss the prior by the slow margins?"""
        if self.prior is None:
            return False
        est = self.prior.estimate_s(tokens)
        return seconds >= self.rule.slow_factor * est and seconds - est >= self.rule.slow_floor_s

    @property
    def slow(self) -> bool:
        """`slow_rounds` slow rounds in a row (and not within a cooldown)."""
        return self._streak >= self.rule.slow_rounds and self.rounds >= self._quiet_until

    def keep(self) -> None:
        """The route was judged slow and kept (no better one): do not judge it again for a while."""
        self._streak = 0
        self._quiet_until = self.rounds + self.rule.slow_cooldown

    def expected_s(self, tokens: int) -> float | None:
        """The round time to expect for a window of `tokens` tokens (None when nothing is known)."""
        q, mine = self.rule.percentile, self.size_class(tokens)
        own = self._classes.get(mine)
        if own is not None and len(own) >= self.rule.min_samples:
            return _percentile(list(own), q)
        lower = [_percentile(list(v), q) for c, v in self._classes.items() if c < mine and v]
        if own:
            lower.append(max(own))
        if self.prior is not None:
            lower.append(self.prior.estimate_s(tokens))
        if lower:
            return max(lower)
        upper = [_percentile(list(v), q) for c, v in self._classes.items() if c > mine and v]
        return min(upper) if upper else None

    def deadline_s(self, tokens: int) -> float:
        """How long to wait for the result of a `tokens`-token window."""
        return self.rule.deadline_s(self.expected_s(tokens))


@dataclass
class _Pending:
    tokens: int
    sent_at: float
    allowance_s: float
    late: int = 0

    @property
    def due(self) -> float:
        return self.sent_at + self.allowance_s * 2**self.late


class WindowTimer:
    """The windows in flight on one session, in sending order: when each is due, and the measured
    round of each result (fed to `rounds`). Results come back in the order windows were sent."""

    def __init__(self, rounds: RoundTimes) -> None:
        self.rounds = rounds
        self._pending: dict[Hashable, _Pending] = {}

    def sent(self, key: Hashable, tokens: int, now: float) -> None:
        """A window of `tokens` tokens went out at `now` (its result will carry `key`)."""
        self._pending.pop(key, None)
        self._pending[key] = _Pending(tokens, now, self.rounds.deadline_s(tokens))

    def arrived(self, key: Hashable, now: float) -> tuple[int, float] | None:
        """The result of `key` came in at `now`: (tokens, seconds) of its round, recorded; windows sent
        before it are forgotten (their results will not come). None for a window never timed."""
        if key not in self._pending:
            return None
        while self._pending:
            first, pending = next(iter(self._pending.items()))
            del self._pending[first]
            if first == key:
                seconds = max(0.0, now - pending.sent_at)
                self.rounds.observe(pending.tokens, seconds)
                return pending.tokens, seconds
        return None

    def due(self) -> float | None:
        """When the oldest window in flight is due (None when none is)."""
        first = next(iter(self._pending.values()), None)
        return None if first is None else first.due

    def late(self) -> int:
        """The oldest window missed its deadline: double its allowance; returns how many it has missed."""
        first = next(iter(self._pending.values()), None)
        if first is None:
            return 0
        first.late += 1
        return first.late

    def oldest(self) -> tuple[int, float] | None:
        """(tokens, sent at) of the oldest window in flight, if any."""
        first = next(iter(self._pending.values()), None)
        return None if first is None else (first.tokens, first.sent_at)
