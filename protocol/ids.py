"""Every libp2p protocol id dsd speaks, versioned: one place to look them up."""

INFER_PROTOCOL = "/dsd/infer/1"  # block sessions along the ring, and the return legs to the head
FEDERATED_PROTOCOL = "/dsd/federated/1"  # SpecFed workers: draft windows in, top-K distributions out
PING_PROTOCOL = "/dsd/ping/1"  # RTT probes
RECORDS_PROTOCOL = "/dsd/records/1"  # signed discovery records stored on the DHT's closest nodes
SHARD_PROTOCOL = "/dsd/shard/1"  # content-addressed shard transfer (manifest and files by hash)
