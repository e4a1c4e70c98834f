"""A load measured from a CPU's own steps: what a block peer announces and tells each head, and a serving head's own.

The meter keeps the span's recent steps (the last `LOAD_WINDOW_S` seconds, at most `MAX_STEPS`): when each ended,
how long it computed, and how many rows each session had in it. From them:

    busy       share of the window's wall time the span was computing             (0..1)
    b          seconds one more row adds to a step: the least-squares slope of step seconds over step rows
               (clamped to [0, mean seconds / mean rows]); that upper bound while the rows have not varied
    others(s)  rows per second of every other session still open (one that ended competes no more); on a meter
               told the tokens its sessions emit (`count="tokens"`, a serving head's), their tokens per second
    load(s)    = min(1, busy · b · others(s))

`load(s)` is what one more row of session s costs the other sessions here, in their tokens: a step one row longer
delays every window in it by b, and a window delayed by b loses b × its session's rate of tokens; the others'
rows stand for their tokens (exact for `ar`, an over-count for speculating heads, so the estimate errs towards
caution; a serving head knows its generations' tokens and counts those), and `busy` is the chance that another session's window is waiting or computing when ours arrives. Each
hop adds its own to the window it passes on (`Forward.load`); the head reads the route's sum in the `Result`.
The record carries the same window's `busy`, mean rows per step, rows per second and the rows queued now.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from .deadlines import cost_line

LOAD_WINDOW_S = 5.0  # the recent past a load is measured over
MAX_STEPS = 256  # steps kept at most (a window's worth on a fast peer)


@dataclass(frozen=True)
class Step:
    """One step of the span: when it ended, its compute seconds, the rows of each session in it."""

    ended: float
    seconds: float
    rows: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.rows.values())


@dataclass(frozen=True)
class LoadReport:
    """A peer's load as its record announces it (`busy` share, mean rows per step, rows per second, queued rows)."""

    busy: float = 0.0
    batch_rows: float = 0.0
    rows_per_s: float = 0.0
    queued_rows: int = 0


class LoadMeter:
    """The span's recent steps and the loads read from them (see the module doc)."""

    def __init__(self, window_s: float = LOAD_WINDOW_S, clock: Callable[[], float] | None = None,
                 count: str = "rows") -> None:
        if count not in ("rows", "tokens"):
            raise ValueError(f"a load meter counts the others' rows or tokens, not {count!r}")
        self.window_s = window_s
        self.count = count
        self._clock = clock or time.perf_counter
        self._steps: deque[Step] = deque(maxlen=MAX_STEPS)
        self._emitted: deque[tuple[float, str, int]] = deque(maxlen=4 * MAX_STEPS)  # (when, session, tokens)

    def observe(self, seconds: float, rows: Mapping[str, int], ended: float | None = None) -> None:
        """Record one step: its compute seconds and each session's rows in it."""
        self._steps.append(Step(self._clock() if ended is None else ended, seconds, dict(rows)))

    def emitted(self, session: str, tokens: int, when: float | None = None) -> None:
        """Record that `session` emitted `tokens` tokens (what a `count="tokens"` meter counts as its rate)."""
        if tokens < 0:
            raise ValueError(f"tokens emitted must be >= 0, got {tokens!r}")
        self._emitted.append((self._clock() if when is None else when, session, tokens))

    def _recent(self, now: float) -> list[Step]:
        while self._steps and self._steps[0].ended < now - self.window_s:
            self._steps.popleft()
        while self._emitted and self._emitted[0][0] < now - self.window_s:
            self._emitted.popleft()
        return list(self._steps)

    def _span(self, steps: list[Step], now: float) -> float:
        """The wall time the steps are spread over: the window, or less while the peer is younger than it."""
        first = steps[0].ended - steps[0].seconds
        return max(min(self.window_s, now - first), 1e-6)

    @staticmethod
    def row_seconds(steps: list[Step]) -> float:
        """b: seconds one more row adds to a step (see the module doc)."""
        fit = cost_line((float(s.total), s.seconds) for s in steps)
        if fit is not None:
            return fit[1]
        rows = sum(s.total for s in steps)
        return sum(s.seconds for s in steps) / rows if rows else 0.0

    def load(self, session: str, open_sessions: Collection[str] | None = None, now: float | None = None) -> float:
        """What one more row of `session` costs the other sessions here (those in `open_sessions`, default every
        one seen), in their tokens (0..1)."""
        now = self._clock() if now is None else now
        steps = self._recent(now)
        if not steps:
            return 0.0
        span = self._span(steps, now)

        def other(owner: str) -> bool:
            return owner != session and (open_sessions is None or owner in open_sessions)

        if self.count == "tokens":
            others = sum(n for _, owner, n in self._emitted if other(owner)) / span
        else:
            others = sum(rows for s in steps for owner, rows in s.rows.items() if other(owner)) / span
        if others <= 0:
            return 0.0
        busy = min(1.0, sum(s.seconds for s in steps) / span)
        return min(1.0, busy * self.row_seconds(steps) * others)

    def report(self, queued_rows: int = 0, now: float | None = None) -> LoadReport:
        """The recent window as the record announces it."""
        now = self._clock() if now is None else now
        steps = self._recent(now)
        if not steps:
            return LoadReport(queued_rows=queued_rows)
        span = self._span(steps, now)
        rows = sum(s.total for s in steps)
        return LoadReport(busy=min(1.0, sum(s.seconds for s in steps) / span), batch_rows=rows / len(steps),
                          rows_per_s=rows / span, queued_rows=queued_rows)
