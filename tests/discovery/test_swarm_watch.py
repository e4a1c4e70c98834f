"""A head process's one view of the swarm and its blacklist (pure parts: no network)."""

from __future__ import annotations

import pytest

from dsd.discovery.planner import NoRouteError, plan_route
from dsd.discovery.records import PeerRecord
from dsd.discovery.survey import SwarmView
from dsd.discovery.swarm import Blacklist, SwarmWatch, swarm_changes


def rec(pid: str, start: int, end: int) -> PeerRecord:
    return PeerRecord(pid, (f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), "m", start, end, throughput=1000.0,
                      cache_tokens_left=100_000, expires=2e9, issued=1e9)


def test_the_backoff_doubles_with_every_failure_up_to_the_cap() -> None:
    bl = Blacklist(base_s=30.0, max_s=100.0)
    assert [bl.add("p", now=0.0) for _ in range(4)] == [30.0, 60.0, 100.0, 100.0]
    assert bl.active(now=99.0) == {"p"} and bl.active(now=100.5) == set()


def test_a_new_generation_does_not_start_on_a_route_through_a_blacklisted_peer() -> None:
    """The service's requests start on the last survey's route, unless a request blamed one of its peers since:
    then the next generation plans its own, avoiding it (one blacklist per head process)."""
    records = [rec("a", 0, 4), rec("b", 4, 8)]
    watch = SwarmWatch(None, "m", 8)  # type: ignore[arg-type]  # no survey is run here
    assert watch.route_to_start() is None  # nothing surveyed yet
    watch.view = SwarmView(records, {"a": 0.01, "b": 0.01}, plan_route(records, {"a": 0.01, "b": 0.01}, 8))
    assert [h.peer_id for h in watch.route_to_start() or []] == ["a", "b"]
    watch.blacklist.add("b")
    assert watch.route_to_start() is None
    assert [h.peer_id for h in watch.hops or []] == ["a", "b"]  # the page still shows what the survey saw


def test_a_no_route_message_says_why_each_peer_was_left_out() -> None:
    """On the audited route, blacklisted (until when, why), banned (until when, the verdict), unreachable: each named
    in the planner's error as the head's `exclusions` give them (not all as "blacklisted")."""
    watch = SwarmWatch(None, "m", 8)  # type: ignore[arg-type]  # no survey is run here
    watch.blacklist.add("frozen", why="silent on an audit's replica route")
    watch.bans.add("liar", "liar returned wrong hidden states for layers 0:8", {})
    why = watch.exclusions({"routed": "on the audited route"})
    assert why["routed"] == "on the audited route"
    assert why["frozen"].startswith("blacklisted until ") and " UTC, 30 s more: silent on an audit's" in why["frozen"]
    assert why["liar"].startswith("banned until ") and why["liar"].endswith("wrong hidden states for layers 0:8")
    records = [rec(p, 0, 8) for p in ("routed", "frozen", "liar", "gone")]
    with pytest.raises(NoRouteError) as info:
        plan_route(records, {"routed": 0.01, "frozen": 0.01, "liar": 0.01, "gone": None}, 8, blacklist=why)
    message = str(info.value)
    for peer in ("routed", "frozen", "liar"):
        assert f"{peer[-8:]} ({why[peer]})" in message, message
    assert "gone (no RTT measured (unreachable))" in message


def test_swarm_changes_name_the_peers_that_joined_left_or_moved() -> None:
    before = SwarmView([rec("a", 0, 4), rec("b", 4, 8), rec("c", 0, 4)])
    after = SwarmView([rec("a", 0, 4), rec("c", 4, 8), rec("d", 0, 4)])  # b left, c moved, d joined
    got = {(c.peer_id, c.what, c.span, c.before) for c in swarm_changes(before, after, 1e9 + 10)}
    assert got == {("b", "left", (4, 8), None), ("c", "moved", (4, 8), (0, 4)), ("d", "joined", (0, 4), None)}
    assert swarm_changes(after, after, 1e9 + 10) == []
    expired = SwarmView([rec("a", 0, 4), rec("c", 4, 8), rec("d", 0, 4)])
    assert {c.peer_id for c in swarm_changes(expired, after, 3e9)} == set()  # both past expiry: no live record seen
