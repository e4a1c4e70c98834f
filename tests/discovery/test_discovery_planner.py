"""Route planner and block selection on synthetic swarms (pure functions, no network)."""

from __future__ import annotations

import pytest

from dsd.discovery.planner import (
    NoRouteError,
    choose_blocks,
    format_blocks,
    plan_route,
    remote_blocks,
)
from dsd.discovery.records import PeerRecord


def rec(pid: str, start: int, end: int, *, tput: float = 1000.0, cache: int = 100_000) -> PeerRecord:
    return PeerRecord(pid, (f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), "m", start, end,
                      throughput=tput, cache_tokens_left=cache, expires=2e9, issued=1e9)


def spans(plan) -> list[tuple[str, int, int]]:
    return [(h.peer_id, h.start, h.end) for h in plan.hops]


def test_prefers_low_latency_peer() -> None:
    recs = [rec("far", 0, 4), rec("near", 0, 4), rec("b", 4, 8)]
    plan = plan_route(recs, {"far": 0.200, "near": 0.010, "b": 0.010}, 8)
    assert spans(plan) == [("near", 0, 4), ("b", 4, 8)]
    # ring: head->near 5 ms, near->b (10+10)/4 = 5 ms, b->head 5 ms, compute 4*8/(4*1000) twice, 2 overheads
    expected = 0.005 + 0.005 + 0.005 + 2 * (8 * 4 / 4000) + 2 * 0.0005  # cache is ample: no penalty
    assert plan.est_round_s == pytest.approx(expected, abs=1e-9)


def test_overlapping_spans_use_sub_ranges() -> None:
    # a serves 0-6, b serves 4-10: the route must hand over somewhere in 4..6 and cover everything once
    recs = [rec("a", 0, 6), rec("b", 4, 10)]
    plan = plan_route(recs, {"a": 0.01, "b": 0.01}, 10)
    assert [h.peer_id for h in plan.hops] == ["a", "b"]
    assert plan.hops[0].start == 0 and plan.hops[-1].end == 10
    assert plan.hops[0].end == plan.hops[1].start and 4 <= plan.hops[0].end <= 6


def test_faster_peer_takes_the_overlap() -> None:
    # the overlap 4-6 goes to whoever computes it faster (per-block time = 1 / (throughput * n_blocks))
    recs = [rec("slow", 0, 6, tput=10.0), rec("fast", 4, 10, tput=10_000.0)]
    plan = plan_route(recs, {"slow": 0.01, "fast": 0.01}, 10)
    assert spans(plan) == [("slow", 0, 4), ("fast", 4, 10)]


def test_skips_blacklisted_and_unreachable_peers() -> None:
    recs = [rec("best", 0, 8), rec("ok", 0, 8), rec("dead", 0, 8)]
    rtts = {"best": 0.001, "ok": 0.050, "dead": None}
    assert spans(plan_route(recs, rtts, 8)) == [("best", 0, 8)]
    plan = plan_route(recs, rtts, 8, blacklist={"best"})
    assert spans(plan) == [("ok", 0, 8)]
    assert plan.excluded == {"best": "blacklisted", "dead": "no RTT measured (unreachable)"}


def test_reports_gaps_by_block_number() -> None:
    recs = [rec("a", 0, 10), rec("b", 14, 20), rec("c", 10, 14)]
    with pytest.raises(NoRouteError) as err:
        plan_route(recs, {"a": 0.01, "b": 0.01, "c": 0.01}, 20, blacklist={"c"})
    assert err.value.missing_blocks == [10, 11, 12, 13]
    assert "blocks 10-13" in str(err.value)
    with pytest.raises(NoRouteError) as err:
        plan_route([rec("a", 0, 3)], {"a": 0.01}, 5)
    assert err.value.missing_blocks == [3, 4]
    assert format_blocks([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"


def test_fewer_hops_on_ties() -> None:
    # split x(0-4) + y(4-8), rtt 10 ms, 1000 tok/s each: links 5 + 2.5 + 2.5 + 5 = 15 ms,
    # compute 2 * 8/1000 = 16 ms. whole(0-8) at 500 tok/s and rtt 15 ms: links 15 ms, compute
    # 8/500 = 16 ms. Same cost (no hop overhead): the single hop wins.
    recs = [rec("x", 0, 4), rec("y", 4, 8), rec("whole", 0, 8, tput=500.0)]
    rtts = {"x": 0.010, "y": 0.010, "whole": 0.015}
    plan = plan_route(recs, rtts, 8, hop_overhead_s=0.0)
    assert spans(plan) == [("whole", 0, 8)]
    assert plan.est_round_s == pytest.approx(0.031, abs=1e-12)
    # and the split wins as soon as it is strictly cheaper
    rtts["whole"] = 0.0151
    assert [h.peer_id for h in plan_route(recs, rtts, 8, hop_overhead_s=0.0).hops] == ["x", "y"]


def test_low_cache_penalty_and_minimum() -> None:
    recs = [rec("full", 0, 8, cache=10), rec("roomy", 0, 8, cache=50_000)]
    rtts = {"full": 0.010, "roomy": 0.012}  # roomy is 2 ms slower but has cache to spare
    assert spans(plan_route(recs, rtts, 8)) == [("roomy", 0, 8)]
    # without the penalty the nearer peer wins
    assert spans(plan_route(recs, rtts, 8, low_cache_penalty_s=0.0)) == [("full", 0, 8)]
    # a hard minimum removes the peer altogether
    with pytest.raises(NoRouteError) as err:
        plan_route([recs[0]], {"full": 0.01}, 8, min_cache_tokens=100)
    assert err.value.missing_blocks == list(range(8)) and "full" in str(err.value)


def test_plan_is_optimal_against_brute_force() -> None:
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(30):
        n = 6
        recs = []
        for i in range(5):
            s = rng.randrange(0, n)
            e = rng.randrange(s + 1, n + 1)
            recs.append(rec(f"p{i}", s, e, tput=rng.choice([50.0, 500.0, 5000.0]), cache=rng.choice([0, 5000])))
        recs.append(rec("cover", 0, n, tput=20.0))
        rtts = {r.peer_id: rng.uniform(0.001, 0.1) for r in recs}
        plan = plan_route(recs, rtts, n)
        # brute force: every split of 0..n into segments, each served by any peer covering it
        best = float("inf")
        for cuts in itertools.product([0, 1], repeat=n - 1):
            bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
            segs = list(zip(bounds, bounds[1:], strict=False))
            choices = [[r for r in recs if r.start <= s and e <= r.end] for s, e in segs]
            for pick in itertools.product(*choices):
                total = 0.0
                for k, (r, (s, e)) in enumerate(zip(pick, segs, strict=True)):
                    one = rtts[r.peer_id] / 2
                    total += (one if k == 0 else one / 2) + (one if k == len(segs) - 1 else one / 2)
                    total += 8 * (e - s) / (r.num_blocks * r.throughput) + 0.0005
                    total += 0.05 * max(0.0, 1 - r.cache_tokens_left / 2048)
                best = min(best, total)
        assert plan.est_round_s == pytest.approx(best, abs=1e-8)
        assert sum(h.cost_s for h in plan.hops) == pytest.approx(plan.est_round_s, abs=1e-8)


def test_choose_blocks_picks_least_covered_span() -> None:
    recs = [rec("a", 0, 4, tput=100.0), rec("b", 4, 8, tput=100.0), rec("c", 0, 2, tput=100.0)]
    # blocks 8-11 are unserved: a new 4-block peer goes there
    assert choose_blocks(recs, 12, 4) == (8, 12)
    # with everything served once except 2-3 (only a), the weakest window starts there
    recs.append(rec("d", 8, 12, tput=100.0))
    assert choose_blocks(recs, 12, 2) == (2, 4)
    # empty swarm: first span; its own old record can be excluded
    assert choose_blocks([], 10, 5) == (0, 5)
    assert choose_blocks([rec("me", 0, 5)], 10, 5, exclude_peer="me") == (0, 5)
    assert choose_blocks([rec("me", 0, 5)], 10, 5) == (5, 10)
    with pytest.raises(ValueError, match="n_blocks"):
        choose_blocks([], 4, 5)


def test_a_head_serving_the_first_layers_has_only_the_rest_routed() -> None:
    # the head serves 0:3 itself: a (0-3) is of no use, the ring starts at block 3 and leaves the head for b
    recs = [rec("a", 0, 3), rec("b", 2, 6), rec("c", 6, 8)]
    rtts = {"a": 0.001, "b": 0.010, "c": 0.020}
    plan = plan_route(recs, rtts, 8, blocks=(3, 8))
    assert spans(plan) == [("b", 3, 6), ("c", 6, 8)]
    # head->b is a whole one-way link (5 ms), b->c the estimate (10+20)/4, c->head whole (10 ms)
    first, last = plan.hops
    assert first.link_in_s == pytest.approx(0.005) and last.link_out_s == pytest.approx(0.010)
    assert first.link_out_s + last.link_in_s == pytest.approx((0.010 + 0.020) / 4)
    assert first.compute_s == pytest.approx(8 * 3 / (4 * 1000))  # 3 of b's 4 blocks
    # blocks outside the range need no peer: nothing serves 0:2 here, yet 2:8 is routed
    assert spans(plan_route(recs[1:], rtts, 8, blocks=(2, 8))) == [("b", 2, 6), ("c", 6, 8)]
    with pytest.raises(NoRouteError) as err:
        plan_route([recs[0], recs[2]], rtts, 8, blocks=(3, 8))
    assert err.value.missing_blocks == [3, 4, 5]


def test_a_head_serving_the_last_layers_has_the_ring_end_before_them() -> None:
    recs = [rec("a", 0, 4), rec("b", 4, 8), rec("whole", 0, 8, tput=10.0)]
    plan = plan_route(recs, {"a": 0.01, "b": 0.01, "whole": 0.01}, 8, blocks=(0, 4))
    assert spans(plan) == [("a", 0, 4)]
    assert plan.hops[0].link_in_s == plan.hops[0].link_out_s == pytest.approx(0.005)


def test_remote_blocks_is_the_range_left_to_route() -> None:
    assert remote_blocks((0, 2), 5) == (2, 5)
    assert remote_blocks((3, 5), 5) == (0, 3)
    with pytest.raises(ValueError, match="first layers .* or the last ones"):
        remote_blocks((1, 3), 5)
    with pytest.raises(ValueError, match="every layer"):
        remote_blocks((0, 5), 5)
    with pytest.raises(ValueError, match="0 <= START < END <= 5"):
        remote_blocks((4, 6), 5)
    with pytest.raises(ValueError, match="inside 0..5"):
        plan_route([rec("a", 0, 5)], {"a": 0.01}, 5, blocks=(3, 3))


def test_plan_over_a_range_is_optimal_against_brute_force() -> None:
    import itertools
    import random

    rng = random.Random(11)
    n, first = 7, 2
    for _ in range(20):
        recs = []
        for i in range(5):
            s = rng.randrange(0, n)
            recs.append(rec(f"p{i}", s, rng.randrange(s + 1, n + 1), tput=rng.choice([50.0, 500.0, 5000.0])))
        recs.append(rec("cover", 0, n, tput=20.0))
        rtts = {r.peer_id: rng.uniform(0.001, 0.1) for r in recs}
        plan = plan_route(recs, rtts, n, blocks=(first, n))
        assert plan.hops[0].start == first and plan.hops[-1].end == n
        best = float("inf")
        for cuts in itertools.product([0, 1], repeat=n - first - 1):
            bounds = [first] + [first + i + 1 for i, c in enumerate(cuts) if c] + [n]
            segs = list(zip(bounds, bounds[1:], strict=False))
            for pick in itertools.product(*[[r for r in recs if r.start <= s and e <= r.end] for s, e in segs]):
                total = 0.0
                for k, (r, (s, e)) in enumerate(zip(pick, segs, strict=True)):
                    one = rtts[r.peer_id] / 2
                    total += (one if k == 0 else one / 2) + (one if k == len(segs) - 1 else one / 2)
                    total += 8 * (e - s) / (r.num_blocks * r.throughput) + 0.0005
                best = min(best, total)
        assert plan.est_round_s == pytest.approx(best, abs=1e-8)


def loaded(pid: str, start: int, end: int, busy: float, batch_rows: float, rows_per_s: float) -> PeerRecord:
    return PeerRecord(pid, (f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), "m", start, end, throughput=1000.0,
                      cache_tokens_left=100_000, expires=2e9, issued=1e9, busy=busy, batch_rows=batch_rows,
                      rows_per_s=rows_per_s)


def test_of_two_replicas_the_less_loaded_one_is_preferred_by_its_expected_wait() -> None:
    # same span, same speed, the busy one 2 ms nearer: its queue (90 % busy, 8-row steps at 100 rows/s) costs more
    recs = [loaded("busy", 0, 8, 0.9, 8.0, 100.0), loaded("idle", 0, 8, 0.05, 1.0, 10.0)]
    assert recs[0].wait_s == pytest.approx(0.9 * 0.9 * 8 / 100)
    plan = plan_route(recs, {"busy": 0.008, "idle": 0.010}, 8)
    assert spans(plan) == [("idle", 0, 8)]
    assert plan.breakdown()["overhead_and_penalty_s"] == pytest.approx(0.0005 + 0.05 * 0.05 * 1 / 10)
    quiet = [loaded("busy", 0, 8, 0.0, 0.0, 0.0), recs[1]]  # the same peer idle again: nearness wins
    assert spans(plan_route(quiet, {"busy": 0.008, "idle": 0.010}, 8)) == [("busy", 0, 8)]


def held(pid: str, start: int, end: int, weights: str, tput: float = 1000.0) -> PeerRecord:
    return PeerRecord(pid, (f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), "m", start, end, throughput=tput,
                      cache_tokens_left=100_000, expires=2e9, issued=1e9, weights=weights)


def test_a_route_holds_one_weight_format_unless_mixing_is_allowed() -> None:
    recs = [held("a8", 0, 4, "int8", tput=5000.0), held("b8", 4, 8, "int8", tput=5000.0),
            held("a32", 0, 4, "fp32"), held("b32", 4, 8, "fp32"), held("b4", 4, 8, "int4", tput=50_000.0)]
    rtts = dict.fromkeys([r.peer_id for r in recs], 0.01)
    assert spans(plan_route(recs, rtts, 8)) == [("a8", 0, 4), ("b8", 4, 8)]  # the cheapest one-format route
    plan = plan_route(recs, rtts, 8, weights="fp32")
    assert spans(plan) == [("a32", 0, 4), ("b32", 4, 8)]
    assert plan.excluded["a8"] == "holds int8 weights; this route uses fp32"
    assert spans(plan_route(recs, rtts, 8, weights="any")) == [("a8", 0, 4), ("b4", 4, 8)]  # the fastest, mixed
    with pytest.raises(NoRouteError, match=r"blocks 0-3 .*holds int8 weights; this route uses int4"):
        plan_route(recs, rtts, 8, weights="int4")
    halves = [held("x", 0, 4, "int8"), held("y", 4, 8, "int4")]
    with pytest.raises(NoRouteError, match=r"no single weight format \(int4, int8\) covers them.*--mix-weights"):
        plan_route(halves, {"x": 0.01, "y": 0.01}, 8)
    old = PeerRecord("old", ("/ip4/127.0.0.1/tcp/1/p2p/old",), "m", 0, 8, dtype="bfloat16", expires=2e9, issued=1e9)
    assert old.weight_format == "bf16" and "weights" not in old.to_dict()  # an older peer: its dtype's format
    floats = [old, held("f", 0, 8, "fp32", tput=0.1), held("q", 0, 8, "int8", tput=1e6)]
    assert spans(plan_route(floats, dict.fromkeys("old f q".split(), 0.01), 8, weights="float")) == [("old", 0, 8)]
