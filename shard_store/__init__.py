"""Model store: checkpoint import, per-layer-span weights, span/head/full loading, token-tree windows."""

from .errors import StoreError
from .kv_cache import SpanCache
from .manifest import Manifest
from .modules import HeadModule, SpanModule
from .store import Store
from .tree import (
    MAX_TREE_NODES,
    check_parents,
    check_path,
    tree_depths,
    tree_mask,
    tree_position_ids,
)
from .writer import convert, write_store

__all__ = [
    "MAX_TREE_NODES",
    "HeadModule",
    "Manifest",
    "SpanCache",
    "SpanModule",
    "Store",
    "StoreError",
    "check_parents",
    "check_path",
    "convert",
    "tree_depths",
    "tree_mask",
    "tree_position_ids",
    "write_store",
]
