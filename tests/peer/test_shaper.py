"""The emulated WAN: the schedule's arithmetic, and real libp2p streams delayed by the set latency
and capped at the set bandwidth."""

from __future__ import annotations

import random
import statistics
import time

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.host import P2PNode
from dsd.node.peer.shaper import LinkProfile, LinkSchedule, LinkShaper
from dsd.protocol import Ping, Pong

ECHO = "/dsd-test/echo/1"


def test_schedule_fifo_latency_and_serialisation() -> None:
    s = LinkSchedule(LinkProfile(latency_s=0.05, bandwidth_bps=8e6), random.Random(0))
    a = s.arrival(0.0, 1_000_000)  # 1 s on the wire at 8 Mbit/s
    assert a == pytest.approx(1.05)
    b = s.arrival(0.0, 1000)  # queued behind the first chunk
    assert b == pytest.approx(1.0 + 0.001 + 0.05)
    c = s.arrival(5.0, 0)
    assert c == pytest.approx(5.05)


def test_jitter_never_reorders() -> None:
    s = LinkSchedule(LinkProfile(latency_s=0.02, jitter_s=0.02), random.Random(1))
    arrivals = [s.arrival(i * 0.001, 10) for i in range(500)]
    assert arrivals == sorted(arrivals)
    assert min(arrivals[i] - i * 0.001 for i in range(500)) >= 0.0


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        LinkProfile(latency_s=0.01, jitter_s=0.02)
    with pytest.raises(ValueError):
        LinkProfile.from_options(-1.0)


async def _echo(stream, remote) -> None:
    while True:
        try:
            msg = await stream.receive()
        except EOFError:
            return
        await stream.send(Pong(msg.nonce))


async def _round_trips(profile: LinkProfile, payload: int, count: int) -> list[float]:
    shaper = LinkShaper(profile, seed=0)
    async with trio.open_nursery() as nursery:
        await nursery.start(shaper.run)
        async with P2PNode(create_new_key_pair()) as b:
            b.set_handler(ECHO, _echo)
            async with P2PNode(create_new_key_pair(), stream_wrapper=shaper.wrap) as a:
                stream = await a.open(b.peer_id, b.addrs, ECHO)
                times = []
                for i in range(count):
                    t = time.perf_counter()
                    with trio.fail_after(30):
                        await stream.send(Ping(i, b"x" * payload))
                        pong = await stream.receive()
                    times.append(time.perf_counter() - t)
                    assert pong.nonce == i
                await stream.close()
        nursery.cancel_scope.cancel()
    return times


@pytest.mark.network
def test_latency_within_a_few_ms_of_the_setting() -> None:
    async def main() -> tuple[float, float]:
        base = statistics.median(await _round_trips(LinkProfile(), 16, 7))
        shaped = statistics.median(await _round_trips(LinkProfile.from_options(50.0), 16, 7))
        return base, shaped

    base, shaped = trio.run(main)
    # Only A shapes; B answers at once: the round trip grows by one one-way latency.
    assert shaped - base == pytest.approx(0.050, abs=0.012), (base, shaped)


@pytest.mark.network
def test_bandwidth_cap_holds_on_a_1mb_transfer() -> None:
    async def main() -> float:
        return (await _round_trips(LinkProfile.from_options(0.0, mbit=8.0), 1_000_000, 1))[0]

    elapsed = trio.run(main)
    # 1 MB at 8 Mbit/s is 1.0 s of serialisation; loopback itself adds little.
    assert 1.0 <= elapsed < 1.5, elapsed
