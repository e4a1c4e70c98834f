"""py-libp2p's Kademlia DHT with one correction: only peers known to serve the DHT enter the routing table.

The library lists every peer that opens a KAD stream to it ("they MUST support KAD server mode") and every
peer a lookup hears of whose protocols it does not know yet. But DHT clients query too: heads, and peers
behind NATs that nobody can dial. Listed, they are handed to every lookup as close nodes, and each lookup then
waits on dials that cannot succeed (a NAT drops them silently). Here a peer is listed only once identify has
shown that it serves KAD, or when the node vouches for it (`add_server`: its bootstrap peers, the answers
of its own lookups); `client_peers` names listed peers found since to be clients, for the node's maintenance;
and lookups start from listed servers only (see MIN_PEERS_THRESHOLD below).
"""

from __future__ import annotations

from typing import Any

from libp2p.kad_dht import peer_routing
from libp2p.kad_dht.common import PROTOCOL_ID as KAD_PROTOCOL
from libp2p.kad_dht.kad_dht import KadDHT
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

# A lookup starting from a table of fewer than this many peers adds every connected peer and every peer the
# peerstore ever heard of (default 5): heads and private peers among them, whose stale addresses a NAT drops
# without an answer, so the lookup hangs. A dsd node asks only listed servers unless its table is empty.
peer_routing.MIN_PEERS_THRESHOLD = 1


class ServersOnlyDHT(KadDHT):
    """A KadDHT whose routing table holds DHT servers only (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        table_add = self.routing_table.add_peer

        async def add_known_server(peer: PeerInfo | ID, *, skip_server_mode_check: bool = False) -> bool:
            pid = peer.peer_id if isinstance(peer, PeerInfo) else peer
            if str(KAD_PROTOCOL) not in self._protocols_of(pid):
                return False
            return await table_add(peer, skip_server_mode_check=True)

        self._table_add = table_add
        self.routing_table.add_peer = add_known_server  # type: ignore[method-assign]

    async def add_server(self, peer_id: ID) -> bool:
        """List a peer known to serve the DHT some other way (a bootstrap peer, an answer of our own lookup)."""
        return await self._table_add(peer_id, skip_server_mode_check=True)

    def _protocols_of(self, peer_id: ID) -> list[str]:
        try:
            return list(self.host.get_peerstore().get_protocols(peer_id) or [])
        except Exception:
            return []

    def client_peers(self) -> list[ID]:
        """Listed peers whose identify says they do not serve KAD."""
        out = []
        for peer in self.routing_table.get_peer_ids():
            protocols = self._protocols_of(peer)
            if protocols and str(KAD_PROTOCOL) not in protocols:
                out.append(peer)
        return out
