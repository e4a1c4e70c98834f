"""The one peer every role runs: an identity, the WAN shaper, a libp2p node, ping, and the infer dispatcher.

`open_peer` is shared by the daemon (`dsd-node start`) and every head (`generate`,
`route`, the testnet's waits, benchmarks), so a head and a block peer are the same
process shape: the shaper delays what this process sends, ping answers RTT probes,
and `/dsd/infer/1` streams go to the block server (if any) or to the return legs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.keys import KeyPair

from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.nat import NatOptions
from dsd.discovery.ping import install_ping_handler
from dsd.discovery.tasks import owned_nursery
from dsd.node.route.legs import ReturnLegs
from dsd.protocol.ids import INFER_PROTOCOL

from .dispatch import InferDispatcher
from .shaper import LinkProfile, LinkShaper

DEFAULT_LISTEN = ("/ip4/127.0.0.1/tcp/0",)


@dataclass
class Peer:
    """A running peer: its libp2p node, the return legs its head sessions use, and its dispatcher."""

    node: P2PNode
    legs: ReturnLegs
    dispatcher: InferDispatcher


@asynccontextmanager
async def open_peer(
    key_pair: KeyPair,
    bootstrap: list[str],
    link: LinkProfile | None = None,
    *,
    listen: list[str] | None = None,
    seed: int | None = None,
    allow_peers: set[str] | None = None,
    dht_server: bool = True,
    nat: NatOptions | None = None,
) -> AsyncIterator[Peer]:
    """Start the shaper and the libp2p node, install ping and the infer dispatcher; stop both on exit.
    `dht_server` False: a DHT client, which stores and serves no records (a head: it comes and goes).
    `nat`: how it deals with NATs (default: learn its reachability, serve no relay; it dials relayed peers).

    A failure to start (no bootstrap peer reachable, say) and an error of the `async with` block come
    out as themselves, not wrapped in an exception group, so callers catch them by type."""
    shaper = LinkShaper(link or LinkProfile(), seed=seed)
    legs = ReturnLegs()
    dispatcher = InferDispatcher(None, legs)
    async with owned_nursery() as nursery:
        await nursery.start(shaper.run)
        async with P2PNode(
            key_pair, list(listen or DEFAULT_LISTEN), bootstrap, stream_wrapper=shaper.wrap, allow_peers=allow_peers,
            dht_server=dht_server, nat=nat or NatOptions(),
        ) as node:
            install_ping_handler(node)
            node.set_handler(INFER_PROTOCOL, dispatcher)
            yield Peer(node, legs, dispatcher)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def head_node(
    bootstrap: list[str],
    link: LinkProfile | None = None,
    *,
    identity: Path | None = None,
    listen: list[str] | None = None,
    seed: int | None = None,
) -> AsyncIterator[tuple[P2PNode, ReturnLegs]]:
    """Join the swarm as a head (an ephemeral identity unless one is given); yields the node and its return legs.

    A head is a DHT client: it reads records but holds none, so the records of the swarm never sit on a node
    that leaves when its generation ends, and the swarm's routing tables do not fill with departed heads."""
    key_pair = load_or_create_identity(identity) if identity else create_new_key_pair()
    async with open_peer(key_pair, bootstrap, link, listen=listen, seed=seed, dht_server=False) as peer:
        yield peer.node, peer.legs
