"""The audit's pure rules: distances per position (position 0 left out), the context each window follows, where two
routes can be compared; and the pieces of a repair: text streamed once across regenerations, counters joined."""

from __future__ import annotations

import numpy as np
import pytest
from support.calibration import calibrated, calibration

from dsd.node.head.report import GenerationResult, TimeBreakdown
from dsd.node.head.streaming import RepairGuard
from dsd.node.route.audit import AuditOptions
from dsd.node.route.audit_rules import (
    AUDIT_TOLERANCES,
    TOLERANCE_FLOOR,
    TOLERANCE_MARGIN,
    Comparison,
    HeldTokens,
    Precision,
    common_prefix,
    precision_pair,
    replicas_announced,
    row_gaps,
    segments,
)
from dsd.protocol import Hop


def hop(peer: str, start: int, end: int) -> Hop:
    return Hop(peer, ("/ip4/127.0.0.1/tcp/1",), start, end)


def test_row_gaps_are_symmetric_relative_distances_per_position() -> None:
    a = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 0.0]])
    b = np.array([[3.0, 4.0], [0.0, 1.0], [0.0, 0.0]])
    assert row_gaps(a, b) == pytest.approx([0.0, 2**0.5, 0.0])
    assert row_gaps(a, b) == pytest.approx(row_gaps(b, a))
    with pytest.raises(ValueError, match="shape"):
        row_gaps(a, b[:2])


def test_position_zero_is_left_out_and_the_evidence_names_absolute_positions() -> None:
    rng = np.random.default_rng(0)
    honest = rng.standard_normal((6, 8))
    told = honest.copy()
    told[0] *= -1  # the attention sink's row: not compared
    assert Comparison.of(told, honest, 0.1, start=0).agree
    told[4] += 10.0
    check = Comparison.of(told, honest, 0.1, start=0)
    assert not check.agree and check.evidence()["positions"] == [4] and check.evidence()["positions_compared"] == 5
    later = Comparison.of(told, honest, 0.1, start=20)  # a window at 20..25: its first row is compared
    assert later.evidence()["positions"] == [20, 24]


def test_held_tokens_follow_chains_trees_kept_paths_and_replays() -> None:
    held = HeldTokens()
    assert held.sent([1, 2, 3, 4], 0, 0) == []  # the prompt
    assert held.sent([4, 5, 6], 3, 3) == [1, 2, 3]  # [last committed, drafts]
    assert held.sent([7, 8], 6, 6) == [1, 2, 3, 4, 5, 6]  # sent ahead: keeps every row
    assert held.sent([5, 9, 10, 11], 4, 4, parents=[-1, 0, 0, 1]) == [1, 2, 3, 4]  # a tree after a rejection
    assert held.sent([12], 7, 4, keep=[0, 2, 3]) == [1, 2, 3, 4, 5, 10, 11]  # its accepted path kept
    assert held.sent([1, 2, 3], 0, 0) == []  # a replay on a new route starts over
    with pytest.raises(ValueError, match="hold 3 tokens"):
        held.sent([9], 5, 5)
    with pytest.raises(ValueError, match="tree"):
        held.sent([9], 3, 3, keep=[0])


def test_segments_cut_both_routes_at_every_boundary() -> None:
    route = [hop("a", 0, 1), hop("l", 1, 3), hop("b", 3, 5)]
    replica = [hop("f", 0, 5)]
    cut = segments(route, replica)
    assert [(s.start, s.end, s.route.peer_id, s.replica.peer_id) for s in cut] == [
        (0, 1, "a", "f"), (1, 3, "l", "f"), (3, 5, "b", "f")]
    other = segments([hop("x", 0, 3), hop("y", 3, 5)], [hop("p", 0, 2), hop("q", 2, 5)])
    assert [(s.start, s.end, s.route.peer_id, s.replica.peer_id) for s in other] == [
        (0, 2, "x", "p"), (2, 3, "x", "q"), (3, 5, "y", "q")]
    with pytest.raises(ValueError, match="cover"):
        segments([hop("x", 0, 3)], [hop("p", 0, 5)])
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([1], [1, 2]) == 1


def test_repair_guard_streams_each_token_once_and_notes_text_it_cannot_take_back() -> None:
    shown: list[int] = []
    guard = RepairGuard(shown.extend)
    guard.push([1, 2, 3])
    guard.push([4, 5])
    guard.rewind(2)  # redone from token 2: 3, 4 again, then new ones
    guard.push([3, 4])
    guard.push([5, 6])
    assert shown == [1, 2, 3, 4, 5, 6] and guard.wrong_from is None
    guard.rewind(3)
    guard.push([9, 7])  # token 3 was 4 when shown
    assert shown == [1, 2, 3, 4, 5, 6] and guard.wrong_from == 3
    guard.push([8])
    assert shown == [1, 2, 3, 4, 5, 6]


def test_a_repaired_result_joins_the_kept_tokens_and_adds_every_attempts_work() -> None:
    spoiled = GenerationResult("dsd", tokens=[1, 2, 3, 9], elapsed_s=2.0, rounds=3, drafted=6, accepted=2,
                               accepted_per_round=[1, 0, 1], times=TimeBreakdown(waiting=1.0))
    last = GenerationResult("dsd", tokens=[4, 5], elapsed_s=1.0, rounds=2, drafted=4, accepted=1,
                            accepted_per_round=[1, 0], times=TimeBreakdown(waiting=0.5))
    joined = last.continuing([1, 2, 3], [spoiled])
    assert joined.tokens == [1, 2, 3, 4, 5]
    assert (joined.elapsed_s, joined.rounds, joined.drafted, joined.accepted) == (3.0, 5, 10, 3)
    assert joined.accepted_per_round == [1, 0, 1, 1, 0] and joined.times.waiting == 1.5


def test_a_replica_route_is_waited_for_only_when_records_announce_one() -> None:
    """The auditor waits for a disjoint route only when peers outside the audited route cover every layer; a swarm
    with one peer per span is told at once (it used to wait 5 s on every audited request)."""
    from dsd.discovery.records import PeerRecord

    def rec(peer: str, start: int, end: int, role: str = "block") -> PeerRecord:
        return PeerRecord(peer, (), "m", start, end, role=role)

    one_per_span = [rec("a", 0, 3), rec("b", 3, 5)]
    assert not replicas_announced(one_per_span, {"a", "b"}, (0, 5), 5)
    replicated = [*one_per_span, rec("a2", 0, 3), rec("b2", 3, 5)]
    assert replicas_announced(replicated, {"a", "b"}, (0, 5), 5)
    assert not replicas_announced(replicated, {"a", "b", "b2"}, (0, 5), 5)  # the banned or blacklisted do not count
    assert replicas_announced(replicated, {"a", "b", "b2"}, (0, 3), 5)  # the head serves layers 3:5 itself
    assert not replicas_announced([*one_per_span, PeerRecord("w", (), "m", 0, 5, role="federated", vocab_size=300, topk_cap=8)], {"a", "b"}, (0, 5), 5)



def test_the_tolerance_table_is_the_committed_calibration_of_the_real_target() -> None:
    """Every pair the head knows is in the calibration, at its tolerance rounded up to 3 decimals (never tighter)."""
    data = calibration()
    assert data["margin"] == TOLERANCE_MARGIN and data["floor"] == TOLERANCE_FLOOR
    real = calibrated("real")
    assert set(AUDIT_TOLERANCES) == set(real) == set(data["pairs"])
    for pair, tolerance in AUDIT_TOLERANCES.items():
        assert real[pair] <= tolerance < real[pair] + 0.001, pair
        worst = data["models"]["real"]["pairs"][pair]["max"]
        assert tolerance >= max(TOLERANCE_FLOOR, TOLERANCE_MARGIN * worst) - 1e-9
    # what the tolerances are for: a 0.04-noise liar stands out among float32 replicas, never among bfloat16 ones
    assert AUDIT_TOLERANCES["fp32/fp32"] < 0.04 < AUDIT_TOLERANCES["bf16/fp32"]


def test_a_routes_precision_is_its_least_precise_hop_and_int8_on_the_wire_marks_the_pair_lossy() -> None:
    fp32 = Precision.of_route([("float32", "raw"), ("float32", "")])
    assert fp32 == Precision("fp32") and precision_pair(fp32, fp32) == "fp32/fp32"
    mixed = Precision.of_route([("float32", "raw"), ("bfloat16", "bf16")])
    assert precision_pair(mixed, fp32) == precision_pair(fp32, mixed) == "bf16/fp32"
    assert Precision.of_route([("float32", "fp16")]) == Precision("fp16")  # rows rounded to fp16 on the wire
    lossy = Precision.of_route([("float16", "int8"), ("float32", "raw")])
    assert lossy == Precision("fp16", lossy=True) and precision_pair(fp32, lossy) == "fp16/fp32+int8"
    # a peer whose record is missing, or a dtype the table lacks: judged as the least precise (no false ban)
    assert Precision.of_route([("", ""), ("float32", "raw")]) == Precision("bf16")
    assert AuditOptions().tolerance_for("fp16/fp32") == AUDIT_TOLERANCES["fp16/fp32"]
    assert AuditOptions().tolerance_for("no/such") == max(AUDIT_TOLERANCES.values())
    assert AuditOptions(tolerance=0.2).tolerance_for("fp32/fp32") == 0.2  # `--audit-tolerance` overrides all
