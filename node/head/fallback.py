"""dsd's fallback rule: decode as `sd` while the work done ahead of the verdict costs more than it saves.

`dsd` drafts outcome branches and sends windows ahead while a window flies; on a head whose cores are busy, or
where bets rarely win, that work can delay the verdicts it was meant to hide behind. The ledger compares, round
by round, what a `dsd` round took (verdict to verdict) with what `sd` would have taken for the same window: a
trip sent with nothing else in flight (the lower quartile of the clean trips seen), the window's drafting done
after the verdict, and the verifying. Once at least `min_rounds` rounds are in and their sum says `dsd` was
slower, the generation decodes as `sd` for `hold` rounds (drafting on the critical path, one window in flight),
then probes `dsd` again with a fresh ledger; each fallback in a row doubles the hold. Greedy output is the same
either way: only when drafts are made changes, never which tokens are kept.
"""

from __future__ import annotations

import math
from collections import deque

__all__ = ["AheadLedger"]


class AheadLedger:
    """Whether ahead-of-verdict work pays in this generation, measured against `sd`'s round for the same windows."""

    def __init__(self, *, min_rounds: int = 4, hold: int = 8, trips: int = 16) -> None:
        if min_rounds < 1 or hold < 1 or trips < 1:
            raise ValueError("min_rounds, hold and trips must be >= 1")
        self.min_rounds = min_rounds
        self.base_hold = hold
        self._trips: deque[float] = deque(maxlen=trips)  # seconds of windows sent with nothing else in flight
        self._actual = 0.0
        self._sd = 0.0
        self._rounds = 0
        self._hold = hold
        self._left = 0  # sd rounds still to go (0: dsd)
        self.fallbacks = 0  # times the generation fell back to sd

    @property
    def ahead(self) -> bool:
        """Whether the next round works ahead of its verdict (dsd) rather than after it (sd)."""
        return self._left == 0

    def clean_trip(self) -> float | None:
        """The trip an sd window would take: the lower quartile of the clean trips seen (None before any)."""
        if not self._trips:
            return None
        ordered = sorted(self._trips)
        return ordered[(len(ordered) - 1) // 4]

    def observe_trip(self, seconds: float) -> None:
        """A window sent with no other in flight took `seconds` from sending to its result."""
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(f"a trip takes a finite number of seconds >= 0, got {seconds!r}")
        self._trips.append(seconds)

    def observe(self, *, actual_s: float, draft_s: float, verify_s: float) -> None:
        """One round after the prompt's: `actual_s` from the previous verdict to this one; what sd would have spent
        drafting the same window after the verdict (`draft_s`) and verifying it (`verify_s`)."""
        for name, v in (("actual_s", actual_s), ("draft_s", draft_s), ("verify_s", verify_s)):
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if not self.ahead:
            self._left -= 1
            if self._left == 0:
                self._reset()
            return
        trip = self.clean_trip()
        if trip is None:  # every window so far went ahead or was ready: nothing to weigh against
            return
        self._actual += actual_s
        self._sd += trip + draft_s + verify_s
        self._rounds += 1
        if self._rounds < self.min_rounds:
            return
        if self._actual > self._sd:
            self._left = self._hold
            self._hold *= 2
            self.fallbacks += 1
        else:
            self._hold = self.base_hold
        self._reset()

    def _reset(self) -> None:
        self._actual = self._sd = 0.0
        self._rounds = 0
