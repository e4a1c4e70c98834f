"""When a block peer moves its span (`discovery/rebalance.py`): pure decisions over swarm views."""

from __future__ import annotations

import pytest

from dsd.discovery.rebalance import MOVE_GAIN, Confirm, Coverage, move_target, queue_position
from dsd.discovery.records import PeerRecord

LAYERS = 8


def rec(pid: str, start: int, end: int, tput: float = 10.0) -> PeerRecord:
    return PeerRecord(pid, (f"/ip4/127.0.0.1/tcp/1/p2p/{pid}",), "m", start, end, throughput=tput, expires=2e9,
                      issued=1e9)


def test_a_peer_on_a_doubly_served_span_moves_to_fill_a_hole() -> None:
    swarm = [rec("a", 0, 4), rec("b", 0, 4), rec("c", 4, 6)]  # blocks 6-7 served by nobody
    move = move_target(swarm, "b", (0, 4), 10.0, LAYERS)
    assert move is not None and move.to == (4, 8)
    assert move.before == Coverage(holes=2, bottleneck=0.0) and move.after.holes == 0


def test_a_peer_alone_on_its_blocks_never_moves_even_to_fill_a_hole() -> None:
    swarm = [rec("a", 0, 4), rec("c", 4, 6)]  # a alone serves 0-3; 6-7 are a hole
    assert move_target(swarm, "a", (0, 4), 10.0, LAYERS) is None


def test_a_balanced_swarm_stays_still() -> None:
    swarm = [rec("a", 0, 4), rec("b", 4, 8), rec("c", 0, 4), rec("d", 4, 8)]
    for peer in swarm:
        assert move_target(swarm, peer.peer_id, (peer.start, peer.end), peer.throughput, LAYERS) is None


def test_a_move_that_fills_no_hole_needs_the_bottleneck_to_rise_by_the_gain() -> None:
    # 0-3 served by three peers, 4-7 by one: moving one of the three lifts the bottleneck from 10 to 20 (2x)
    swarm = [rec("a", 0, 4), rec("b", 0, 4), rec("c", 0, 4), rec("d", 4, 8)]
    move = move_target(swarm, "c", (0, 4), 10.0, LAYERS)
    assert move is not None and move.to == (4, 8) and move.after.bottleneck == pytest.approx(2 * move.before.bottleneck)
    # a slightly weaker half: 4-7 at 9 tokens/s against 10 at 0-3, already nearly balanced (a move would invert it)
    near = [rec("a", 0, 4, 10.0), rec("b", 4, 8, 9.0), rec("c", 4, 8, 0.5)]
    assert move_target(near, "c", (4, 8), 0.5, LAYERS) is None
    # the 2x move, just under and at the gain asked
    assert move_target(swarm, "c", (0, 4), 10.0, LAYERS, gain=2.01) is None
    assert move_target(swarm, "c", (0, 4), 10.0, LAYERS, gain=2.0) is not None
    # a move that changes nothing for the bottleneck (0-3 at 20 and 4-7 at 10 become 10 and 20) is not made
    even = [rec("a", 0, 4), rec("b", 0, 4), rec("d", 4, 8)]
    assert move_target(even, "b", (0, 4), 10.0, LAYERS) is None and MOVE_GAIN > 1


def test_its_own_record_is_ignored_and_bad_input_is_refused() -> None:
    swarm = [rec("a", 0, 4), rec("b", 0, 4), rec("c", 4, 6), rec("b", 0, 4)]  # b's record listed twice
    assert move_target(swarm, "b", (0, 4), 10.0, LAYERS).to == (4, 8)
    with pytest.raises(ValueError, match="not inside"):
        move_target(swarm, "b", (4, 9), 10.0, LAYERS)
    with pytest.raises(ValueError, match="throughput"):
        move_target(swarm, "b", (0, 4), 0.0, LAYERS)


def test_a_move_is_made_only_when_two_checks_in_a_row_choose_it() -> None:
    hole = [rec("a", 0, 4), rec("b", 0, 4), rec("c", 4, 6)]
    filled = [*hole, rec("e", 6, 8)]  # another peer filled the hole between the two checks
    confirm = Confirm()
    assert not confirm.seen(move_target(hole, "b", (0, 4), 10.0, LAYERS))
    assert not confirm.seen(move_target(filled, "b", (0, 4), 10.0, LAYERS))  # nothing to do now: no move
    assert not confirm.seen(move_target(hole, "b", (0, 4), 10.0, LAYERS))  # seen once again: not yet
    assert confirm.seen(move_target(hole, "b", (0, 4), 10.0, LAYERS))  # twice in a row: move
    assert not confirm.seen(move_target(hole, "b", (0, 4), 10.0, LAYERS))  # a confirmed move starts over


def test_peers_that_would_make_the_same_move_queue_in_peer_id_order() -> None:
    hole = [rec("a", 0, 4), rec("b", 0, 4), rec("c", 4, 6)]  # a and b could both fill 6-7 (each moving to 4:8)
    first, second = (move_target(hole, p, (0, 4), 10.0, LAYERS) for p in ("a", "b"))
    assert first.to == second.to == (4, 8)
    assert queue_position(hole, "a", first, LAYERS) == 0 and queue_position(hole, "b", second, LAYERS) == 1
    confirm = Confirm()  # b waits one more look than a would
    assert [confirm.seen(second, needed=3) for _ in range(3)] == [False, False, True]
    moved = [rec("a", 4, 8), rec("b", 0, 4), rec("c", 4, 6)]  # a moved first: b has nothing left to do
    assert move_target(moved, "b", (0, 4), 10.0, LAYERS) is None
