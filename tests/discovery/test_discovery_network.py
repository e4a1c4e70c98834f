"""Real libp2p hosts on 127.0.0.1: DHT records, expiry, signatures, ping, framing, allow_peers."""

from __future__ import annotations

import dataclasses
import logging
import socket
import struct
import time

import msgpack
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from support.frames import raw_frame

from dsd.discovery.announce import Announcer, fetch_records
from dsd.discovery.framing import FramedStream, LinkError
from dsd.discovery.host import P2PNode
from dsd.discovery.ping import install_ping_handler, measure_rtt
from dsd.discovery.record_store import RecordStore, ask_records
from dsd.discovery.records import PeerRecord, RecordError, record_key, sign_record, verify_record
from dsd.protocol import (
    RECORDS_LIMITS,
    Error,
    Message,
    Ping,
    Pong,
    RecordsFound,
    RecordsGet,
    RecordsPut,
    RecordsStored,
    encode,
)
from dsd.protocol.ids import RECORDS_PROTOCOL
from dsd.protocol.records import RECORDS_FRAME_BYTES

pytestmark = [pytest.mark.network, pytest.mark.timeout(60)]
logging.getLogger("dsd").setLevel(logging.INFO)

MODEL = "tiny-test-model"


def block_record(node: P2PNode, start: int, end: int, cache: int = 1000) -> PeerRecord:
    return PeerRecord(node.peer_id, tuple(node.addrs), MODEL, start, end, throughput=100.0,
                      version="dsd/test", dtype="float32", cache_tokens_left=cache)


async def serve_span(boot: str, start: int, end: int, ttl: float, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """A peer that announces [start, end) until cancelled; started() hands back (node, announcer)."""
    async with P2PNode(create_new_key_pair(), bootstrap=[boot]) as node:
        ann = Announcer(node, lambda: block_record(node, start, end), ttl_s=ttl)
        async with trio.open_nursery() as nursery:
            await nursery.start(ann.run)
            task_status.started((node, ann))
            await trio.sleep_forever()


async def start_span(nursery: trio.Nursery, boot: str, start: int, end: int, ttl: float):
    scope = trio.CancelScope()

    async def run(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve_span(boot, start, end, ttl, task_status=task_status)

    node, ann = await nursery.start(run)
    return node, ann, scope


def spans(records: list[PeerRecord]) -> dict[str, tuple[int, int]]:
    return {r.peer_id: (r.start, r.end) for r in records}


def test_three_peers_announce_and_a_fourth_fetches_them() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with P2PNode(create_new_key_pair()) as boot, trio.open_nursery() as nursery:
                peers = [await start_span(nursery, boot.addrs[0], s, e, ttl=30) for s, e in [(0, 4), (4, 8), (8, 12)]]
                for _node, ann, _scope in peers:
                    assert ann.published == 1 and ann.last_stored_at >= 2  # itself + at least the bootstrap
                async with P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as head:
                    records = await fetch_records(head, MODEL, 12)
                    assert spans(records) == {n.peer_id: (s, e) for (n, _a, _c), (s, e)
                                              in zip(peers, [(0, 4), (4, 8), (8, 12)], strict=True)}
                    for rec, (node, _a, _c) in zip(records, peers, strict=True):
                        assert rec.addrs == tuple(node.addrs) and rec.addrs[0].endswith("/p2p/" + node.peer_id)
                        assert rec.expires - rec.issued == pytest.approx(30)
                        assert rec.cache_tokens_left == 1000 and rec.version == "dsd/test"
                    # the range check drops records past num_layers; 0 means unknown (no check)
                    assert {r.end for r in await fetch_records(head, MODEL, 8)} == {4, 8}
                    assert len(await fetch_records(head, MODEL, 0)) == 3
                    assert await fetch_records(head, "another-model", 12) == []
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_dead_peer_record_disappears_within_ttl_and_withdrawal_is_immediate() -> None:
    ttl = 5.0  # refreshes every 1.7 s: room for a publication slowed by a busy machine

    async def main() -> None:
        with trio.fail_after(50):
            async with P2PNode(create_new_key_pair()) as boot, trio.open_nursery() as nursery:
                a, ann_a, scope_a = await start_span(nursery, boot.addrs[0], 0, 4, ttl)
                b, _ann_b, _scope_b = await start_span(nursery, boot.addrs[0], 4, 8, ttl)
                c, ann_c, scope_c = await start_span(nursery, boot.addrs[0], 0, 8, ttl)
                async with P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as head:
                    # a first publication cut short on a loaded machine lands at the next refresh
                    with trio.fail_after(10):
                        while set(spans(await fetch_records(head, MODEL, 8))) != {a.peer_id, b.peer_id, c.peer_id}:
                            await trio.sleep(0.25)
                    # a dies without a word: its record must be gone within the TTL, b's must stay
                    ann_a.withdraw_on_stop = False
                    scope_a.cancel()
                    died = time.time()
                    while a.peer_id in spans(await fetch_records(head, MODEL, 8)):
                        assert time.time() - died < ttl + 1.0, "dead peer's record outlived its TTL"
                        await trio.sleep(0.25)
                    gone_after = time.time() - died
                    # c leaves politely: its withdrawal removes the record at once
                    await ann_c.stop()
                    scope_c.cancel()
                    after = spans(await fetch_records(head, MODEL, 8))
                    assert c.peer_id not in after
                    # b kept refreshing (every TTL/3) and is still there well past one TTL
                    await trio.sleep(max(0.0, ttl + 0.5 - gone_after))
                    assert spans(await fetch_records(head, MODEL, 8)) == {b.peer_id: (4, 8)}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_tampered_or_misattributed_records_are_rejected() -> None:
    kp, other = create_new_key_pair(), create_new_key_pair()
    from dsd.discovery.identity import peer_id_of

    pid = peer_id_of(kp)
    now = time.time()
    rec = PeerRecord(pid, ("/ip4/127.0.0.1/tcp/4001",), MODEL, 0, 4, throughput=10.0, expires=now + 30, issued=now)
    blob = sign_record(rec, kp)
    assert verify_record(blob) == rec
    outer = msgpack.unpackb(blob)
    # change the span inside the signed body: the signature no longer holds
    body = msgpack.unpackb(outer["body"])
    body["end"] = 40
    forged = msgpack.packb({**outer, "body": msgpack.packb(body)})
    with pytest.raises(RecordError, match="signature"):
        verify_record(forged)
    # a record naming `pid` but signed (validly) by another key
    resigned = msgpack.packb({"body": outer["body"], "pk": other.public_key.serialize(),
                              "sig": other.private_key.sign(b"dsd-record/1\x00" + outer["body"])})
    with pytest.raises(RecordError, match="signed by"):
        verify_record(resigned)
    with pytest.raises(RecordError, match="key belongs to"):
        sign_record(rec, other)
    with pytest.raises(RecordError):
        verify_record(b"\x93garbage")
    # storing nodes refuse them too, and refuse a record filed under another model's key
    store = RecordStore(key_for_model=record_key)
    assert not store.put(record_key(MODEL), forged)
    assert not store.put(record_key(MODEL), resigned)
    assert not store.put(record_key("other"), blob)
    assert store.put(record_key(MODEL), blob) and store.get(record_key(MODEL)) == [blob]
    # an older record never replaces a newer one; an expired one is dropped
    older = sign_record(dataclasses.replace(rec, issued=now - 5), kp)
    assert not store.put(record_key(MODEL), older) and store.get(record_key(MODEL)) == [blob]
    assert store.expire(now + 31) == 1 and store.get(record_key(MODEL), now + 31) == []


def test_record_store_answers_puts_and_gets() -> None:
    kp = create_new_key_pair()
    from dsd.discovery.identity import peer_id_of

    now = time.time()
    rec = PeerRecord(peer_id_of(kp), ("/ip4/127.0.0.1/tcp/4001",), MODEL, 0, 4, expires=now + 30, issued=now)
    blob, key = sign_record(rec, kp), record_key(MODEL)
    store = RecordStore(key_for_model=record_key)
    assert store.answer(RecordsPut(key, (blob, b"\x93garbage"))) == RecordsStored(1)
    assert store.answer(RecordsGet(key)) == RecordsFound((blob,))
    assert store.answer(RecordsGet(record_key("other"))) == RecordsFound(())
    wrong = store.answer(Ping(1))
    assert isinstance(wrong, Error) and wrong.code == "bad_request"


def test_record_store_refuses_hostile_frames_and_keeps_serving() -> None:
    async def send_raw(a: P2PNode, b: P2PNode, data: bytes) -> Message:
        raw = await a.open_raw(b.peer_id, b.addrs, RECORDS_PROTOCOL)
        await raw.write(data)
        return await FramedStream(raw, RECORDS_LIMITS).receive()

    async def main() -> None:
        with trio.fail_after(20):
            async with P2PNode(create_new_key_pair()) as a, P2PNode(create_new_key_pair()) as b:
                # a header claiming more than a records frame holds is answered before any body arrives
                too_big = await send_raw(a, b, (RECORDS_FRAME_BYTES + 1).to_bytes(4, "big"))
                assert isinstance(too_big, Error) and too_big.code == "limit"
                not_msgpack = await send_raw(a, b, b"\x00\x00\x00\x02\xc1\xc1")
                assert isinstance(not_msgpack, Error) and not_msgpack.code == "bad_frame"
                short_key = await send_raw(a, b, raw_frame({"v": "1.0", "type": "records_get", "key": b"short"}))
                assert isinstance(short_key, Error) and "RecordsGet.key" in short_key.message
                untyped = await send_raw(a, b, raw_frame({"op": "get", "key": record_key(MODEL)}))
                assert isinstance(untyped, Error)
                wrong_type = await send_raw(a, b, encode(Ping(1)))
                assert isinstance(wrong_type, Error) and wrong_type.code == "bad_request"
                raw = await a.open_raw(b.peer_id, b.addrs, RECORDS_PROTOCOL)
                assert await ask_records(raw, b.peer_id, RecordsGet(record_key(MODEL))) == RecordsFound(())

    trio.run(main)


def test_forged_record_pushed_into_the_dht_is_not_returned() -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with P2PNode(create_new_key_pair()) as boot, \
                    P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as liar, \
                    P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as head:
                victim = create_new_key_pair()
                from dsd.discovery.identity import peer_id_of

                now = time.time()
                # the liar signs a record claiming to be `victim`: every storing node must refuse it
                rec = PeerRecord(peer_id_of(victim), tuple(liar.addrs), MODEL, 0, 4, expires=now + 30, issued=now)
                body = msgpack.packb(rec.to_dict())
                forged = msgpack.packb({"body": body, "pk": liar.key_pair.public_key.serialize(),
                                        "sig": liar.key_pair.private_key.sign(b"dsd-record/1\x00" + body)})
                assert await liar.put_records(record_key(MODEL), [forged]) == 0
                honest = dataclasses.replace(rec, peer_id=liar.peer_id)
                assert await liar.put_records(record_key(MODEL), [sign_record(honest, liar.key_pair)]) >= 2
                assert spans(await fetch_records(head, MODEL, 8)) == {liar.peer_id: (0, 4)}

    trio.run(main)


def test_ping_rtt_is_positive_and_small() -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with P2PNode(create_new_key_pair()) as a, P2PNode(create_new_key_pair()) as b:
                install_ping_handler(b)
                rtt = await measure_rtt(a, b.peer_id, b.addrs, samples=5)
                assert 0 < rtt < 0.1
                # a stream from a to b answers pings with the same nonce and payload
                stream = await a.open(b.peer_id, b.addrs, "/dsd/ping/1")
                sent = await stream.send(Ping(42, b"x" * 100))
                assert await stream.receive() == Pong(42, b"x" * 100)
                assert stream.bytes_sent == sent and stream.bytes_received == sent
                await stream.close()

    trio.run(main)


def reset_connection(node: P2PNode, peer_id: str) -> None:
    """Abort `node`'s TCP connection to `peer_id` with a RST, as a crashed or cancelled writer would."""
    from libp2p.peer.id import ID

    [conn] = node.host.get_network().get_connections(ID.from_base58(peer_id))
    layer: object = conn.muxed_conn
    for _ in range(10):  # muxer -> security -> raw connection -> trio stream
        if isinstance(layer, trio.SocketStream):
            break
        layer = next(getattr(layer, a) for a in ("secured_conn", "conn", "stream") if hasattr(layer, a))
    assert isinstance(layer, trio.SocketStream), "no TCP stream under the libp2p connection"
    layer.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    layer.socket.close()


def test_a_connection_reset_under_us_is_dialled_again() -> None:
    """py-libp2p keeps a reset connection until it notices; the next stream must dial afresh, not fail."""

    async def main() -> None:
        with trio.fail_after(30):
            async with P2PNode(create_new_key_pair()) as a, P2PNode(create_new_key_pair(), bootstrap=[a.addrs[0]]) as b:
                install_ping_handler(a)
                assert await measure_rtt(b, a.peer_id, a.addrs) > 0
                reset_connection(a, b.peer_id)
                assert await measure_rtt(b, a.peer_id, a.addrs) > 0  # a session's stream
                reset_connection(a, b.peer_id)
                record = sign_record(dataclasses.replace(block_record(b, 0, 4), issued=time.time(),
                                                         expires=time.time() + 30), b.key_pair)
                assert await b.put_records(record_key(MODEL), [record]) == 2  # b itself and a
                assert a.store.get(record_key(MODEL)) == [record]

    trio.run(main)


def test_framed_stream_round_trip_and_clean_eof() -> None:
    async def main() -> None:
        got: list[object] = []
        finished = trio.Event()

        async def echo_twice_then_close(stream: FramedStream, remote: str) -> None:
            got.append(remote)
            for _ in range(2):
                msg = await stream.receive()
                await stream.send(msg)
            finished.set()

        with trio.fail_after(20):
            async with P2PNode(create_new_key_pair()) as a, P2PNode(create_new_key_pair()) as b:
                b.set_handler("/dsd/test/1", echo_twice_then_close)
                s = await a.open(b.peer_id, b.addrs, "/dsd/test/1")
                big = b"\x01" * 300_000  # spans many reads
                await s.send(Ping(1, b"")), await s.send(Pong(2, big))
                assert await s.receive() == Ping(1, b"")
                assert await s.receive() == Pong(2, big)
                with pytest.raises(EOFError):
                    await s.receive()
                await finished.wait()
                assert got == [a.peer_id]

    trio.run(main)


def test_allow_peers_resets_a_strangers_stream() -> None:
    async def main() -> None:
        with trio.fail_after(20):
            async with P2PNode(create_new_key_pair()) as friend, P2PNode(create_new_key_pair()) as stranger:
                async with P2PNode(create_new_key_pair(), allow_peers={friend.peer_id}) as guarded:
                    install_ping_handler(guarded)
                    assert await measure_rtt(friend, guarded.peer_id, guarded.addrs) > 0
                    with pytest.raises(LinkError):
                        await measure_rtt(stranger, guarded.peer_id, guarded.addrs, timeout=3.0)

    trio.run(main)


def test_private_swarm_store_keeps_only_allowed_signers() -> None:
    friend, stranger = create_new_key_pair(), create_new_key_pair()
    from dsd.discovery.identity import peer_id_of

    now = time.time()

    def signed(kp) -> bytes:
        rec = PeerRecord(peer_id_of(kp), ("/ip4/127.0.0.1/tcp/4001",), MODEL, 0, 4, throughput=1.0,
                         expires=now + 30, issued=now)
        return sign_record(rec, kp)

    store = RecordStore(key_for_model=record_key, allow_signers={peer_id_of(friend)})
    theirs, ours = signed(stranger), signed(friend)
    assert not store.put(record_key(MODEL), theirs)
    assert store.put(record_key(MODEL), ours)
    assert store.get(record_key(MODEL)) == [ours]


def departed_peers(key: bytes, count: int, pool: int = 3000):
    """`count` peers that have left the swarm, as routing tables still list them: ids the closest of `pool` fresh
    ones to the DHT key `key` (so, alive, they would store and serve its records first) at a loopback port
    nothing listens on."""
    import hashlib

    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    target = int.from_bytes(hashlib.sha256(key).digest(), "big")
    ids = [ID.from_pubkey(create_new_key_pair().public_key) for _ in range(pool)]
    ids.sort(key=lambda i: target ^ int.from_bytes(hashlib.sha256(i.to_bytes()).digest(), "big"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [PeerInfo(i, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")]) for i in ids[:count]]


def test_records_survive_departed_nodes_closest_to_their_key() -> None:
    """Nodes that joined and left (the heads of earlier generations: `generate` is a process of its own) stay in
    routing tables. When the departed are the nodes closest to a model's key, records must still be stored
    on, and read from, the closest *live* nodes: before, publications went to the departed only, and a head
    found no peer of a span (issue 43: `no live peer serves blocks 6-7`)."""
    from dsd.discovery.records import record_key

    async def main() -> None:
        with trio.fail_after(40):
            async with P2PNode(create_new_key_pair()) as boot, trio.open_nursery() as nursery:
                boot_addr = boot.addrs[0]
                peers = [await start_span(nursery, boot_addr, s, e, ttl=3) for s, e in [(0, 4), (4, 8)]]
                gone = departed_peers(record_key(MODEL), 24)
                for node in (boot, peers[0][0], peers[1][0]):
                    for info in gone:
                        node.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
                        assert await node.dht.add_server(info.peer_id)
                await trio.sleep(7)  # every record stored before has expired; two refreshes went out since
                async with P2PNode(create_new_key_pair(), bootstrap=[boot_addr]) as head:
                    found = spans(await fetch_records(head, MODEL, 8))
                assert found == {peers[0][0].peer_id: (0, 4), peers[1][0].peer_id: (4, 8)}
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_departed_nodes_leave_the_routing_table_and_live_ones_stay() -> None:
    """A node's maintenance drops the listed nodes it cannot dial again (they would be handed to every lookup),
    and keeps a live node even when no connection to it is open."""
    from libp2p.peer.id import ID

    from dsd.discovery.records import record_key

    async def main() -> None:
        with trio.fail_after(30):
            async with P2PNode(create_new_key_pair()) as boot, P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as peer:
                gone = departed_peers(record_key(MODEL), 5)
                for info in gone:
                    boot.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 3600)
                    assert await boot.dht.add_server(info.peer_id)
                await boot.dht.add_server(ID.from_base58(peer.peer_id))
                await boot.host.disconnect(ID.from_base58(peer.peer_id))
                listed = set(boot.dht.routing_table.get_peer_ids())
                assert {i.peer_id for i in gone} <= listed and ID.from_base58(peer.peer_id) in listed
                await boot._drop_departed()
                assert set(boot.dht.routing_table.get_peer_ids()) == {ID.from_base58(peer.peer_id)}

    trio.run(main)


def test_dht_clients_never_enter_a_routing_table_and_servers_do() -> None:
    """A head (a DHT client) that asks a node for records and closest peers is not listed by it: listed, every
    lookup would be handed its address, which nobody can dial once it has left or when it sits behind a NAT.
    A node that serves the DHT is listed once identify has shown it."""
    from libp2p.peer.id import ID

    from dsd.discovery.records import record_key

    async def main() -> None:
        with trio.fail_after(40):
            async with P2PNode(create_new_key_pair()) as boot:
                async with P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]], dht_server=False) as head:
                    for _ in range(3):
                        await head.get_records(record_key(MODEL))
                        await head._refresh_table()
                    assert ID.from_base58(head.peer_id) not in boot.dht.routing_table.get_peer_ids()
                async with P2PNode(create_new_key_pair(), bootstrap=[boot.addrs[0]]) as server:
                    while ID.from_base58(server.peer_id) not in boot.dht.routing_table.get_peer_ids():
                        await server._refresh_table()
                        await trio.sleep(0.2)

    trio.run(main)
