"""Structured-concurrency helpers shared by everything that owns background tasks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio


@asynccontextmanager
async def owned_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery for the tasks an object owns; an error in the block cancels them and comes out as
    itself once they are gone (not wrapped in an exception group, so callers catch it by type)."""
    failure: Exception | None = None
    async with trio.open_nursery() as nursery:
        try:
            yield nursery
        except Exception as exc:  # re-raised below, once the nursery is closed
            failure = exc
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
