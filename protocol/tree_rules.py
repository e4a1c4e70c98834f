"""Token-tree windows on the wire, as pure rules: the `parents` array of a window and the `keep` path.

A window of n nodes is in topological order: parents[i] is the index of node i's parent inside
the window, or -1 when its parent is the last committed token; a chain is -1, 0, 1, ... Node i
sits at position committed_len + depth(i). After a tree the head names the accepted nodes of
that window, root first (`keep`); each must be a child of the one before, so kept node k lands
at position committed_len + k, where it was computed. Every error is a ProtocolError naming the
bad index (code bad_request; too many nodes is a `limit`).
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import BAD_REQUEST, LIMIT, ProtocolError


def _items(value: object, field: str) -> Sequence[object]:
    if not isinstance(value, list | tuple):
        raise ProtocolError(f"must be a list of ints, got {type(value).__name__}", field, BAD_REQUEST)
    return value


def _int(value: object, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"must be an int, got {type(value).__name__}", field, BAD_REQUEST)
    return value


def check_parents(parents: object, max_nodes: int, field: str = "parents") -> tuple[int, ...]:
    """A parents array of 1..max_nodes ints with -1 <= parents[i] < i (no forward reference, so no cycle)."""
    items = _items(parents, field)
    if not items:
        raise ProtocolError("is empty: a tree window needs at least one node", field, BAD_REQUEST)
    if len(items) > max_nodes:
        raise ProtocolError(f"has {len(items)} nodes, at most {max_nodes} are allowed", field, LIMIT)
    out: list[int] = []
    for i, raw in enumerate(items):
        p = _int(raw, f"{field}[{i}]")
        if not -1 <= p < i:
            raise ProtocolError(
                f"{p} is not -1 or an earlier node in [0, {i}) (nodes must be in topological order)",
                f"{field}[{i}]",
                BAD_REQUEST,
            )
        out.append(p)
    return tuple(out)


def check_keep(keep: object, max_nodes: int, field: str = "keep") -> tuple[int, ...]:
    """The shape of a keep path as a message carries it: 1..max_nodes node indices in [0, max_nodes)."""
    items = _items(keep, field)
    if not items:
        raise ProtocolError("is empty: to keep no node, send commit alone", field, BAD_REQUEST)
    if len(items) > max_nodes:
        raise ProtocolError(f"has {len(items)} nodes, at most {max_nodes} are allowed", field, LIMIT)
    out: list[int] = []
    for k, raw in enumerate(items):
        r = _int(raw, f"{field}[{k}]")
        if not 0 <= r < max_nodes:
            raise ProtocolError(f"{r} is not a node index in [0, {max_nodes})", f"{field}[{k}]", BAD_REQUEST)
        out.append(r)
    return tuple(out)


def check_path(parents: Sequence[int] | None, nodes: int, path: object, field: str = "keep") -> tuple[int, ...]:
    """`path` as a root-to-node path of a window of `nodes` nodes with these checked parents (None = a chain)."""
    items = _items(path, field)
    out: list[int] = []
    for k, raw in enumerate(items):
        r = _int(raw, f"{field}[{k}]")
        if not 0 <= r < nodes:
            raise ProtocolError(f"{r} is outside the last window's nodes [0, {nodes})", f"{field}[{k}]", BAD_REQUEST)
        want = out[-1] if out else -1
        parent = r - 1 if parents is None else parents[r]
        if parent != want:
            where = "a child of the committed token" if want < 0 else f"a child of node {want}"
            raise ProtocolError(f"{r} is not {where} (its parent is {parent})", f"{field}[{k}]", BAD_REQUEST)
        out.append(r)
    return tuple(out)


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of checked parents (children of the committed token have depth 0)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def positions(parents: Sequence[int] | None, nodes: int) -> int:
    """How many positions past the committed length a window reaches: its depth + 1 (a chain: its size)."""
    return nodes if parents is None else max(depths(parents)) + 1


def is_chain(parents: Sequence[int]) -> bool:
    """True when checked parents are the plain chain -1, 0, 1, ..."""
    return all(p == i - 1 for i, p in enumerate(parents))
