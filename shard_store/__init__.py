"""Model store: checkpoint import, per-layer-span weights, span/head/full loading."""

from .errors import StoreError
from .kv_cache import SpanCache
from .manifest import Manifest
from .modules import HeadModule, SpanModule
from .store import Store
from .writer import convert, write_store

__all__ = [
    "HeadModule",
    "Manifest",
    "SpanCache",
    "SpanModule",
    "Store",
    "StoreError",
    "convert",
    "write_store",
]
