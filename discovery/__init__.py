"""libp2p host, DHT records, RTT probes and route planning."""
