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

from dsd.protocol import ProtocolError
from dsd.protocol import tree_rules as wire

from .errors import StoreError

MAX_TREE_NODES = 256  # mask building is O(n^2); far above the 60-node trees EAGLE-2 drafts


def _as_list(value: object) -> object:
    """A tensor or numpy array (decoded from the wire) as a list; anything else as it is."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, Sequence) and not isinstance(value, str | bytes) else value


def check_parents(parents: object, max_nodes: int = MAX_TREE_NODES) -> list[int]:
    """Validate a parents array (ints, -1 <= parents[i] < i, 1..max_nodes nodes) and return it as a list.

    The rule is the wire's (`dsd.protocol.tree_rules.check_parents`); its error becomes a StoreError
    naming the bad index. parents[i] < i means no forward references and so no cycles.
    """
    try:
        return list(wire.check_parents(_as_list(parents), max_nodes, "parents"))
    except ProtocolError as exc:
        raise StoreError(f"tree {exc}") from None


def is_chain(parents: Sequence[int]) -> bool:
    """True when the (checked) parents describe a plain chain -1, 0, 1, ..."""
    return wire.is_chain(parents)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node of a checked parents array (children of the committed token have depth 0)."""
    return wire.depths(parents)


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
    that kept row k sits at position committed_len + k as it did when it was computed (the wire's
    rule, `dsd.protocol.tree_rules.check_path`, as a StoreError).
    """
    try:
        return list(wire.check_path(parents, nodes, _as_list(rows), "rows"))
    except ProtocolError as exc:
        raise StoreError(f"path {exc}") from None
