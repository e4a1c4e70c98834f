"""The service's admission limiter: places, the per-client cap, the fair share when full, fair dispatch."""

from __future__ import annotations

import pytest
import trio

from dsd.node.service.admission import RUNNING, WAITING, Admission, Busy
from dsd.node.service.wire_errors import WireError


def test_places_run_in_arrival_order_then_wait_then_refuse() -> None:
    adm = Admission(2, 2)
    slots = [adm.reserve("a") for _ in range(4)]
    assert [s.state for s in slots] == [RUNNING, RUNNING, WAITING, WAITING]
    assert (adm.running, adm.waiting, adm.admitted) == (2, 2, 4)
    with pytest.raises(Busy, match="--max-concurrent 2, --queue 2"):
        adm.reserve("a")  # a lone client may fill the server, and no more
    slots[0].release()
    slots[0].release()  # once
    assert [s.state for s in slots[1:]] == [RUNNING, RUNNING, WAITING]
    assert (adm.running, adm.waiting) == (2, 1)


def test_a_client_holds_at_most_max_per_client() -> None:
    adm = Admission(2, 4, max_per_client=3)
    for _ in range(3):
        adm.reserve("a")
    with pytest.raises(Busy, match="--max-per-client 3"):
        adm.reserve("a")
    adm.reserve("b")  # places are left for others
    assert adm.held("a") == 3 and adm.held("b") == 1


def test_a_full_server_gives_a_newcomer_the_newest_waiting_place_of_the_client_over_its_share() -> None:
    adm = Admission(2, 4)
    a = [adm.reserve("a") for _ in range(6)]
    b1 = adm.reserve("b")  # share 6/2 = 3: "a" holds 6, gives its newest waiting place
    assert a[-1].state == "evicted" and b1.state == WAITING and adm.held("a") == 5 and adm.evicted == 1
    b2, b3 = adm.reserve("b"), adm.reserve("b")
    assert adm.held("a") == 3 and adm.held("b") == 3
    with pytest.raises(Busy):
        adm.reserve("b")  # "b" at its share now
    with pytest.raises(Busy):
        adm.reserve("a")  # and "a" too: nobody is over the share
    c = adm.reserve("c")  # share 2: "a" and "b" hold 3 each; on a tie the larger name ("b") gives
    assert c.state == WAITING and (adm.held("a"), adm.held("b")) == (3, 2)
    # a freed slot goes to the waiting request of the client running fewest ("a" runs two)
    a[0].release()
    assert b1.state == RUNNING and a[2].state in (WAITING, "evicted")
    assert (adm.running, adm.admitted) == (2, 5) and b3.state == "evicted" and b2.state == WAITING


def test_no_eviction_without_a_queue_or_when_everyone_runs() -> None:
    adm = Admission(2, 0)
    adm.reserve("a"), adm.reserve("a")
    with pytest.raises(Busy):
        adm.reserve("b")  # both of "a"'s are running: running generations are never interrupted


def test_an_evicted_request_gets_429_when_it_goes_to_wait_and_a_cancelled_one_gives_its_place_back() -> None:
    async def main() -> None:
        adm = Admission(1, 2)
        first, queued, newest = adm.reserve("a"), adm.reserve("a"), adm.reserve("a")
        other = adm.reserve("b")  # "a" holds 3 of 3 places, over its share of 1.5: its newest gives way
        with pytest.raises(WireError) as info:
            async with newest:
                pass
        assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
        async with first:
            pass  # released on exit: the oldest of the clients running fewest goes next
        assert (queued.state, other.state) == (RUNNING, WAITING)
        with trio.move_on_after(0.05):
            async with other:
                raise AssertionError("it cannot run while 'queued' does")
        assert adm.held("b") == 0 and adm.admitted == 1 and other.queued_s == 0.0

    trio.run(main)
