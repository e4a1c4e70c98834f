"""Circuit relay v2 in-process on loopback: a peer that announces itself private is reached through a relay, and
each circuit lives and ends on its own (py-libp2p's relay closed a live circuit when another one to the same peer
ended)."""

from __future__ import annotations

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.host import P2PNode
from dsd.discovery.nat import NatOptions
from dsd.discovery.ping import install_ping_handler, measure_rtt

pytestmark = pytest.mark.network


def test_a_circuit_outlives_another_circuit_to_the_same_peer() -> None:
    async def main() -> None:
        with trio.fail_after(60):
            async with P2PNode(create_new_key_pair(), nat=NatOptions("public", relay=True)) as relay:
                boot = [relay.addrs[0]]
                async with P2PNode(create_new_key_pair(), bootstrap=boot, nat=NatOptions("private", punch=False)) as private:
                    install_ping_handler(private)
                    assert await private.nat.reserve(relay.peer_id, relay.addrs[0])
                    addrs = private.addrs
                    assert len(addrs) == 1 and "/p2p-circuit/" in addrs[0]
                    async with P2PNode(create_new_key_pair(), bootstrap=boot, nat=NatOptions("private", punch=False)) as keeps:
                        async with P2PNode(create_new_key_pair(), bootstrap=boot, nat=NatOptions("private", punch=False)) as leaves:
                            for node in (leaves, keeps):  # `keeps` connects last: its circuit is the one filed
                                # (no punching: on loopback a punch would replace the circuits at once)
                                await measure_rtt(node, private.peer_id, addrs)
                                assert node.link_kind(private.peer_id) == "relayed"
                        await trio.sleep(1.0)  # `leaves` has gone: its circuit ended
                        assert keeps.link_kind(private.peer_id) == "relayed"
                        await measure_rtt(keeps, private.peer_id, addrs, samples=3)  # the circuit still carries

    trio.run(main)
