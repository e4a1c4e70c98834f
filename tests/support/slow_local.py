"""A whole tiny target in-process whose results arrive a fixed trip after their window was sent: windows overlap
as on a route of peers, deterministically enough for the pipeline's tests."""

from __future__ import annotations

from collections import deque

import torch
import trio

from dsd.node.head.local import LocalBackend

TRIP_S = 0.25


class SlowLocal(LocalBackend):
    """LocalBackend whose results arrive `trip_s` after their window was sent; counts windows sent."""

    def __init__(self, *args, trip_s: float = TRIP_S, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.trip_s = trip_s
        self._due: deque[tuple[int, float]] = deque()
        self.sent = 0
        self.most_in_flight = 0

    async def submit(self, tokens, *, start, commit, epoch, parents=None, keep=None) -> None:
        await super().submit(tokens, start=start, commit=commit, epoch=epoch, parents=parents, keep=keep)
        self._due.append((epoch, trio.current_time() + self.trip_s))
        self.sent += 1
        self.most_in_flight = max(self.most_in_flight, len(self._due))

    async def collect(self, *, epoch: int, rows: int) -> torch.Tensor:
        while self._due and self._due[0][0] < epoch:
            self._due.popleft()
        await trio.sleep_until(self._due[0][1])
        self._due.popleft()
        return await super().collect(epoch=epoch, rows=rows)
