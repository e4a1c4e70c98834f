"""A block peer's load, read from its own steps: what one more row of a session costs the others, and the record's
figures (pure: a clock the test moves)."""

from __future__ import annotations

import pytest

from dsd.protocol.load import LoadMeter


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def steps(meter: LoadMeter, clock: Clock, plan: list[tuple[float, dict[str, int]]], gap: float = 0.0) -> None:
    """Steps back to back (`gap` idle seconds after each): (compute seconds, rows per session)."""
    for seconds, rows in plan:
        clock.t += seconds
        meter.observe(seconds, rows)
        clock.t += gap


def test_a_session_alone_costs_no_one_and_an_idle_peer_reports_nothing() -> None:
    clock = Clock()
    meter = LoadMeter(clock=clock)
    assert meter.load("a") == 0.0 and meter.report().busy == 0.0
    steps(meter, clock, [(0.05, {"a": 1}), (0.1, {"a": 8}), (0.06, {"a": 2})])
    assert meter.load("a") == 0.0  # no other session's rows
    assert meter.load("b") > 0  # but a newcomer would cost a


def test_the_per_row_cost_is_the_slope_of_step_seconds_over_rows() -> None:
    clock = Clock()
    meter = LoadMeter(clock=clock)
    # steps cost 40 ms + 10 ms a row, back to back (busy = 1): sessions a and b alternate in size
    plan = [(0.04 + 0.01 * (ra + rb), {"a": ra, "b": rb}) for ra, rb in [(1, 1), (1, 4), (2, 6), (1, 1), (4, 4)] * 4]
    steps(meter, clock, plan)
    recent = list(meter._steps)
    assert meter.row_seconds(recent) == pytest.approx(0.01)
    span = sum(s for s, _ in plan)
    b_rows = sum(r["b"] for _, r in plan)
    assert meter.load("a") == pytest.approx(0.01 * b_rows / span)  # busy 1 × b × b's rows per second
    report = meter.report(queued_rows=3)
    assert report.busy == pytest.approx(1.0) and report.queued_rows == 3
    assert report.batch_rows == pytest.approx(sum(sum(r.values()) for _, r in plan) / len(plan))


def test_load_falls_with_idle_time_and_forgets_steps_older_than_its_window() -> None:
    clock = Clock()
    meter = LoadMeter(window_s=5.0, clock=clock)
    plan = [(0.05, {"a": 1, "b": 1})] * 10
    steps(meter, clock, plan)
    busy_load = meter.load("a")
    clock2 = Clock()
    sparse = LoadMeter(window_s=5.0, clock=clock2)
    steps(sparse, clock2, plan, gap=0.45)  # the same steps, idle 90 % of the time
    assert 0 < sparse.load("a") < busy_load / 50  # busy and the others' row rate both ~10× lower
    assert sparse.report().busy == pytest.approx(0.1, rel=0.15)
    clock.t += 6.0
    assert meter.load("a") == 0.0 and meter.report().rows_per_s == 0.0


def test_a_session_that_ended_weighs_on_no_one() -> None:
    clock = Clock()
    meter = LoadMeter(clock=clock)
    steps(meter, clock, [(0.05, {"a": 1, "gone": 4})] * 10)
    assert meter.load("a") > 0
    assert meter.load("a", open_sessions={"a"}) == 0.0  # the other one closed: its rows were its own business
    assert meter.load("a", open_sessions={"a", "gone"}) == meter.load("a")


def test_a_meter_counting_tokens_weighs_the_others_tokens_not_their_drafted_rows() -> None:
    clock = Clock()
    rows = LoadMeter(clock=clock)
    tokens = LoadMeter(clock=clock, count="tokens")
    # a serving head's joint draft forwards: 10 ms + 1 ms a row, b drafts 8 rows a step but emits 1 token in 4 steps
    plan = [(0.01 + 0.001 * (ra + 8), {"a": ra, "b": 8}) for ra in (1, 3, 2, 6)] * 5
    for seconds, step_rows in plan:
        clock.t += seconds
        rows.observe(seconds, step_rows)
        tokens.observe(seconds, step_rows)
    span = sum(s for s, _ in plan)
    assert tokens.load("a") == 0.0  # told of no token: nothing of the others' is lost
    for i in range(5):
        tokens.emitted("b", 1, when=clock.t - i * 0.01)
        tokens.emitted("a", 3, when=clock.t - i * 0.01)
    assert rows.load("a") == pytest.approx(0.001 * 8 * len(plan) / span)
    assert tokens.load("a") == pytest.approx(0.001 * 5 / span)  # b's 5 tokens, not its 160 rows
    assert tokens.load("a", open_sessions={"a"}) == 0.0
    clock.t += 6.0
    tokens.observe(0.01, {"a": 1, "b": 1})
    assert tokens.load("a") == 0.0  # tokens older than the window are forgotten
    with pytest.raises(ValueError, match="rows or tokens"):
        LoadMeter(count="steps")
    with pytest.raises(ValueError, match=">= 0"):
        tokens.emitted("a", -1)
