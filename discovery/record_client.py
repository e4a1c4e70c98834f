"""The client side of the DHT's record store: put a key's signed records on the closest live nodes, and get them back.

Candidates are the nodes a Kademlia lookup and the routing table know, closest to the key first; they are
asked `REPLICATION` at a time, and a node that fails or refuses hands its place to the next one. Nodes that
left the swarm stay listed in routing tables until someone fails to reach them (py-libp2p drops an entry
only then), so the closest listed nodes may all be gone: walking past them keeps the records on, and the
reads on, nodes that are there.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import trio
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID

from dsd.protocol import Message, RecordsFound, RecordsGet, RecordsPut, RecordsStored
from dsd.protocol.ids import RECORDS_PROTOCOL

from .record_store import ask_records

log = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=Message)

# Kademlia replication: how many of the closest live nodes store each record (and are asked for it).
REPLICATION = 20
# Nodes considered per put or get: the closest live ones may sit behind many that left the swarm.
MAX_CANDIDATES = 64
# A record-store request (dial included) that takes longer fails.
REQUEST_TIMEOUT_S = 3.0
# A Kademlia lookup that has not finished by then gives up (py-libp2p waits up to 10 s on each unresponsive peer).
LOOKUP_TIMEOUT_S = 4.0
# Once one answer to a get holds records, the others get this long, or as long again as it took, whichever is more.
GET_GRACE_S = 0.5


class RecordClient:
    """Record-store requests of one running `P2PNode` (its DHT, host, local store and stream opener)."""

    def __init__(self, node: Any) -> None:
        self.node = node

    async def _request(self, peer: ID, request: Message, reply_type: type[Reply]) -> Reply | None:
        """Send one record-store request; None when the peer fails (then it leaves the routing table) or refuses.

        Its connections are left alone: a node slow to answer may be carrying a session of ours."""
        try:
            with trio.fail_after(REQUEST_TIMEOUT_S):
                raw = await self.node._new_stream(peer, RECORDS_PROTOCOL)
                reply = await ask_records(raw, peer.to_base58(), request)
        except Exception as exc:
            log.debug("record-store request to %s failed: %r", peer, exc)
            if self.node.dht is not None:
                self.node.dht.routing_table.remove_peer(peer)
            return None
        if not isinstance(reply, reply_type):
            log.debug("record-store peer %s answered %s to %s: %s", peer, reply.TYPE, request.TYPE,
                      getattr(reply, "message", ""))
            return None
        return reply

    def _local_candidates(self, key: bytes) -> list[ID]:
        """Every node this one knows (routing table and open connections) but itself, closest to `key` first;
        connected peers that identify says serve no record store (heads, peers behind NATs) are left out."""
        assert self.node.dht is not None
        me = ID.from_base58(self.node.peer_id)
        store = self.node.host.get_peerstore()

        def may_store(peer: ID) -> bool:
            try:
                protocols = store.get_protocols(peer)
            except Exception:
                return True
            return not protocols or RECORDS_PROTOCOL in protocols

        connected = [p for p in self.node.host.get_connected_peers() if may_store(p)]
        known = [*self.node.dht.routing_table.find_local_closest_peers(key, MAX_CANDIDATES), *connected]
        return [p for p in sort_peer_ids_by_distance(key, list(dict.fromkeys(known))) if p != me]

    async def _lookup(self, key: bytes) -> list[ID]:
        """The nodes a Kademlia lookup finds closest to `key` (those that left the swarm among them: tables keep
        them until someone fails to reach them); [] if the lookup is slow."""
        assert self.node.dht is not None
        found: list[ID] = []
        with trio.move_on_after(LOOKUP_TIMEOUT_S):
            found = await self.node.dht.peer_routing.find_closest_peers_network(key, MAX_CANDIDATES)
        return found

    async def put(self, key: bytes, blobs: Sequence[bytes]) -> int:
        """Store signed records under `key` here and on the `REPLICATION` closest nodes that take them; returns
        how many nodes did (self included).

        Candidates are tried closest first; one that fails or refuses hands its place to the next, so nodes
        that left the swarm but are still listed closest to the key never keep a record from the live ones."""
        request = RecordsPut(key, tuple(blobs))
        count = [1 if any([self.node.store.put(request.key, b) for b in request.records]) else 0]
        found = await self._lookup(request.key)
        candidates = iter(sort_peer_ids_by_distance(request.key, list(dict.fromkeys(
            [*found, *self._local_candidates(request.key)]
        ))))
        me = ID.from_base58(self.node.peer_id)

        async def place() -> None:
            for peer in candidates:  # shared by every placer: each takes the next candidate
                if peer == me:
                    continue
                reply = await self._request(peer, request, RecordsStored)
                if reply is not None and reply.stored > 0:
                    count[0] += 1
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(REPLICATION):
                nursery.start_soon(place)
        log.debug("records under %s stored on %d node(s)", request.key[:4].hex(), count[0])
        return count[0]

    async def get(self, key: bytes) -> list[bytes]:
        """Every signed record under `key` held here or by the `REPLICATION` closest nodes that answer
        (unverified, deduplicated).

        The known nodes closest to the key are asked at once, `REPLICATION` at a time, and those a Kademlia
        lookup finds join the queue as it finds them (closest first); a node that fails hands its place to the
        next, so departed nodes listed closest to the key never hide the live ones. Once one answer holds
        records, the rest get `GET_GRACE_S` or as long as that answer took (whichever is more), so an
        unresponsive node never holds the answer up.
        """
        assert self.node.dht is not None
        request = RecordsGet(key)
        blobs: dict[bytes, None] = dict.fromkeys(self.node.store.get(request.key))
        queue = self._local_candidates(request.key)
        asked: set[ID] = set()
        answers = [0]
        t0 = trio.current_time()
        answered = trio.Event()
        more = trio.Event()  # set when the lookup has added candidates

        def next_peer() -> ID | None:
            while queue:
                peer = queue.pop(0)
                if peer not in asked:
                    asked.add(peer)
                    return peer
            return None

        async def ask(lookup_done: trio.Event) -> None:
            nonlocal more
            while answers[0] < REPLICATION:
                peer = next_peer()
                if peer is None:
                    if lookup_done.is_set():
                        return
                    await more.wait()
                    continue
                reply = await self._request(peer, request, RecordsFound)
                if reply is None:
                    continue
                answers[0] += 1
                if reply.records:
                    blobs.update(dict.fromkeys(reply.records))
                    answered.set()

        async def lookup(done: trio.Event) -> None:
            nonlocal more
            found = await self._lookup(request.key)
            queue[:] = sort_peer_ids_by_distance(request.key, list(dict.fromkeys([*queue, *found])))
            done.set()
            more.set()
            more = trio.Event()

        async def everyone(outer: trio.CancelScope) -> None:
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lookup, done)
                for _ in range(REPLICATION):
                    nursery.start_soon(ask, done)
            outer.cancel()

        async def cutoff(outer: trio.CancelScope) -> None:
            await answered.wait()
            await trio.sleep(max(GET_GRACE_S, trio.current_time() - t0))
            outer.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(everyone, nursery.cancel_scope)
            nursery.start_soon(cutoff, nursery.cancel_scope)
        log.debug("records under %s: %d from %d node(s) in %.2f s", request.key[:4].hex(), len(blobs), answers[0],
                  trio.current_time() - t0)
        return list(blobs)
