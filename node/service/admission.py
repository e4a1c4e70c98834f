"""How many generations run at once, how many may wait, and how they are shared between clients.

A request is admitted synchronously when it arrives (`reserve`): it either gets a place
(running or waiting) or is refused at once with `Busy` (the API answers 429). Fairness
between clients (an API key, else an address: `guards.client_of`):
- a client holds at most `max_per_client` places when that is set;
- when every place is taken, a newcomer holding less than its fair share (the places divided
  by the clients holding some, itself included) takes the newest waiting place of the client
  furthest over its share; that request is answered 429 as if it had come when the server was full;
- a freed running slot goes to the waiting request whose client runs fewest, then the oldest.
Running generations are never interrupted. A place is given back when the generation ends,
fails or is cancelled (the client went away).
"""

from __future__ import annotations

import itertools
from types import TracebackType

import trio

from .wire_errors import WireError

WAITING, RUNNING, EVICTED, RELEASED = "waiting", "running", "evicted", "released"


class Busy(Exception):
    """Every place is taken (or the client holds all it may)."""


class Slot:
    """One admitted request's place: wait for a running slot with `async with`; released on exit (once)."""

    def __init__(self, admission: Admission, client: str, seq: int) -> None:
        self._admission = admission
        self.client = client
        self.seq = seq  # arrival order
        self.state = WAITING
        self._go = trio.Event()  # set when it runs or is evicted
        self.queued_s = 0.0  # how long it waited for a running slot

    async def __aenter__(self) -> Slot:
        t0 = trio.current_time()
        try:
            await self._go.wait()
        except BaseException:
            self.release()
            raise
        if self.state == EVICTED:
            self.release()
            raise WireError(429, "your waiting request gave its place to another client's: you hold more than your "
                            "share of this server's places; retry later", type="rate_limit_error",
                            code="rate_limit_exceeded")
        self.queued_s = trio.current_time() - t0
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.release()

    def release(self) -> None:
        """Give the place back (its running slot too, if it had one); idempotent."""
        if self.state != RELEASED:
            self._admission._release(self)


class Admission:
    """At most `max_running` generations at once; at most `max_waiting` more wait for one; shared fairly."""

    def __init__(self, max_running: int, max_waiting: int, max_per_client: int = 0) -> None:
        if max_running < 1 or max_waiting < 0 or max_per_client < 0:
            raise ValueError(f"need max_running >= 1, max_waiting >= 0 and max_per_client >= 0, got {max_running}, "
                             f"{max_waiting}, {max_per_client}")
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_per_client = max_per_client  # 0: no fixed cap (the fair share still applies when full)
        self._places: dict[str, list[Slot]] = {}  # per client, in arrival order
        self._waiting: list[Slot] = []  # in arrival order
        self._seq = itertools.count()
        self.running = 0
        self.evicted = 0  # waiting requests that gave their place to a client under its share

    @property
    def capacity(self) -> int:
        return self.max_running + self.max_waiting

    @property
    def admitted(self) -> int:
        """Requests holding a place: running + waiting."""
        return self.running + len(self._waiting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def held(self, client: str) -> int:
        return len(self._places.get(client, ()))

    def reserve(self, client: str = "") -> Slot:
        """A place for one more request of `client`, or `Busy` (see the module's rules)."""
        held = self.held(client)
        if self.max_per_client and held >= self.max_per_client:
            raise Busy(f"you have {held} requests running or waiting, the most one client may (the server's "
                       f"--max-per-client {self.max_per_client}); retry when one ends")
        if self.admitted >= self.capacity:
            victim = self._over_share(client)
            if victim is None:
                raise Busy(f"{self.running} requests are running and {self.waiting} waiting (the server's limits: "
                           f"--max-concurrent {self.max_running}, --queue {self.max_waiting}); retry later")
            self._evict(victim)
        slot = Slot(self, client, next(self._seq))
        self._places.setdefault(client, []).append(slot)
        self._waiting.append(slot)
        self._dispatch()
        return slot

    def _over_share(self, client: str) -> Slot | None:
        """The newest waiting place of the client furthest over its fair share, when `client` is under it."""
        share = self.capacity / len(self._places.keys() | {client})
        if self.held(client) + 1 > share:
            return None
        over = [(len(slots), c) for c, slots in self._places.items()
                if len(slots) > share and any(s.state == WAITING for s in slots)]
        if not over:
            return None
        _, richest = max(over)
        return next(s for s in reversed(self._places[richest]) if s.state == WAITING)

    def _evict(self, slot: Slot) -> None:
        self._waiting.remove(slot)
        self._forget(slot)
        slot.state = EVICTED
        self.evicted += 1
        slot._go.set()

    def _dispatch(self) -> None:
        """Hand free running slots to the waiting requests of the clients running fewest, oldest first."""
        while self.running < self.max_running and self._waiting:
            runs = {c: sum(s.state == RUNNING for s in slots) for c, slots in self._places.items()}
            slot = min(self._waiting, key=lambda s: (runs[s.client], s.seq))
            self._waiting.remove(slot)
            slot.state = RUNNING
            self.running += 1
            slot._go.set()

    def _forget(self, slot: Slot) -> None:
        slots = self._places[slot.client]
        slots.remove(slot)
        if not slots:
            del self._places[slot.client]

    def _release(self, slot: Slot) -> None:
        if slot.state == RUNNING:
            self.running -= 1
        if slot.state == WAITING:
            self._waiting.remove(slot)
        if slot.state in (RUNNING, WAITING):
            self._forget(slot)
        slot.state = RELEASED
        self._dispatch()
