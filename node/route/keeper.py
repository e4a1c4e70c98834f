"""Keeping a route alive: deadlines, blame, blacklist with backoff, re-plan, reopen; the backend replays.

A window's result is awaited only as long as the route's measured rounds say (`dsd.node.head.deadline`:
k × p95 + a floor, capped; the planner's estimate before the first round). When that deadline passes,
the keeper pings every hop of the route at once with a short deadline: hops that do not answer
(frozen, partitioned, behind a dead connection that never reset) are blamed and the route replaced.
If every hop answers, the window's allowance doubles; when it passes again, a trial window through
each prefix of the route finds the hop that swallows windows (`dsd.node.route.deadline`). A route
whose rounds are `slow_factor` times the plan's estimate for `slow_rounds` rounds has its slowest
hop found the same way, and is replaced if a route without that hop is estimated faster.

When a window fails otherwise (a stream resets, a peer answers with an error), the head pings every
hop; peers that do not answer, else the peer the error names, are blamed.

Replacing: blacklist the blamed peers for a backoff that doubles with each failure, plan a new route
without them from a fresh survey, open a session on it; the backend replays the committed tokens
into the new peers' caches and carries on, so no token is lost or repeated.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio

from dsd.discovery.host import P2PNode
from dsd.discovery.planner import NoRouteError, RoutePlan
from dsd.discovery.survey import survey, wait_for_route
from dsd.discovery.tasks import owned_nursery
from dsd.node.head.deadline import DeadlineRule, RoundPrior, RoundTimes
from dsd.protocol import Hop, WireFormat

from .deadline import SilentHopError, first_silent, ping_hops, short, slowest_hop, time_prefixes
from .errors import RouteError
from .legs import ReturnLegs
from .session import RouteSession

log = logging.getLogger(__name__)

REOPEN_PAUSE_S = 0.5  # before the one retry of a route that failed to open
# A head that finds blocks missing before its first route waits this long for the swarm's records to show them.
FIRST_ROUTE_WAIT_S = 10.0


def plan_prior(plan: RoutePlan) -> RoundPrior:
    """The planner's round estimate as fixed seconds (links, overheads) plus compute per window token."""
    compute = sum(h.compute_s for h in plan.hops)
    return RoundPrior(max(0.0, plan.est_round_s - compute), compute / plan.window_tokens)


@dataclass
class Blacklist:
    """Peers to avoid, each until its backoff runs out; the backoff doubles on every new failure."""

    base_s: float = 30.0
    max_s: float = 600.0
    _until: dict[str, float] = field(default_factory=dict)
    _strikes: dict[str, int] = field(default_factory=dict)

    def add(self, peer: str, now: float | None = None) -> float:
        """Blacklist `peer`; returns how long for."""
        now = time.monotonic() if now is None else now
        strikes = self._strikes.get(peer, 0)
        self._strikes[peer] = strikes + 1
        backoff = min(self.max_s, self.base_s * 2**strikes)
        self._until[peer] = now + backoff
        return backoff

    def active(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {p for p, until in self._until.items() if until > now}


@dataclass
class FailoverEvent:
    """One recovery: what failed, whom we blamed, and how long until the new route was open."""

    error: str
    blamed: list[str]
    seconds: float
    new_route: list[str]


class RouteKeeper:
    """Owns the head's current `RouteSession` and replaces it when it fails (from any task).

    Every session's watcher runs in `nursery`, the keeper's own (see `open_route_keeper`), under
    that session's cancel scope, so closing a failed session stops just its watcher; a replaced
    session is closed there in the background. `deadline` holds the constants of the deadline and
    slowness rule; a ping to a hop waits `ping_timeout_s` + `ping_rtts` × the RTT the last survey
    measured to it (when none did, `ping_timeout_s` + 2 × the route's expected one-token round, at
    least `probe_timeout_s`). `blocks` = (start, end) routes only those layers
    (the head serves the others itself); default every layer.
    """

    def __init__(
        self,
        node: P2PNode,
        legs: ReturnLegs,
        nursery: trio.Nursery,
        *,
        model: str,
        num_layers: int,
        max_len: int,
        wire: WireFormat | None = None,
        blacklist: Blacklist | None = None,
        max_failovers: int = 8,
        probe_timeout_s: float = 3.0,
        deadline: DeadlineRule | None = None,
        ping_timeout_s: float = 1.0,
        ping_rtts: float = 5.0,
        trial_after: int = 2,
        blocks: tuple[int, int] | None = None,
    ) -> None:
        self.node = node
        self.legs = legs
        self.model = model
        self.num_layers = num_layers
        self.blocks = blocks
        self.max_len = max_len
        self.wire = wire
        self.blacklist = blacklist or Blacklist()
        self.max_failovers = max_failovers
        self.probe_timeout_s = probe_timeout_s
        self.deadline = deadline or DeadlineRule()
        self.ping_timeout_s = ping_timeout_s
        self.ping_rtts = ping_rtts
        self.trial_after = trial_after
        self.events: list[FailoverEvent] = []
        self.late_checks = 0  # deadlines missed (each probed the route)
        self.slow_checks = 0  # times the rounds were judged slow (each timed the route's prefixes)
        self.session: RouteSession | None = None
        self._closed_sent = 0
        self._closed_received = 0
        self._nursery = nursery
        self._rtts: dict[str, float] = {}  # RTTs the last surveys measured
        self._planned: tuple[list[Hop], RoundPrior] | None = None  # a plan made while judging a slow route

    async def _plan(self, avoid: frozenset[str] = frozenset(), wait_s: float = 0.0) -> tuple[list[Hop], RoundPrior]:
        """A route from a fresh survey, without the blacklisted peers and `avoid`; when blocks are missing, survey
        again for up to `wait_s` (a NoRouteError after that, or at once with 0)."""
        blacklist = self.blacklist.active() | avoid
        if wait_s > 0:
            try:
                view = await wait_for_route(self.node, self.model, self.num_layers, wait_s, blocks=self.blocks,
                                            blacklist=blacklist)
            except TimeoutError as exc:
                raise NoRouteError(list(range(*(self.blocks or (0, self.num_layers)))), self.num_layers) from exc
        else:
            view = await survey(self.node, self.model, self.num_layers, blacklist=blacklist, blocks=self.blocks)
        self._rtts.update({pid: rtt for pid, rtt in view.rtts.items() if rtt is not None})
        if view.plan is None:
            assert view.error is not None
            raise view.error
        return list(view.plan.protocol_hops()), plan_prior(view.plan)

    async def open_first(self, hops: list[Hop], prior: RoundPrior | None) -> None:
        """Open the first session. A route that fails to open is retried once on the same peers (a stream that
        failed to open to a live peer is usually transient), then failed over like any route: blame, re-plan."""
        try:
            await self._open(hops, prior)
            return
        except RouteError as error:
            log.warning("opening the route failed (%s); retrying once on the same peers", error)
        await trio.sleep(REOPEN_PAUSE_S)
        try:
            await self._open(hops, prior)
        except RouteError as error:
            await self.replace(error, tried=hops)

    async def _open(self, hops: list[Hop], prior: RoundPrior | None) -> None:
        session = RouteSession(self.node, self.legs, hops, model=self.model, max_len=self.max_len, wire=self.wire,
                               rule=self.deadline, prior=prior, on_late=self._late, on_slow=self._slow)
        await session.open(self._nursery)
        self.session = session

    @property
    def bytes_sent(self) -> int:
        """Bytes the head sent over every session this keeper opened."""
        return self._closed_sent + (self.session.traffic.sent if self.session else 0)

    @property
    def bytes_received(self) -> int:
        return self._closed_received + (self.session.traffic.received if self.session else 0)

    def _retire(self) -> RouteSession | None:
        """Drop the current session, counting its bytes; the caller closes it."""
        session, self.session = self.session, None
        if session is not None:
            self._closed_sent += session.traffic.sent
            self._closed_received += session.traffic.received
        return session

    async def _close_session(self) -> None:
        session = self._retire()
        if session is not None:
            await session.close()  # best effort within its own deadline: the old route may be broken

    def ping_timeouts(self, hops: Sequence[Hop], rounds: RoundTimes | None) -> dict[str, float]:
        """How long a ping to each hop may take: a floor plus a few of its surveyed RTTs. A hop no survey
        measured (a route given, not planned) gets the floor plus twice the route's expected one-token
        round from `rounds`, which crosses every link a ping to any hop does, and never less than
        `probe_timeout_s`: on links slower than that, a fixed timeout would blame every live hop."""
        round_s = None if rounds is None else rounds.expected_s(1)
        unsurveyed = self.probe_timeout_s if round_s is None else max(self.probe_timeout_s,
                                                                     self.ping_timeout_s + 2 * round_s)
        out: dict[str, float] = {}
        for hop in hops:
            rtt = self._rtts.get(hop.peer_id)
            out[hop.peer_id] = unsurveyed if rtt is None else self.ping_timeout_s + self.ping_rtts * rtt
        return out

    async def _trial(self, session: RouteSession, tokens: int) -> list[float | None]:
        """Trial windows of `tokens` tokens through every prefix of the session's route."""
        assert session.hidden_size is not None, "a route is probed only after a window went out"
        return await time_prefixes(self.node, self.legs, session.hops, model=self.model, hidden_size=session.hidden_size,
                                   tokens=tokens, limit_s=session.rounds.deadline_s(tokens), wire=self.wire)

    async def _late(self, session: RouteSession, missed: int) -> None:
        """A window of `session` missed its deadline `missed` times: find a silent hop, or wait on."""
        self.late_checks += 1
        silent = await ping_hops(self.node, session.hops, self.ping_timeouts(session.hops, session.rounds))
        if silent:
            names = ", ".join(short(p) for p in silent)
            raise SilentHopError(f"no result by the deadline and {names} did not answer a ping", silent, unreachable=True)
        if missed < self.trial_after:
            log.info("session %s: late, but every hop answers a ping; waiting on", session.id)
            return
        tokens, sent_at = session.timer.oldest() or (1, trio.current_time())
        times = await self._trial(session, tokens)
        i = first_silent(times)
        if i is not None:
            peer = session.hops[i].peer_id
            raise SilentHopError(f"hop {short(peer)} answers pings but passes no window on", [peer])
        whole = times[-1]
        assert whole is not None
        if self.deadline.deadline_s(whole) >= trio.current_time() - sent_at:
            log.info("session %s: the route is slow now (a trial took %.2f s); waiting on", session.id, whole)
            return
        raise RouteError(f"a window was lost: a trial one took {whole:.2f} s through the same hops; reopening",
                         code="stalled")

    async def _slow(self, session: RouteSession) -> None:
        """The session's rounds are slow: find the slow hop; give the route up if one without it is faster."""
        self.slow_checks += 1
        rounds = session.rounds
        measured = statistics.median(rounds.recent_slow)
        times = await self._trial(session, rounds.last_tokens)
        i = slowest_hop(times, self.deadline.slow_floor_s)
        if i is None:
            log.info("session %s: rounds of %.2f s are slow, but no hop stands out; kept", session.id, measured)
            rounds.keep()
            return
        peer = session.hops[i].peer_id
        try:
            hops, prior = await self._plan(frozenset({peer}))
        except Exception as exc:  # no route without it (NoRouteError), or the survey failed
            log.info("session %s: hop %s is slow but no route avoids it (%s); kept", session.id, short(peer), exc)
            rounds.keep()
            return
        faster = prior.estimate_s(rounds.last_tokens)
        if faster >= measured:
            log.info("session %s: hop %s is slow, but no faster route (est. %.2f s vs %.2f s); kept",
                     session.id, short(peer), faster, measured)
            rounds.keep()
            return
        self._planned = (hops, prior)
        raise SilentHopError(f"hop {short(peer)} is slow: rounds of {measured:.2f} s where a route without it "
                             f"is estimated at {faster:.2f} s", [peer], code="slow")

    async def _blame(self, error: RouteError, hops: list[Hop], rounds: RoundTimes | None) -> tuple[list[str], bool]:
        """Peers to blacklist: those not answering a ping (True), else the one the error blames (False)."""
        dead = await ping_hops(self.node, hops, self.ping_timeouts(hops, rounds))
        if dead:
            return dead, True
        return ([error.peer] if error.peer else []), False

    async def replace(self, error: RouteError, tried: list[Hop] | None = None) -> RouteSession:
        """Blacklist the culprits, re-plan and open a new session; raises NoRouteError if none is left.

        `tried`: the hops of a route that never opened (there is no session to take them from)."""
        if len(self.events) >= self.max_failovers:
            raise RouteError(f"giving up after {len(self.events)} failovers; last error: {error}") from error
        t0 = time.perf_counter()
        old = self._retire()
        hops = old.hops if old is not None else (tried or [])
        if old is not None:
            self._nursery.start_soon(old.close)  # best effort, in the background: the old route may be frozen
        if isinstance(error, SilentHopError):
            blamed, unreachable = error.peers, error.unreachable
        else:
            blamed, unreachable = await self._blame(error, hops, old.rounds if old is not None else None)
        for peer in blamed:
            backoff = self.blacklist.add(peer)
            log.warning("route failed (%s): blacklisting %s for %.0f s", error, peer, backoff)
            if unreachable:
                self._nursery.start_soon(self.node.forget_peer, peer)
        planned, self._planned = self._planned, None
        new_hops, prior = planned if planned is not None and error.code == "slow" else await self._plan()
        await self._open(new_hops, prior)
        event = FailoverEvent(str(error), blamed, time.perf_counter() - t0, [h.peer_id for h in new_hops])
        self.events.append(event)
        log.warning("failover %d: new route %s in %.2f s", len(self.events), event.new_route, event.seconds)
        assert self.session is not None
        return self.session


@asynccontextmanager
async def open_route_keeper(
    node: P2PNode, legs: ReturnLegs, *, hops: list[Hop] | None = None, avoid: frozenset[str] = frozenset(),
    **options: Any
) -> AsyncIterator[RouteKeeper]:
    """A `RouteKeeper` (options as its constructor's) with a session open on `hops` (else on a fresh plan that
    leaves out the peers in `avoid`; later failovers may use them) for the block.

    The keeper's nursery holds its sessions' watchers; an error inside the block comes out as
    itself, not wrapped in an exception group.
    """
    async with owned_nursery() as nursery:
        keeper = RouteKeeper(node, legs, nursery, **options)
        await keeper.open_first(*((hops, None) if hops else await keeper._plan(avoid, wait_s=FIRST_ROUTE_WAIT_S)))
        try:
            yield keeper
        finally:
            await keeper._close_session()
