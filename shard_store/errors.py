"""The one error type of the shard store, so callers can catch store problems apart from bugs."""

from __future__ import annotations


class StoreError(Exception):
    """A store cannot be written, read or trusted: missing file, size/hash mismatch, bad manifest,
    unsupported model family, or misuse of a span/cache. The message names what was wrong."""
