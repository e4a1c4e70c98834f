"""What a peer announces: never an unspecified address; circuit addresses built and read back; the reachability
a record carries is checked like any other field."""

from __future__ import annotations

import multiaddr
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.addrs import announceable, circuit_addr, is_circuit, relay_of, source_ip_toward
from dsd.discovery.identity import peer_id_of
from dsd.discovery.records import PeerRecord, RecordError, sign_record, verify_record

ME = peer_id_of(create_new_key_pair())
RELAY = peer_id_of(create_new_key_pair())


def test_an_unspecified_listen_address_is_announced_as_the_interface_toward_the_swarm() -> None:
    listen = [multiaddr.Multiaddr(f"/ip4/0.0.0.0/tcp/4001/p2p/{ME}"), multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/5")]
    got = announceable(listen, ME, [f"/ip4/127.0.0.1/tcp/9/p2p/{RELAY}"])
    assert got == [f"/ip4/127.0.0.1/tcp/4001/p2p/{ME}", f"/ip4/127.0.0.1/tcp/5/p2p/{ME}"]
    assert not any("0.0.0.0" in a for a in announceable(listen, ME, []))  # no bootstrap: loopback, never 0.0.0.0


def test_source_ip_toward_skips_what_it_cannot_route_to() -> None:
    assert source_ip_toward(["not an address", f"/ip4/127.0.0.1/tcp/9/p2p/{RELAY}"]) == "127.0.0.1"
    assert source_ip_toward([]) is None


def test_circuit_addresses_name_their_relay_and_their_peer() -> None:
    addr = circuit_addr(f"/ip4/203.0.113.10/tcp/4001/p2p/{RELAY}", RELAY, ME)
    assert addr == f"/ip4/203.0.113.10/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{ME}"
    assert circuit_addr("/ip4/203.0.113.10/tcp/4001", RELAY, ME) == addr
    assert is_circuit(addr) and relay_of(addr) == RELAY and not is_circuit(f"/ip4/1.2.3.4/tcp/1/p2p/{ME}")
    multiaddr.Multiaddr(addr)  # a valid multiaddr


def test_reachability_travels_in_the_signed_record_and_is_checked() -> None:
    kp = create_new_key_pair()
    rec = PeerRecord(peer_id_of(kp), (), "m", 0, 2, reachability="private")
    assert verify_record(sign_record(rec, kp)).reachability == "private"
    assert "reachability" not in PeerRecord(peer_id_of(kp), (), "m", 0, 2).to_dict()  # unknown: old wire form
    with pytest.raises(RecordError, match="reachability"):
        PeerRecord(peer_id_of(kp), (), "m", 0, 2, reachability="behind a NAT")


def test_load_travels_in_the_signed_record_is_left_off_when_idle_and_is_checked() -> None:
    kp = create_new_key_pair()
    rec = PeerRecord(peer_id_of(kp), (), "m", 0, 2, busy=0.75, batch_rows=6.5, rows_per_s=40.0, queued_rows=12)
    back = verify_record(sign_record(rec, kp))
    assert (back.busy, back.batch_rows, back.rows_per_s, back.queued_rows) == (0.75, 6.5, 40.0, 12)
    idle = PeerRecord(peer_id_of(kp), (), "m", 0, 2).to_dict()
    assert not {"busy", "batch_rows", "rows_per_s", "queued_rows"} & set(idle)  # an idle peer's old wire form
    for bad in ({"busy": 1.5}, {"busy": float("nan")}, {"rows_per_s": -1.0}, {"queued_rows": -3}):
        with pytest.raises(RecordError, match=next(iter(bad))):
            PeerRecord(peer_id_of(kp), (), "m", 0, 2, **bad)
