"""Token-tree helpers for tests: a node's root-to-node path and a tree's leaves."""

from __future__ import annotations

from collections.abc import Sequence


def path_to(parents: Sequence[int], node: int | None) -> list[int]:
    """Node indices from the root down to `node` (none for None)."""
    path: list[int] = []
    while node is not None and node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def leaves(parents: Sequence[int]) -> list[int]:
    """The nodes no other node hangs from, in order."""
    return sorted(set(range(len(parents))) - set(parents))
