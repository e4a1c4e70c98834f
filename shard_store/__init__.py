"""Model store: checkpoint import, per-layer-span weights, span/head/full loading, token-tree windows.

The names below load their module on first use, so that importing a light part of the store
(`dsd.shard_store.files`, `.manifest`, `.errors`) does not load torch: commands such as
`dsd-node testnet down` run in a fraction of a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names as type checkers see them ("X as X": re-exported)
    from .errors import StoreError as StoreError
    from .kv_cache import SpanCache as SpanCache
    from .manifest import Manifest as Manifest
    from .modules import HeadModule as HeadModule
    from .modules import SpanModule as SpanModule
    from .modules import SpanWindow as SpanWindow
    from .store import Store as Store
    from .tree_windows import MAX_TREE_NODES as MAX_TREE_NODES
    from .tree_windows import check_parents as check_parents
    from .tree_windows import check_path as check_path
    from .tree_windows import tree_depths as tree_depths
    from .tree_windows import tree_mask as tree_mask
    from .tree_windows import tree_position_ids as tree_position_ids
    from .writer import convert as convert
    from .writer import write_store as write_store

_HOMES = {
    "MAX_TREE_NODES": "tree_windows",
    "HeadModule": "modules",
    "Manifest": "manifest",
    "SpanCache": "kv_cache",
    "SpanModule": "modules",
    "SpanWindow": "modules",
    "Store": "store",
    "StoreError": "errors",
    "check_parents": "tree_windows",
    "check_path": "tree_windows",
    "convert": "writer",
    "tree_depths": "tree_windows",
    "tree_mask": "tree_windows",
    "tree_position_ids": "tree_windows",
    "write_store": "writer",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    """Import the module that holds `name` on first access (PEP 562) and keep the value here."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value
