"""The head's side of a route as a sans-IO state machine: each failure reads as a sequence of decisions.

Pure code over numbers and hop lists: no network, no clock (every event carries its time)."""

from __future__ import annotations

import pytest

from dsd.protocol import Hop
from dsd.protocol.deadlines import DeadlineRule, RoundPrior
from dsd.protocol.route_state import (
    CONFIRM_FACTOR,
    REOPEN_PAUSE_S,
    Await,
    Broke,
    DeadlinePassed,
    Fail,
    Fault,
    NoRoute,
    Open,
    Opened,
    OpenFailed,
    Phase,
    Ping,
    Pinged,
    Plan,
    Planned,
    ResultArrived,
    Resume,
    RouteState,
    Timed,
    TimePrefixes,
    WindowSent,
)

A, B, C, D = (Hop(f"peer-{x}", (f"/ip4/127.0.0.1/tcp/{4000 + i}",), 2 * i, 2 * i + 2) for i, x in enumerate("abcd"))
ROUTE = (A, B, C)
PRIOR = RoundPrior(fixed_s=0.1, per_token_s=0.01)


def opened(state: RouteState, hops=ROUTE, now: float = 0.0) -> Resume:
    decision = state.handle(Opened(tuple(hops), PRIOR, now))
    assert isinstance(decision, Resume)
    return decision


def late_window(state: RouteState, now: float = 0.0) -> float:
    """A window sent at `now` whose deadline then passes; returns when it was due."""
    state.handle(WindowSent((0, 10), 4, now))
    due = state.timer.due()
    assert due is not None
    return due


def test_a_healthy_route_awaits_each_result_until_its_deadline() -> None:
    state = RouteState(ROUTE, prior=PRIOR)
    assert opened(state) == Resume(replay=False) and state.phase is Phase.OPEN
    decision = state.handle(WindowSent((0, 0), 4, 1.0))
    assert isinstance(decision, Await) and decision.due == pytest.approx(1.0 + state.rule.deadline_s(0.14))
    assert state.handle(ResultArrived((0, 0), 1.2)) == Await(None)
    assert state.events == [] and state.failure is None


def test_a_late_window_whose_hops_answer_waits_then_times_the_prefixes() -> None:
    state = RouteState(ROUTE, prior=PRIOR, rtts={"peer-a": 0.02})
    opened(state)
    due = late_window(state)
    decision = state.handle(DeadlinePassed(due))
    assert isinstance(decision, Ping) and decision.hops == ROUTE
    assert decision.timeouts["peer-a"] == pytest.approx(1.0 + 5 * 0.02)  # surveyed: floor + 5 RTTs
    assert decision.timeouts["peer-b"] == pytest.approx(max(3.0, 1.0 + 2 * 0.11))  # unsurveyed: a floor
    waited = state.handle(Pinged((), due + 1))
    assert isinstance(waited, Await) and waited.due is not None and waited.due > due  # the allowance doubled
    assert isinstance(state.handle(DeadlinePassed(waited.due)), Ping)
    trial = state.handle(Pinged((), waited.due + 1))
    assert trial == TimePrefixes(4, state.rounds.deadline_s(4)) and state.phase is Phase.TIMING


def test_a_hop_that_swallows_windows_is_replaced_and_the_new_route_replayed() -> None:
    state = RouteState(ROUTE, prior=PRIOR, trial_after=1)
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    assert isinstance(state.handle(Pinged((), due)), TimePrefixes)
    assert state.handle(Timed((0.2, None, None), due + 1)) == Plan(frozenset({"peer-b"}))
    opening = state.handle(Planned((A, D, C), PRIOR, {"peer-d": 0.01}, due + 2))
    assert opening == Open((A, D, C), PRIOR, blacklist=("peer-b",), forget=())  # alive: blacklisted, not forgotten
    assert opened(state, (A, D, C), now=due + 3) == Resume(replay=True)
    [event] = state.events
    assert event.blamed == ["peer-b"] and event.new_route == ["peer-a", "peer-d", "peer-c"]
    assert event.seconds == pytest.approx(3.0) and "passes no window on" in event.verdict
    assert state.hops == (A, D, C) and state.timer.due() is None  # a new session: its own timer


def test_a_late_but_alive_hop_with_no_replacement_never_ends_the_generation() -> None:
    """The trial blames a hop that answers pings; no route avoids it: the head waits on its session."""
    state = RouteState(ROUTE, prior=PRIOR, trial_after=1)
    opened(state)
    now = late_window(state)
    for _ in range(20):  # however often it happens
        state.handle(DeadlinePassed(now))
        assert isinstance(state.handle(Pinged((), now)), TimePrefixes)
        assert state.handle(Timed((0.2, None, None), now)) == Plan(frozenset({"peer-b"}))
        decision = state.handle(NoRoute("no live peer serves blocks 2-3 (of 6)", {}, now, (2, 3)))
        assert isinstance(decision, Await) and decision.due is not None and decision.due > now
        now = decision.due
    assert state.failure is None and state.events == [] and state.phase is Phase.OPEN


def test_a_broken_session_with_a_live_culprit_and_no_replacement_reopens_on_the_same_peers() -> None:
    state = RouteState(ROUTE, prior=PRIOR, max_failovers=3)
    opened(state)
    for attempt in range(3):
        assert isinstance(state.handle(Broke(Fault("internal", "peer-c: boom", "peer-c"), 5.0)), Ping)
        assert state.handle(Pinged((), 5.1)) == Plan(frozenset({"peer-c"}))
        reopen = state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, 5.2, (4, 5)))
        assert reopen == Open(ROUTE, PRIOR)  # the same peers, nobody blacklisted
        assert opened(state, now=5.3) == Resume(replay=True)
        assert len(state.events) == attempt + 1 and "reopening on the same peers" in state.events[-1].verdict
    state.handle(Broke(Fault("internal", "peer-c: boom", "peer-c"), 6.0))
    state.handle(Pinged((), 6.1))
    gave_up = state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, 6.2, (4, 5)))
    assert isinstance(gave_up, Fail) and gave_up.failure.verdict == "gave_up" and len(gave_up.failure.tried) == 3
    assert isinstance(state.handle(DeadlinePassed(7.0)), Fail)  # failed for good


def test_a_dead_hop_with_no_replacement_is_pinged_once_more_then_its_hole_is_waited_for() -> None:
    state = RouteState(ROUTE, prior=PRIOR, rtts={"peer-c": 0.05}, rule=DeadlineRule(hole_wait_s=45.0))
    opened(state)
    due = late_window(state)
    first = state.handle(DeadlinePassed(due))
    assert isinstance(first, Ping)
    assert state.handle(Pinged(("peer-c",), due + 1)) == Plan(frozenset({"peer-c"}))
    confirm = state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, due + 2, (4, 5)))
    assert isinstance(confirm, Ping) and confirm.hops == (C,)
    assert confirm.timeouts["peer-c"] == pytest.approx(CONFIRM_FACTOR * first.timeouts["peer-c"])
    wait = state.handle(Pinged(("peer-c",), due + 3))  # still silent: wait for a peer to take over 4-5
    assert wait == Plan(frozenset({"peer-c"}), wait_s=45.0)
    failed = state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, due + 48, (4, 5)))
    assert isinstance(failed, Fail)
    failure = failed.failure
    assert failure.verdict == "no_route" and failure.blamed == ["peer-c"] and failure.missing_blocks == [4, 5]
    assert "did not answer a ping" in failure.message and "4-5" in failure.message and "within 45 s" in failure.message
    assert failure.as_dict()["missing_blocks"] == [4, 5]


def test_a_hole_that_heals_within_the_wait_resumes_the_generation() -> None:
    state = RouteState(ROUTE, prior=PRIOR, rtts={"peer-c": 0.05})
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    state.handle(Pinged(("peer-c",), due + 1))
    state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, due + 2, (4, 5)))
    assert isinstance(state.handle(Pinged(("peer-c",), due + 3)), Plan)
    healed = state.handle(Planned((A, B, D), PRIOR, {}, due + 30))  # a fresh peer took 4-5 after 27 s
    assert healed == Open((A, B, D), PRIOR, blacklist=("peer-c",), forget=("peer-c",))
    assert opened(state, now=due + 30.5) == Resume(replay=True)
    (event,) = state.events
    assert event.blamed == ["peer-c"] and event.seconds == pytest.approx(30.5)  # from the missed deadline


def test_without_a_hole_wait_a_dead_hop_with_no_replacement_ends_the_generation_at_once() -> None:
    state = RouteState(ROUTE, prior=PRIOR, rule=DeadlineRule(hole_wait_s=0.0))
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    state.handle(Pinged(("peer-c",), due + 1))
    state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, due + 2, (4, 5)))
    failed = state.handle(Pinged(("peer-c",), due + 3))
    assert isinstance(failed, Fail) and failed.failure.verdict == "no_route" and failed.failure.blamed == ["peer-c"]


@pytest.mark.parametrize("code", ["draining", "shutting_down"])
def test_a_peer_that_leaves_is_planned_around_at_once_without_pings_or_blame(code: str) -> None:
    state = RouteState(ROUTE, prior=PRIOR, rule=DeadlineRule(hole_wait_s=30.0))
    opened(state)
    plan = state.handle(Broke(Fault(code, "peer-b: this peer is leaving the swarm", "peer-b"), 2.0))
    assert plan == Plan(frozenset({"peer-b"}), wait_s=30.0)  # no Ping first: it told us it is going
    new = state.handle(Planned((A, D, C), PRIOR, {}, 2.2))
    assert new == Open((A, D, C), PRIOR)  # nobody blacklisted, nobody forgotten
    assert opened(state, now=2.3) == Resume(replay=True)
    (event,) = state.events
    assert event.blamed == [] and "leaving the swarm" in event.verdict and event.seconds == pytest.approx(0.3)


def test_a_leaving_peer_refusing_the_first_session_is_not_retried_and_its_hole_can_end_the_generation() -> None:
    state = RouteState(ROUTE, prior=PRIOR, rule=DeadlineRule(hole_wait_s=30.0))
    plan = state.handle(OpenFailed(Fault("draining", "peer-c: this peer is leaving the swarm", "peer-c"), 0.5))
    assert plan == Plan(frozenset({"peer-c"}), wait_s=30.0)  # not the one retry on the same peers
    failed = state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, 31.0, (4, 5)))
    assert isinstance(failed, Fail)
    assert failed.failure.verdict == "no_route" and failed.failure.blamed == [] and failed.failure.missing_blocks == [4, 5]
    assert "leaving the swarm" in failed.failure.message and "within 30 s" in failed.failure.message


def test_a_hop_that_answers_the_confirming_ping_was_alive_after_all() -> None:
    state = RouteState(ROUTE, prior=PRIOR)
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    state.handle(Pinged(("peer-c",), due + 1))
    assert isinstance(state.handle(NoRoute("no live peer serves blocks 4-5 (of 6)", {}, due + 2)), Ping)
    assert isinstance(state.handle(Pinged((), due + 3)), Await)  # the session may still deliver: wait on
    assert state.failure is None


def test_a_dead_hop_is_replaced_blacklisted_and_forgotten() -> None:
    state = RouteState(ROUTE, prior=PRIOR)
    opened(state)
    state.handle(Broke(Fault("route", "return leg ended", "peer-c"), 2.0))
    assert state.handle(Pinged(("peer-c",), 2.5)) == Plan(frozenset({"peer-c"}))
    decision = state.handle(Planned((A, B, D), PRIOR, {}, 2.7))
    assert decision == Open((A, B, D), PRIOR, blacklist=("peer-c",), forget=("peer-c",))
    opened(state, (A, B, D), now=3.0)
    assert state.events[0].blamed == ["peer-c"] and "did not answer a ping" in state.events[0].verdict


def test_a_first_route_that_fails_to_open_is_retried_once_then_failed_over() -> None:
    state = RouteState(ROUTE, prior=PRIOR)
    assert state.handle(OpenFailed(Fault("route", "cannot open", "peer-a"), 0.0)) == Open(
        ROUTE, PRIOR, pause_s=REOPEN_PAUSE_S)
    ping = state.handle(OpenFailed(Fault("route", "cannot open", "peer-a"), 0.6))
    assert isinstance(ping, Ping) and ping.hops == ROUTE
    assert state.handle(Pinged(("peer-a",), 1.0)) == Plan(frozenset({"peer-a"}))
    assert isinstance(state.handle(Planned((D, B, C), PRIOR, {}, 1.2)), Open)
    assert opened(state, (D, B, C), now=1.5) == Resume(replay=False)  # nothing was sent yet: nothing to replay
    assert state.events[0].blamed == ["peer-a"] and state.events[0].seconds == pytest.approx(0.9)


def test_a_window_lost_on_a_route_that_is_fast_again_reopens_it() -> None:
    state = RouteState(ROUTE, prior=PRIOR, trial_after=1)
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    state.handle(Pinged((), due))
    assert state.handle(Timed((0.1, 0.2, 0.3), due + 30)) == Plan(frozenset())  # everyone answered in 0.3 s
    assert isinstance(state.handle(Planned(ROUTE, PRIOR, {}, due + 31)), Open)
    assert opened(state, now=due + 32) == Resume(replay=True)
    assert "a window was lost" in state.events[0].error


def test_a_route_merely_slow_now_is_waited_on() -> None:
    state = RouteState(ROUTE, prior=PRIOR, trial_after=1)
    opened(state)
    due = late_window(state)
    state.handle(DeadlinePassed(due))
    state.handle(Pinged((), due))
    assert isinstance(state.handle(Timed((1.0, 2.0, 3.0), due + 0.1)), Await)  # the trial explains the wait


def slow_state() -> tuple[RouteState, float]:
    """A route whose rounds became slow: the result that makes it so asks for the prefixes' times."""
    state = RouteState(ROUTE, prior=RoundPrior(0.05, 0.0),
                       rule=DeadlineRule(slow_factor=4.0, slow_floor_s=0.25, slow_rounds=3, slow_cooldown=5))
    opened(state)
    now = 0.0
    for i in range(3):
        state.handle(WindowSent((0, i), 4, now))
        now += 1.0
        decision = state.handle(ResultArrived((0, i), now))
    assert decision == TimePrefixes(4, state.rounds.deadline_s(4)) and state.slow_checks == 1
    return state, now


def test_a_slow_hop_is_replaced_when_a_route_without_it_is_faster() -> None:
    state, now = slow_state()
    assert state.handle(Timed((0.1, 0.9, 1.0), now)) == Plan(frozenset({"peer-b"}))
    decision = state.handle(Planned((A, D, C), RoundPrior(0.2, 0.0), {}, now + 0.1))
    assert decision == Open((A, D, C), RoundPrior(0.2, 0.0), blacklist=("peer-b",), forget=())
    opened(state, (A, D, C), now + 0.2)
    assert "is slow" in state.events[0].verdict


def test_a_slow_route_is_kept_when_nothing_faster_exists_and_not_judged_again_soon() -> None:
    state, now = slow_state()
    state.handle(Timed((0.1, 0.9, 1.0), now))
    assert isinstance(state.handle(Planned((A, D, C), RoundPrior(2.0, 0.0), {}, now)), Await)  # est. 2 s >= 1 s
    assert state.events == [] and not state.rounds.slow
    state.handle(WindowSent((0, 9), 4, now))
    assert isinstance(state.handle(ResultArrived((0, 9), now + 1.0)), Await)  # within the cooldown
    state2, now2 = slow_state()
    state2.handle(Timed((0.1, 0.9, 1.0), now2))
    assert isinstance(state2.handle(NoRoute("no live peer serves blocks 2-3 (of 6)", {}, now2)), Await)
    state3, now3 = slow_state()
    assert isinstance(state3.handle(Timed((0.3, 0.6, 0.9), now3)), Await)  # no hop stands out: kept
