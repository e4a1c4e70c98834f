"""QUIC beside TCP: a node listening on both announces both, a dialler uses TCP first and QUIC where TCP does not get
through (a dead or filtered port), and streams over QUIC carry frames as over TCP. Real libp2p hosts on 127.0.0.1."""

from __future__ import annotations

import socket

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.addrs import dial_order, is_quic, quic_twin, split_addr, with_quic
from dsd.discovery.host import P2PNode
from dsd.discovery.ping import install_ping_handler, measure_rtt
from dsd.protocol import Ping, Pong

pytestmark = [pytest.mark.network, pytest.mark.timeout(60)]

BOTH = ["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic-v1"]


def test_quic_addresses_are_told_from_tcp_ones_and_dialled_after_them() -> None:
    assert quic_twin("/ip4/10.0.0.2/tcp/4001") == "/ip4/10.0.0.2/udp/4001/quic-v1"
    assert quic_twin("/ip4/10.0.0.2/udp/4001/quic-v1") is None
    assert with_quic(["/ip4/127.0.0.1/tcp/0"]) == BOTH
    assert with_quic(BOTH) == BOTH  # already there: not twice
    assert is_quic("/ip4/1.2.3.4/udp/5/quic-v1") and not is_quic("/ip4/1.2.3.4/tcp/5")
    tcp, quic = (split_addr(a)[0] for a in ("/ip4/1.2.3.4/tcp/5", "/ip4/1.2.3.4/udp/5/quic-v1"))
    assert dial_order([quic, tcp]) == ([tcp], [quic])
    assert dial_order([quic]) == ([quic], [])


def _dead_tcp_port() -> int:
    """A loopback TCP port nobody listens on (connections to it are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_node_listening_on_both_is_dialled_over_tcp_and_over_quic_where_tcp_is_refused() -> None:
    async def main() -> None:
        with trio.fail_after(40):
            async with P2PNode(create_new_key_pair(), BOTH) as a, P2PNode(create_new_key_pair(), BOTH) as b, \
                    P2PNode(create_new_key_pair(), BOTH) as c:
                install_ping_handler(a)
                assert sorted(is_quic(x) for x in a.addrs) == [False, True]  # announced: one of each
                assert await measure_rtt(b, a.peer_id, a.addrs) > 0
                assert b.transport_to(a.peer_id) == "tcp"
                quic = next(x for x in a.addrs if is_quic(x))
                refused = f"/ip4/127.0.0.1/tcp/{_dead_tcp_port()}/p2p/{a.peer_id}"
                stream = await c.open(a.peer_id, [refused, quic], "/dsd/ping/1")
                assert c.transport_to(a.peer_id) == "quic"
                big = b"\x07" * 200_000  # many QUIC packets
                await stream.send(Ping(7, big))
                assert await stream.receive() == Pong(7, big)
                await stream.close()
                # A node without QUIC dials the TCP address only; with nothing else, it says why it cannot.
                async with P2PNode(create_new_key_pair()) as d:
                    assert await measure_rtt(d, a.peer_id, a.addrs) > 0
                    assert d.transport_to(a.peer_id) == "tcp"
                    with pytest.raises(ConnectionError, match="only over QUIC"):
                        await d.open(a.peer_id, [quic], "/dsd/ping/1")
                async with P2PNode(create_new_key_pair()) as e:
                    with pytest.raises(ConnectionError):
                        await e.open(a.peer_id, [refused, quic], "/dsd/ping/1")

    trio.run(main)
