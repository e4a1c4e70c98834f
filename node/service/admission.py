"""How many generations run at once and how many may wait: a fair (FIFO) slot limiter with a bounded queue.

A request is admitted synchronously when it arrives (`reserve`): it either gets a place
(running or waiting) or is refused at once with `Busy` (the API answers 429). The place
becomes a running slot in arrival order (`async with slot`), and is given back when the
generation ends, fails or is cancelled (the client went away).
"""

from __future__ import annotations

from types import TracebackType

import trio


class Busy(Exception):
    """Every slot is taken and the queue is full."""


class Slot:
    """One admitted request's place: wait for a running slot with `async with`; released on exit (once)."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._released = False
        self.queued_s = 0.0  # how long it waited for a running slot

    async def __aenter__(self) -> Slot:
        t0 = trio.current_time()
        try:
            await self._admission._slots.acquire_on_behalf_of(self)
        except BaseException:
            self.release()
            raise
        self.queued_s = trio.current_time() - t0
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._admission._slots.release_on_behalf_of(self)
        self.release()

    def release(self) -> None:
        """Give the place back (idempotent; also for a request that never ran)."""
        if not self._released:
            self._released = True
            self._admission.admitted -= 1


class Admission:
    """At most `max_running` generations at once; at most `max_waiting` more wait for one."""

    def __init__(self, max_running: int, max_waiting: int) -> None:
        if max_running < 1 or max_waiting < 0:
            raise ValueError(f"need max_running >= 1 and max_waiting >= 0, got {max_running}, {max_waiting}")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self._slots = trio.CapacityLimiter(max_running)
        self.admitted = 0  # running + waiting

    @property
    def running(self) -> int:
        return int(self._slots.borrowed_tokens)

    @property
    def waiting(self) -> int:
        return self.admitted - self.running

    def reserve(self) -> Slot:
        """A place for one more request, or `Busy` when `max_running` run and `max_waiting` wait already."""
        if self.admitted >= self.max_running + self.max_waiting:
            raise Busy(f"{self.running} requests are running and {self.waiting} waiting (the server's limits: "
                       f"--max-concurrent {self.max_running}, --queue {self.max_waiting}); retry later")
        self.admitted += 1
        return Slot(self)
