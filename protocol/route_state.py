"""The head's side of a route, as a sans-IO state machine: events in, decisions out (h11's manner).

A head drives one `RouteState` per generation. It tells the state what happened — a session opened, a
window went out, a result came back, a deadline passed, a stream broke, the pings or trial windows it
was asked for are in, a plan was made — and the state answers with the one thing to do next:

    Await(due)            wait for the next result until `due`
    Ping(hops, timeouts)  ping these hops, each within its timeout
    TimePrefixes(...)     a trial window through each prefix h1..hi of the route
    Plan(avoid)           survey the swarm and plan a route without `avoid` (and the blacklist)
    Open(hops, ...)       open a session on `hops` (blacklisting and forgetting the peers it names first)
    Resume(replay)        the route is open: go on, replaying the committed tokens if it is a new one
    Fail(failure)         no route is left: the generation ends, and `failure` says why

so failover reads as a sequence of phases (`Phase`) instead of callbacks across objects. The rules
(`docs/failures.md`):

- A window's result is awaited until its deadline (`deadlines.WindowTimer`). When it passes, every hop
  is pinged: those that do not answer are dead and replaced. If all answer, the allowance doubles; at
  the `trial_after`-th miss a trial window goes through each prefix: the first prefix without a result
  ends at the hop that swallows windows; if every prefix answered and the whole route's trial explains
  the wait, the route is merely slow now; otherwise the window was lost and the session is reopened.
- A result after `slow_rounds` slow rounds times the prefixes; the hop that adds the most time is
  replaced if a route without it is estimated faster than the measured rounds, else the route is kept.
- A broken stream or a peer's error pings every hop: the silent ones are blamed, else the peer the error
  names.
- A blamed hop that answers pings is never the end of a generation: with no route around it the head
  waits on the session it has (when the session still works) or reopens one on the same hops. A hop
  that did not answer is pinged once more, with a long timeout; if it is still silent and no peer
  serves its blocks, the head waits for the swarm to heal (`DeadlineRule.hole_wait_s`, surveying every second)
  before a missing replacement ends the generation.
- A peer that leaves (an `Error` with a `LEAVING` code: it is draining) is not pinged and not blamed:
  the head plans around it at once (waiting for a hole it leaves to heal, as above) and never
  blacklists it.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from .deadlines import DeadlineRule, RoundPrior, RoundTimes, WindowTimer
from .messages import Hop
from .route_events import (
    Await,
    Broke,
    DeadlinePassed,
    Decision,
    Event,
    Fail,
    FailoverEvent,
    Fault,
    NoRoute,
    Open,
    Opened,
    OpenFailed,
    Ping,
    Pinged,
    Plan,
    Planned,
    ResultArrived,
    Resume,
    RouteFailure,
    Timed,
    TimePrefixes,
    WindowSent,
)

__all__ = [
    "Await", "Broke", "DeadlinePassed", "Fail", "FailoverEvent", "Fault", "NoRoute", "Open", "OpenFailed",
    "Opened", "Phase", "Ping", "Pinged", "Plan", "Planned", "ResultArrived", "Resume", "RouteFailure",
    "RouteState", "TimePrefixes", "Timed", "WindowSent", "first_silent", "slowest_hop", "LEAVING",
]

REOPEN_PAUSE_S = 0.5  # before the one retry of a first route that failed to open
LEAVING = frozenset({"draining", "shutting_down"})  # Error codes of a peer that leaves on purpose
CONFIRM_FACTOR = 4.0  # the last ping of a peer blamed as dead waits this many times its first timeout


class Phase(Enum):
    """Where the head's route stands."""

    OPENING = "opening"  # a session is being opened
    OPEN = "open"  # windows flow; results are awaited until the oldest window is due
    PINGING = "pinging"  # every hop is being pinged (a deadline passed, a stream broke, or to confirm a death)
    TIMING = "timing"  # trial windows are going through each prefix of the route
    PLANNING = "planning"  # a route without the blamed peers is being planned
    FAILED = "failed"  # no route is left


# --- pure helpers over trial times ---------------------------------------------------------------------


def first_silent(times: Sequence[float | None]) -> int | None:
    """Index of the hop that ends the first prefix without a result (None when every prefix answered)."""
    return next((i for i, t in enumerate(times) if t is None), None)


def slowest_hop(times: Sequence[float | None], min_excess_s: float) -> int | None:
    """Index of the hop whose prefix adds the most time over the one before it, if that is at least
    `min_excess_s` more than the median increment of the others (None otherwise, or if a prefix failed)."""
    if not times or any(t is None for t in times):
        return None
    ts = [float(t) for t in times if t is not None]
    increments = [ts[0]] + [b - a for a, b in zip(ts, ts[1:], strict=False)]
    worst = max(range(len(increments)), key=increments.__getitem__)
    others = sorted(x for i, x in enumerate(increments) if i != worst)
    baseline = others[len(others) // 2] if others else 0.0
    return worst if increments[worst] - baseline >= min_excess_s else None


def short(peer: str) -> str:
    return peer[-8:]


@dataclass
class _Verdict:
    """The judgement under way: why the route is being looked at, whom it blames, and what follows."""

    why: str  # late | broke | slow | confirm | left (the blamed is leaving on purpose) | hole (waiting for it to heal)
    fault: Fault | None = None
    blamed: tuple[str, ...] = ()
    unreachable: bool = False  # the blamed did not answer a ping
    session_usable: bool = True  # the open session may still deliver the window awaited
    declared_at: float = 0.0
    verdict: str = ""
    measured_s: float = 0.0  # slow: the median of the slow rounds


class RouteState:
    """The head's side of one route over a generation (see the module doc): feed `handle` events, do what it says.

    `ping_timeout_s` + `ping_rtts` × a hop's surveyed RTT bounds a ping to it; a hop no survey measured gets
    `ping_timeout_s` + 2 × the route's expected one-token round, at least `probe_timeout_s`.
    """

    def __init__(
        self,
        hops: Sequence[Hop] = (),
        *,
        rule: DeadlineRule | None = None,
        prior: RoundPrior | None = None,
        rtts: Mapping[str, float] | None = None,
        max_failovers: int = 8,
        trial_after: int = 2,
        probe_timeout_s: float = 3.0,
        ping_timeout_s: float = 1.0,
        ping_rtts: float = 5.0,
    ) -> None:
        self.rule = rule or DeadlineRule()
        self.max_failovers = max_failovers
        self.trial_after = trial_after
        self.probe_timeout_s = probe_timeout_s
        self.ping_timeout_s = ping_timeout_s
        self.ping_rtts = ping_rtts
        self.phase = Phase.OPENING
        self.hops: tuple[Hop, ...] = tuple(hops)  # the route being opened, or the open one
        self.prior = prior
        self.rtts: dict[str, float] = dict(rtts or {})
        self.rounds = RoundTimes(self.rule, prior)
        self.timer = WindowTimer(self.rounds)
        self.events: list[FailoverEvent] = []
        self.failure: RouteFailure | None = None
        self.late_checks = 0  # deadlines missed (each pinged the route)
        self.slow_checks = 0  # times the rounds were judged slow (each timed the route's prefixes)
        self.opened_once = False
        self.recoveries = 0  # replacements and reopens decided (opened or not): at most `max_failovers`
        self._open_attempts = 0
        self._opening: tuple[Hop, ...] = self.hops  # the hops of the session being opened
        self._missed = 0  # deadlines the oldest window has missed
        self._missing: tuple[int, ...] = ()  # the blocks the last plan found no peer for
        self._verdict: _Verdict | None = None

    # --- the one entry point --------------------------------------------------------------------------

    def handle(self, event: Event) -> Decision:
        """What to do after `event`."""
        if self.phase is Phase.FAILED:
            assert self.failure is not None
            return Fail(self.failure)
        match event:
            case Opened():
                return self._opened(event)
            case OpenFailed():
                return self._open_failed(event)
            case WindowSent():
                self.timer.sent(event.key, event.tokens, event.now)
                return self._await()
            case ResultArrived():
                return self._result(event)
            case DeadlinePassed():
                return self._late(event.now)
            case Broke():
                return self._broke(event)
            case Pinged():
                return self._pinged(event)
            case Timed():
                return self._timed(event)
            case Planned():
                return self._planned(event)
            case NoRoute():
                return self._no_route(event)
        raise TypeError(f"not a route event: {event!r}")

    # --- opening --------------------------------------------------------------------------------------

    def _opened(self, event: Opened) -> Decision:
        self.hops, self.prior, self._opening = tuple(event.hops), event.prior, tuple(event.hops)
        self.rounds = RoundTimes(self.rule, event.prior)
        self.timer = WindowTimer(self.rounds)
        self.phase = Phase.OPEN
        self._open_attempts = 0
        replay = self.opened_once
        self.opened_once = True
        verdict, self._verdict = self._verdict, None
        if verdict is not None:
            error = verdict.fault.message if verdict.fault is not None else verdict.verdict
            blamed = [] if verdict.why == "left" else list(verdict.blamed)  # a peer leaving on purpose is no culprit
            self.events.append(FailoverEvent(error, blamed, max(0.0, event.now - verdict.declared_at),
                                             [h.peer_id for h in event.hops], verdict.verdict))
        return Resume(replay)

    def _open_failed(self, event: OpenFailed) -> Decision:
        self._open_attempts += 1
        if self._leaving(event.fault):
            return self._left(event.fault, self._verdict.declared_at if self._verdict is not None else event.now)
        if not self.opened_once and self._verdict is None and self._open_attempts == 1:
            return Open(self.hops, self.prior, pause_s=REOPEN_PAUSE_S)  # a stream failing to open is often transient
        fault = event.fault
        declared = self._verdict.declared_at if self._verdict is not None else event.now
        self._verdict = _Verdict("broke", fault, declared_at=declared, session_usable=False,
                                 verdict=f"the route failed to open: {fault.message}")
        self.phase = Phase.PINGING
        return Ping(self._opening, self.ping_timeouts(self._opening))

    # --- windows and results --------------------------------------------------------------------------

    def _await(self) -> Await:
        self.phase = Phase.OPEN
        return Await(self.timer.due())

    def _result(self, event: ResultArrived) -> Decision:
        self.timer.arrived(event.key, event.now)
        if not self.rounds.slow:
            return self._await()
        self.slow_checks += 1
        measured = statistics.median(self.rounds.recent_slow)
        self._verdict = _Verdict("slow", declared_at=event.now, measured_s=measured)
        self.phase = Phase.TIMING
        return TimePrefixes(self.rounds.last_tokens, self.rounds.deadline_s(self.rounds.last_tokens))

    def _late(self, now: float) -> Decision:
        missed = self.timer.late()
        self.late_checks += 1
        self._verdict = _Verdict("late", declared_at=now)
        self._missed = missed
        self.phase = Phase.PINGING
        return Ping(self.hops, self.ping_timeouts(self.hops))

    def _broke(self, event: Broke) -> Decision:
        if self._leaving(event.fault):
            return self._left(event.fault, event.now)
        self._verdict = _Verdict("broke", event.fault, declared_at=event.now, session_usable=False,
                                 verdict=event.fault.message)
        self.phase = Phase.PINGING
        return Ping(self.hops, self.ping_timeouts(self.hops))

    @staticmethod
    def _leaving(fault: Fault) -> bool:
        return fault.code in LEAVING and bool(fault.peer)

    def _left(self, fault: Fault, declared_at: float) -> Decision:
        """A peer leaves on purpose: plan around it at once (no pings, no blame), waiting for its hole to heal."""
        assert fault.peer is not None
        self._verdict = _Verdict("left", fault, blamed=(fault.peer,), declared_at=declared_at, session_usable=False,
                                 verdict=f"{short(fault.peer)} is leaving the swarm")
        return self._replan(self._verdict, wait_s=self.rule.hole_wait_s)

    # --- probes ---------------------------------------------------------------------------------------

    def _pinged(self, event: Pinged) -> Decision:
        verdict = self._verdict
        assert verdict is not None, "pings answered with no verdict under way"
        silent = tuple(event.silent)
        if verdict.why == "confirm":  # the last ping before waiting for the swarm to heal around them
            still = tuple(p for p in verdict.blamed if p in silent)
            if still:
                verdict.why, verdict.blamed = "hole", still
                if self.rule.hole_wait_s <= 0:
                    return self._fail(verdict.verdict + "; no route avoids them", "no_route", list(still), self._missing)
                self.phase = Phase.PLANNING
                return Plan(frozenset(still), wait_s=self.rule.hole_wait_s)
            verdict.unreachable = False  # they answer now: alive after all
            return self._alive_without_replacement(verdict, event.now)
        if silent:
            names = ", ".join(short(p) for p in silent)
            what = "no result by the deadline" if verdict.why == "late" else (
                verdict.fault.message if verdict.fault else "the route failed")
            verdict.blamed, verdict.unreachable = silent, True
            verdict.verdict = f"{what} and {names} did not answer a ping"
            return self._replan(verdict)
        if verdict.why == "broke":
            assert verdict.fault is not None
            verdict.blamed = (verdict.fault.peer,) if verdict.fault.peer else ()
            return self._replan(verdict)
        if self._missed < self.trial_after:  # late, but every hop answers: wait on
            self._verdict = None
            return self._await()
        tokens, _sent = self.timer.oldest() or (1, event.now)
        self.phase = Phase.TIMING
        return TimePrefixes(tokens, self.rounds.deadline_s(tokens))

    def _timed(self, event: Timed) -> Decision:
        verdict = self._verdict
        assert verdict is not None, "trial times with no verdict under way"
        times = list(event.times)
        if verdict.why == "slow":
            i = slowest_hop(times, self.rule.slow_floor_s)
            if i is None:
                return self._keep()
            verdict.blamed = (self.hops[i].peer_id,)
            verdict.verdict = f"hop {short(self.hops[i].peer_id)} is slow: rounds of {verdict.measured_s:.2f} s"
            self.phase = Phase.PLANNING
            return Plan(frozenset(verdict.blamed))
        i = first_silent(times)
        if i is not None:
            peer = self.hops[i].peer_id
            verdict.blamed = (peer,)
            verdict.verdict = f"hop {short(peer)} answers pings but passes no window on"
            return self._replan(verdict)
        whole = times[-1]
        assert whole is not None
        _tokens, sent_at = self.timer.oldest() or (1, event.now)
        if self.rule.deadline_s(whole) >= event.now - sent_at:  # the route is slow now: wait on
            self._verdict = None
            return self._await()
        verdict.session_usable = False
        verdict.verdict = f"a window was lost: a trial one took {whole:.2f} s through the same hops"
        verdict.fault = Fault("stalled", verdict.verdict)
        return self._replan(verdict)

    # --- replanning -----------------------------------------------------------------------------------

    def _replan(self, verdict: _Verdict, wait_s: float = 0.0) -> Decision:
        if self.recoveries >= self.max_failovers:
            return self._give_up(verdict)
        self.phase = Phase.PLANNING
        return Plan(frozenset(verdict.blamed), wait_s=wait_s)

    def _give_up(self, verdict: _Verdict) -> Fail:
        return self._fail(f"giving up after {self.recoveries} attempts to recover; last: {verdict.verdict}", "gave_up",
                          list(verdict.blamed))

    def _open(self, hops: Sequence[Hop], prior: RoundPrior | None, **extra: tuple[str, ...]) -> Open:
        """Open a session on `hops` to recover the route (one more of the `max_failovers` attempts)."""
        self.recoveries += 1
        self.phase = Phase.OPENING
        self._opening = tuple(hops)
        return Open(tuple(hops), prior, **extra)

    def _planned(self, event: Planned) -> Decision:
        self.rtts.update(event.rtts)
        verdict = self._verdict
        assert verdict is not None, "a plan with no verdict under way"
        if verdict.why == "slow":
            faster = event.prior.estimate_s(self.rounds.last_tokens)
            if faster >= verdict.measured_s:
                return self._keep()
            verdict.verdict += f" where a route without it is estimated at {faster:.2f} s"
        forget = verdict.blamed if verdict.unreachable else ()
        blacklist = () if verdict.why == "left" else verdict.blamed
        return self._open(event.hops, event.prior, blacklist=blacklist, forget=forget)

    def _no_route(self, event: NoRoute) -> Decision:
        self.rtts.update(event.rtts)
        verdict = self._verdict
        assert verdict is not None, "no route with no verdict under way"
        if verdict.why == "slow":
            return self._keep()
        verdict.verdict += f" ({event.message})"
        self._missing = tuple(event.missing)
        if verdict.why in ("left", "hole"):  # the swarm did not heal within the wait
            waited = f" within {self.rule.hole_wait_s:.0f} s" if self.rule.hole_wait_s > 0 else ""
            return self._fail(f"{verdict.verdict}; no peer took over their blocks{waited}", "no_route",
                              [] if verdict.why == "left" else list(verdict.blamed), self._missing)
        if verdict.unreachable:  # before a missing replacement ends it all: are they really gone?
            verdict.why = "confirm"
            self.phase = Phase.PINGING
            known = {h.peer_id: h for h in (*self._opening, *self.hops)}
            blamed = tuple(known[p] for p in verdict.blamed if p in known)
            return Ping(blamed, {p: CONFIRM_FACTOR * t for p, t in self.ping_timeouts(blamed).items()})
        return self._alive_without_replacement(verdict, event.now)

    def _alive_without_replacement(self, verdict: _Verdict, now: float) -> Decision:
        """The blamed answer pings and no route avoids them: wait on the session, or reopen one on the same hops."""
        if verdict.session_usable and verdict.why in ("late", "confirm") and self.opened_once:
            self._verdict = None
            self.timer.late()  # give the window more time before the next look
            return self._await()
        if self.recoveries >= self.max_failovers:
            return self._give_up(verdict)
        verdict.verdict += "; reopening on the same peers"
        return self._open(self.hops, self.prior)

    def _keep(self) -> Decision:
        """A slow route judged and kept: not judged again for a while."""
        self.rounds.keep()
        self._verdict = None
        return self._await()

    def _fail(self, message: str, verdict: str, blamed: list[str], missing: Sequence[int] = ()) -> Fail:
        self.phase = Phase.FAILED
        self.failure = RouteFailure(verdict, message, blamed, list(self.events), list(missing))
        return Fail(self.failure)

    # --- timeouts -------------------------------------------------------------------------------------

    def ping_timeouts(self, hops: Sequence[Hop]) -> dict[str, float]:
        """How long a ping to each distinct hop may take: a floor plus a few of its surveyed RTTs; a hop no survey
        measured gets the floor plus twice the route's expected one-token round (which crosses every link a
        ping to any hop does), and never less than `probe_timeout_s`."""
        round_s = self.rounds.expected_s(1)
        unsurveyed = self.probe_timeout_s if round_s is None else max(self.probe_timeout_s,
                                                                     self.ping_timeout_s + 2 * round_s)
        out: dict[str, float] = {}
        for hop in hops:
            rtt = self.rtts.get(hop.peer_id)
            out[hop.peer_id] = unsurveyed if rtt is None else self.ping_timeout_s + self.ping_rtts * rtt
        return out
