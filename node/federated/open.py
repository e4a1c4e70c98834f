"""Opening federated workers for one generation: find the live workers of the vocabulary, open a backend over them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from dsd.discovery.host import P2PNode

from .backend import FederatedBackend, open_federated_backend
from .pool import FederatedError, find_workers


@asynccontextmanager
async def open_federated(
    node: P2PNode, *, vocab_size: int, peer_ids: Sequence[str] | None = None, **options: Any
) -> AsyncIterator[FederatedBackend]:
    """A `FederatedBackend` over every live worker of `vocab_size`'s pool (or the workers `peer_ids` names, in that
    order); `options` as `FederatedBackend`'s. FederatedError when none is live or none opens."""
    workers = await find_workers(node, vocab_size, peer_ids=peer_ids)
    if not workers:
        raise FederatedError(f"no live federated worker with a vocabulary of {vocab_size} tokens")
    async with open_federated_backend(node, workers, vocab_size=vocab_size, **options) as backend:
        yield backend
