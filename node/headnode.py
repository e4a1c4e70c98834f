"""A head's own libp2p node: an ephemeral identity, the WAN shaper, and the sink for return legs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.ping import install_ping_handler

from .client import ReturnLegs
from .daemon import InferDispatcher
from .server import INFER_PROTOCOL
from .shaper import LinkProfile, LinkShaper


@asynccontextmanager
async def head_node(
    bootstrap: list[str],
    link: LinkProfile | None = None,
    *,
    identity: Path | None = None,
    listen: list[str] | None = None,
    seed: int | None = None,
) -> AsyncIterator[tuple[P2PNode, ReturnLegs]]:
    """Join the swarm as a head; yields the node and the return-leg registry its sessions use."""
    key_pair = load_or_create_identity(identity) if identity else create_new_key_pair()
    shaper = LinkShaper(link or LinkProfile(), seed=seed)
    legs = ReturnLegs()
    async with trio.open_nursery() as nursery:
        await nursery.start(shaper.run)
        async with P2PNode(key_pair, listen or ["/ip4/127.0.0.1/tcp/0"], bootstrap, stream_wrapper=shaper.wrap) as node:
            install_ping_handler(node)
            node.set_handler(INFER_PROTOCOL, InferDispatcher(None, legs))
            yield node, legs
        nursery.cancel_scope.cancel()
