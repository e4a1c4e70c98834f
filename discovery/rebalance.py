"""When a block peer should move its span: a pure decision over the swarm's records (issue 56).

Every block peer re-reads the records at jittered intervals and asks `move_target`: would serving another span of
the same length make the swarm better covered? Coverage is each block's summed throughput (`block_throughputs`);
the swarm is judged first by how many blocks nobody serves (holes), then by its bottleneck (the least-served
block). A peer moves only

- if it does not open a hole: no block of its span is served by it alone;
- to the span `choose_blocks` would give a newcomer (the least-served window, the peers' own rule at start);
- if that fills a hole, or raises the bottleneck by `MOVE_GAIN` (25 %);
- and only once the same move was chosen at two checks in a row (`Confirm`): a swarm still settling after a
  peer came or went is not followed (Petals moves on one look and oscillates, its issue #389; its fix in review,
  #493, confirms twice);
- one at a time: every peer that would make the same move (a hole seen by all the peers that could fill it) waits
  one more check per such peer ahead of it in peer-id order (`queue_position`), so the first moves, announces, and
  the others see the hole filled instead of all moving at once and opening holes where they were.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .planner import block_throughputs, choose_blocks
from .records import PeerRecord

MOVE_GAIN = 1.25  # a move that fills no hole must raise the swarm's bottleneck throughput by this factor


@dataclass(frozen=True)
class Coverage:
    """The swarm's coverage as a move is judged: blocks nobody serves, then the least-served block's tokens/s."""

    holes: int
    bottleneck: float

    @classmethod
    def of(cls, per_block: list[float]) -> Coverage:
        return cls(sum(1 for t in per_block if t <= 0), min(per_block) if per_block else 0.0)

    def describe(self) -> str:
        return f"{self.holes} unserved blocks, bottleneck {self.bottleneck:.3g} tokens/s"


@dataclass(frozen=True)
class Move:
    """A move worth making: from `span` to `to`, and the coverage before and after."""

    span: tuple[int, int]
    to: tuple[int, int]
    before: Coverage
    after: Coverage

    def describe(self) -> str:
        return (f"blocks {self.span[0]}:{self.span[1]} -> {self.to[0]}:{self.to[1]} "
                f"({self.before.describe()} -> {self.after.describe()})")


def move_target(
    records: Iterable[PeerRecord], me: str, span: tuple[int, int], throughput: float, num_layers: int, *,
    gain: float = MOVE_GAIN,
) -> Move | None:
    """The move this peer (`me`, serving `span` at `throughput` tokens/s) should make, or None (see the module doc).
    Its own record in `records` is ignored: its span and throughput are the arguments."""
    start, end = span
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"span {start}:{end} is not inside the model's {num_layers} layers")
    if not throughput > 0:
        raise ValueError(f"throughput must be > 0, got {throughput}")
    recs = [r for r in records if r.peer_id != me]
    without = block_throughputs(recs, num_layers)
    if any(without[b] <= 0 for b in range(start, end)):
        return None  # it alone serves some of its blocks: leaving them would open a hole
    to = choose_blocks(recs, num_layers, end - start)
    if to == span:
        return None

    def served_at(a: int, b: int) -> list[float]:
        return [t + (throughput if a <= i < b else 0.0) for i, t in enumerate(without)]

    before, after = Coverage.of(served_at(start, end)), Coverage.of(served_at(*to))
    if after.holes < before.holes or (after.holes == before.holes and after.bottleneck >= gain * before.bottleneck):
        return Move(span, to, before, after)
    return None


def queue_position(
    records: Iterable[PeerRecord], me: str, move: Move, num_layers: int, *, gain: float = MOVE_GAIN,
) -> int:
    """How many other block peers would make the same move (to `move.to`) and come before `me` in peer-id order."""
    recs = [r for r in records if r.role == "block"]
    ahead = 0
    for r in {r.peer_id: r for r in recs}.values():
        if r.peer_id >= me or not 0 <= r.start < r.end <= num_layers or not r.throughput > 0:
            continue
        theirs = move_target(recs, r.peer_id, (r.start, r.end), r.throughput, num_layers, gain=gain)
        ahead += theirs is not None and theirs.to == move.to
    return ahead


class Confirm:
    """A move is made once the same one was chosen at `needed` checks in a row (`seen` counts this check)."""

    def __init__(self) -> None:
        self._last: tuple[int, int] | None = None
        self._times = 0

    def seen(self, move: Move | None, needed: int = 2) -> bool:
        target = None if move is None else move.to
        self._times = self._times + 1 if target is not None and target == self._last else int(target is not None)
        self._last = target
        if target is not None and self._times >= needed:
            self._last, self._times = None, 0
            return True
        return False
