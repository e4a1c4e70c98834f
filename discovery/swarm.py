"""A head process's one view of the swarm: the last survey (records, RTTs, the planned route or what is
missing), the peers it has blamed (`Blacklist`: seconds, for liveness), the peers caught lying (`Bans`: hours,
with the evidence), and plans for its routes.

One `SwarmWatch` per head process: `dsd-node serve` keeps it refreshed in the background every
`refresh_s` and on demand (a request that finds no route, a route that failed), so requests start
on the last planned route without paying for a survey, and its swarm page reads the same `view`
and `last_alive` (the peers seen answering, so one that vanished is shown dead for a while). Every
route of the process plans its failovers here (`plan`), avoiding the process's blacklist: a peer
blamed by one request is avoided by the next. Refreshes are coalesced: a caller that asks while one
runs gets its result. A head that serves layers itself surveys routes over the others only (`blocks`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio

from dsd.protocol import Hop

from .host import P2PNode
from .planner import NoRouteError
from .records import PeerRecord
from .survey import SwarmView, survey

log = logging.getLogger(__name__)

DEAD_KEPT_S = 600.0  # a peer that stopped answering is remembered (shown dead) this long


@dataclass
class Blacklist:
    """Peers to avoid, each until its backoff runs out (and why); the backoff doubles on every new failure."""

    base_s: float = 30.0
    max_s: float = 600.0
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)
    _why: dict[str, str] = field(default_factory=dict)

    def add(self, peer: str, now: float | None = None, *, why: str = "did not answer") -> float:
        """Blacklist `peer` for `why`; returns how long for."""
        now = time.monotonic() if now is None else now
        strikes = self._strikes.get(peer, 0)
        self._strikes[peer] = strikes + 1
        backoff = min(self.max_s, self.base_s * 2**strikes)
        self._until[peer] = now + backoff
        self._why[peer] = why
        return backoff

    def active(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {p for p, until in self._until.items() if until > now}

    def reason(self, peer: str, now: float | None = None) -> str:
        """Why and until when (UTC wall clock) `peer` is blacklisted, for logs and "no route" messages."""
        now = time.monotonic() if now is None else now
        left = max(0.0, self._until.get(peer, now) - now)
        until = time.strftime("%H:%M:%S", time.gmtime(time.time() + left))
        return f"blacklisted until {until} UTC, {left:.0f} s more: {self._why.get(peer, 'did not answer')}"


BAN_S = 24 * 3600.0  # a peer caught returning wrong activations is avoided this long


@dataclass(frozen=True)
class Ban:
    """A peer caught lying: until when (unix time), why in a line, and the evidence that convicted it."""

    peer_id: str
    until_unix: float
    message: str
    evidence: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "until_unix": round(self.until_unix, 1), "message": self.message,
                "evidence": self.evidence}


@dataclass
class Bans:
    """Peers this head process caught returning wrong hidden states; kept across requests (not the liveness
    blacklist's seconds: a liar does not become honest by waiting)."""

    duration_s: float = BAN_S
    _bans: dict[str, Ban] = field(default_factory=dict)

    def add(self, peer: str, message: str, evidence: dict[str, Any], now_unix: float | None = None) -> Ban:
        """Ban `peer` for `duration_s` from now, saying why (a later ban replaces an earlier one)."""
        now_unix = time.time() if now_unix is None else now_unix
        ban = Ban(peer, now_unix + self.duration_s, message, evidence)
        self._bans[peer] = ban
        return ban

    def active(self, now_unix: float | None = None) -> dict[str, Ban]:
        now_unix = time.time() if now_unix is None else now_unix
        return {p: b for p, b in self._bans.items() if b.until_unix > now_unix}

    def reason(self, peer: str) -> str:
        """Why and until when (UTC) `peer` is banned."""
        ban = self._bans[peer]
        until = time.strftime("%Y-%m-%d %H:%M", time.gmtime(ban.until_unix))
        return f"banned until {until} UTC: {ban.message[:80]}"


CHANGES_KEPT = 50  # the swarm changes a watch remembers


@dataclass(frozen=True)
class SwarmChange:
    """A block peer that joined, left or moved its span between two surveys (what the swarm page lists)."""

    at_unix: float
    peer_id: str
    what: str  # joined | left | moved
    span: tuple[int, int]
    before: tuple[int, int] | None = None  # moved: the span it left

    def as_dict(self) -> dict:
        return {"at_unix": round(self.at_unix, 3), "peer_id": self.peer_id, "what": self.what,
                "span": list(self.span), "before": None if self.before is None else list(self.before)}


def swarm_changes(before: SwarmView, after: SwarmView, at_unix: float) -> list[SwarmChange]:
    """The block peers that joined, left or moved between two views (by their live records)."""

    def spans(view: SwarmView) -> dict[str, tuple[int, int]]:
        return {r.peer_id: (r.start, r.end) for r in view.records if r.role == "block" and r.expires > at_unix}

    old, new = spans(before), spans(after)
    out = [SwarmChange(at_unix, p, "joined", span) for p, span in new.items() if p not in old]
    out += [SwarmChange(at_unix, p, "moved", span, old[p]) for p, span in new.items() if p in old and old[p] != span]
    out += [SwarmChange(at_unix, p, "left", span) for p, span in old.items() if p not in new]
    return out


class SwarmWatch:
    """The last `SwarmView` of `model` and when it was taken."""

    def __init__(self, node: P2PNode, model: str, num_layers: int, *, refresh_s: float = 15.0,
                 survey_timeout_s: float = 30.0, blocks: tuple[int, int] | None = None,
                 blacklist: Blacklist | None = None, bans: Bans | None = None,
                 on_survey: Callable[[SwarmView | None, SwarmView], None] | None = None,
                 weights: str | None = None) -> None:
        self.node = node
        self.weights = weights  # the routes' weight format (None: the cheapest format's; "any": mixed)
        self.model = model
        self.num_layers = num_layers
        self.blocks = blocks  # the layers a route must cover (None: every layer)
        self.blacklist = blacklist or Blacklist()
        self.bans = bans or Bans()
        self.on_survey = on_survey  # (the view before, the new one) after each refresh: the service's metrics
        self.refresh_s = refresh_s
        self.survey_timeout_s = survey_timeout_s
        self.view: SwarmView | None = None
        self.surveyed_at = 0.0  # trio clock
        self.surveyed_unix = 0.0
        self.last_alive: dict[str, tuple[PeerRecord, float]] = {}  # peer id -> its last live record, unix time
        self.records: dict[str, PeerRecord] = {}  # peer id -> the newest record any survey fetched (alive or not)
        self.changes: deque[SwarmChange] = deque(maxlen=CHANGES_KEPT)  # peers that joined, left or moved, oldest first
        self._lock = trio.Lock()
        self._wake = trio.Event()

    def avoided(self) -> set[str]:
        """The peers no route of this process may use now: blacklisted (unresponsive) or banned (caught lying)."""
        return self.blacklist.active() | set(self.bans.active())

    def exclusions(self, avoid: Mapping[str, str] | Iterable[str] = ()) -> dict[str, str]:
        """Every peer a plan must leave out, with why: `avoid` (a mapping gives its own reasons; else "avoided by
        this route"), the banned and the blacklisted, each saying until when."""
        out = dict(avoid) if isinstance(avoid, Mapping) else dict.fromkeys(avoid, "avoided by this route")
        for peer in self.bans.active():
            out.setdefault(peer, self.bans.reason(peer))
        for peer in self.blacklist.active():
            out.setdefault(peer, self.blacklist.reason(peer))
        return out

    @property
    def hops(self) -> list[Hop] | None:
        """The planned route of the last survey, or None."""
        if self.view is None or self.view.plan is None:
            return None
        return list(self.view.plan.protocol_hops())

    def route_to_start(self) -> list[Hop] | None:
        """The last survey's route for a new generation to start on, unless it crosses a peer this process has
        blacklisted or banned since (then None: the generation plans its own route, avoiding it)."""
        hops = self.hops
        if hops is not None and {h.peer_id for h in hops} & self.avoided():
            return None
        return hops

    @property
    def missing(self) -> NoRouteError:
        """Why there is no route: the last survey's error (every block is missing before the first)."""
        if self.view is not None and self.view.error is not None:
            return self.view.error
        first, last = self.blocks or (0, self.num_layers)
        return NoRouteError(list(range(first, last)), self.num_layers)

    async def refresh(self, max_age_s: float = 0.0) -> SwarmView:
        """A view at most `max_age_s` old: the last one, or a new survey (one at a time)."""
        asked = trio.current_time()
        async with self._lock:
            if self.view is not None and self.surveyed_at >= asked - max_age_s:
                return self.view
            with trio.fail_after(self.survey_timeout_s):
                view = await survey(self.node, self.model, self.num_layers, blocks=self.blocks, weights=self.weights,
                                    blacklist={p: self.bans.reason(p) for p in self.bans.active()})
            before = self.view
            self.view, self.surveyed_at, self.surveyed_unix = view, trio.current_time(), time.time()
            self._remember(view, self.surveyed_unix)
            self._note(before, view)
            return view

    async def plan(self, avoid: Mapping[str, str] | Iterable[str] = frozenset(), *, wait_s: float = 0.0,
                   weights: str | None = None) -> SwarmView:
        """A fresh survey planned without the blacklisted and banned peers and `avoid` (peers, or peers with why;
        a failover's view: the shared `view` is left as it is; the live peers it saw are remembered). With `wait_s`,
        a survey that finds blocks missing is repeated for up to that long, saying what it waits for (records can
        lag: a peer just started, or the node that held its record left); the last view says what is still
        missing, and why each peer left out was. `weights`: this plan's weight format (default the watch's)."""
        banned = self.exclusions(avoid)
        give_up = trio.current_time() + wait_s
        level = logging.WARNING  # the first wait is news; the surveys after it are detail
        while True:
            with trio.fail_after(self.survey_timeout_s):
                view = await survey(self.node, self.model, self.num_layers, blocks=self.blocks,
                                    weights=weights or self.weights, blacklist=banned)
            self._remember(view, time.time())
            left = give_up - trio.current_time()
            if view.plan is not None or left <= 0:
                return view
            log.log(level, "%s; waiting up to %.0f s more for the swarm's records", view.error, left)
            level = logging.INFO
            await trio.sleep(min(1.0, left))

    def _remember(self, view: SwarmView, now: float) -> None:
        """Keep the records of the peers that answered the probes (seen at `now`, unix time); forget the long dead.
        Every record fetched is kept in `records` (what a peer announced: its dtype and codec, for audits)."""
        for rec in view.records:
            if rec.peer_id not in self.records or rec.issued >= self.records[rec.peer_id].issued:
                self.records[rec.peer_id] = rec
            if view.rtts.get(rec.peer_id) is not None:
                self.last_alive[rec.peer_id] = (rec, now)
        for peer, (_, seen) in list(self.last_alive.items()):
            if seen < now - DEAD_KEPT_S:
                del self.last_alive[peer]
        for peer, rec in list(self.records.items()):
            if rec.expires < now - DEAD_KEPT_S:
                del self.records[peer]

    def _note(self, before: SwarmView | None, view: SwarmView) -> None:
        if before is not None:
            self.changes.extend(swarm_changes(before, view, self.surveyed_unix))
        if self.on_survey is not None:
            self.on_survey(before, view)
        route = view.plan.peers if view.plan is not None else []
        old = before.plan.peers if before is not None and before.plan is not None else None
        if view.plan is None and (before is None or before.plan is not None):
            log.warning("no complete route for %s: %s", self.model, view.error)
        elif view.plan is not None and route != old:
            spans = ", ".join(f"{h.peer_id[-8:]} {h.start}:{h.end}" for h in view.plan.hops)
            log.info("route for %s: %s (est. %.1f ms per round)", self.model, spans, view.plan.est_round_s * 1000)

    def poke(self) -> None:
        """Survey again soon, in the background (a route failed over: the view is stale)."""
        self._wake.set()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Survey now (a failure is logged: requests will retry), then every `refresh_s` or when poked."""
        started = False
        while True:
            try:
                await self.refresh(max_age_s=1.0)
            except Exception as exc:  # the DHT or a probe failed, or the survey timed out: try again later
                log.warning("swarm survey failed: %r", exc)
            if not started:
                task_status.started()
                started = True
            with trio.move_on_after(self.refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
