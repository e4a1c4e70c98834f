"""Token-tree windows as plain functions: check a `parents` array, derive depths, position ids,
the ancestor-only additive attention mask, and check an accepted root-to-node path.

A window of n nodes is in topological order; parents[i] is the index of node i's parent inside
the window, or -1 when the parent is the last committed token. A chain is [-1, 0, 1, ...].
Node i sits at position committed_len + depth(i) and attends to every committed position plus
its own ancestors and itself. Every function but check_parents expects parents that passed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import StoreError

MAX_TREE_NODES = 256  # mask building is O(n^2); far above the 60-node trees EAGLE-2 drafts


def check_parents(parents: object, max_nodes: int = MAX_TREE_NODES) -> list[int]:
    """Validate a parents array (ints, -1 <= parents[i] < i, 1..max_nodes nodes) and return it as a list.

    parents[i] < i means no forward references and so no cycles; the message names the bad index.
    """
    if hasattr(parents, "tolist"):  # a tensor or numpy array decoded from the wire
        parents = parents.tolist()
    if not isinstance(parents, Sequence) or isinstance(parents, (str, bytes)):
        raise StoreError(f"tree parents must be a list of ints, got {type(parents).__name__}")
    n = len(parents)
    if n == 0:
        raise StoreError("tree parents is empty: a tree window needs at least one node")
    if n > max_nodes:
        raise StoreError(f"tree has {n} nodes, at most {max_nodes} are allowed")
    out: list[int] = []
    for i, p in enumerate(parents):
        if isinstance(p, bool) or not isinstance(p, int):
            raise StoreError(f"tree parents[{i}] must be an int, got {type(p).__name__}")
        if not -1 <= p < i:
            raise StoreError(
                f"tree parents[{i}] = {p} is not -1 or an earlier node in [0, {i}) "
                "(nodes must be in topological order)"
            )
        out.append(p)
    return out


def is_chain(parents: Sequence[int]) -> bool:
    """True when the (checked) parents describe a plain chain -1, 0, 1, ..."""
    return all(p == i - 1 for i, p in enumerate(parents))


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a checked parents array (children of the committed token have depth 0)."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_position_ids(committed_len: int, parents: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Position ids [1, n]: committed_len + depth of each node."""
    depths = torch.tensor(tree_depths(parents), dtype=torch.long, device=device)
    return (depths + committed_len).unsqueeze(0)


def tree_ancestors(parents: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """Bool [n, n]: entry (i, j) is True when node j is node i or one of its ancestors."""
    n = len(parents)
    rows = torch.arange(n, device=device)
    up = torch.tensor(parents, dtype=torch.long, device=device)
    anc = torch.zeros(n, n, dtype=torch.bool, device=device)
    anc[rows, rows] = True
    cur = up.clone()
    live = cur >= 0
    while bool(live.any()):  # one step up the tree per pass: max depth passes in all
        anc[rows[live], cur[live]] = True
        cur = torch.where(live, up[cur.clamp(min=0)], cur)
        live = cur >= 0
    return anc


def tree_mask(
    committed_len: int,
    parents: Sequence[int],
    dtype: torch.dtype,
    sliding_window: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Additive mask [1, 1, n, committed_len + n]: 0 where a node may attend, finfo(dtype).min elsewhere.

    Columns are the committed positions then the window's nodes in order; each node sees every
    committed position and its ancestors and itself. With a sliding window, a key is also blocked
    unless its position is > the query's position - sliding_window (as for chains).
    """
    if isinstance(committed_len, bool) or not isinstance(committed_len, int) or committed_len < 0:
        raise StoreError(f"tree committed length must be a non-negative int, got {committed_len!r}")
    n = len(parents)
    allowed = torch.ones(n, committed_len + n, dtype=torch.bool, device=device)
    allowed[:, committed_len:] = tree_ancestors(parents, device=device)
    if sliding_window:
        q_pos = tree_position_ids(committed_len, parents, device=device)[0]
        k_pos = torch.cat([torch.arange(committed_len, device=device), q_pos])
        allowed &= k_pos[None, :] > q_pos[:, None] - int(sliding_window)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def check_path(parents: Sequence[int] | None, nodes: int, rows: object) -> list[int]:
    """Validate `rows` as a root-to-node path of a window of `nodes` nodes (parents None = chain).

    rows[0] must be a child of the committed token and each next row a child of the one before, so
    that kept row k sits at position committed_len + k as it did when it was computed.
    """
    if hasattr(rows, "tolist"):
        rows = rows.tolist()
    if not isinstance(rows, Sequence) or isinstance(rows, (str, bytes)):
        raise StoreError(f"path rows must be a list of ints, got {type(rows).__name__}")
    out: list[int] = []
    for k, r in enumerate(rows):
        if isinstance(r, bool) or not isinstance(r, int):
            raise StoreError(f"path rows[{k}] must be an int, got {type(r).__name__}")
        if not 0 <= r < nodes:
            raise StoreError(f"path rows[{k}] = {r} is outside the last window's nodes [0, {nodes})")
        want = out[-1] if out else -1
        parent = r - 1 if parents is None else parents[r]
        if parent != want:
            where = "a child of the committed token" if want < 0 else f"a child of node {want}"
            raise StoreError(f"path rows[{k}] = {r} is not {where} (its parent is {parent})")
        out.append(r)
    return out
