"""py-libp2p's log lines that are normal churn in a swarm, hidden: importing this module installs the filter."""

from __future__ import annotations

import logging


class _DropLibp2pNoise(logging.Filter):
    """Hide py-libp2p warnings that are normal churn: DHT peers hanging up, dead peers, shutdown races, relayed
    circuits closing, punches that fail (ours says what failed, once, in its own words)."""

    NOISE = (
        "Failed to read DHT message",
        "Failed to open stream to",
        "Cannot schedule task after service has stopped",
        "Failed to open TCP stream",
        "MultiselectClient handshake",
        # relay v2 and DCUtR: circuits and punches ending when a peer hangs up or a punch fails
        "reading from hop stream",
        "Unexpected error reading from stream",
        "Error relaying data",
        "Failed to fetch stored addresses",
        "Error handling stop stream",
        "Error handling AutoNAT stream",
        "Unexpected error opening TCP stream",  # a punch or redial trying an address a NAT never answers
        "Hole punch",
        "hole punch",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(n in msg for n in self.NOISE)


for _name in (
    "libp2p.kad_dht.kad_dht",
    "libp2p.kad_dht.peer_routing",
    "libp2p.network.swarm",
    "libp2p.host.basic_host",
    "libp2p.transport.tcp.tcp",
    "libp2p.protocol_muxer.multiselect_client",
    "libp2p.relay.circuit_v2.protocol",
    "libp2p.relay.circuit_v2.transport",
    "libp2p.relay.circuit_v2.dcutr",
    "libp2p.host.autonat.autonat",
):
    logging.getLogger(_name).addFilter(_DropLibp2pNoise())
