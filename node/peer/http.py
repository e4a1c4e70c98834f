"""Serving an ASGI app from the peer's own trio loop: hypercorn's trio worker in the caller's nursery.

Shared by `dsd-node serve` (the OpenAI-compatible API) and `dsd-node start --metrics-port`
(a peer's Prometheus metrics): no second event loop, no thread; the app's handlers can use the
process's trio objects directly.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve


def bind_address(host: str, port: int) -> str:
    """hypercorn's bind of `host:port` (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_http(
    app: Any,
    host: str,
    port: int,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]] | None = None,
    graceful_s: float = 3.0,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on `host:port` until `shutdown_trigger` returns (open requests then get `graceful_s`) or
    cancellation; `task_status.started` gets the URL once listening (with the real port when `port` is 0).

    A port that cannot be bound (in use, not allowed, no such address) is one plain `OSError` saying
    which, raised before `started` (hypercorn raises it nested in its nurseries' exception groups)."""
    cfg = HypercornConfig()
    cfg.bind = [bind_address(host, port)]
    cfg.accesslog = None
    cfg.errorlog = logging.getLogger("hypercorn.error")
    cfg.graceful_timeout = graceful_s
    failure: OSError | None = None
    async with trio.open_nursery() as nursery:  # returns when hypercorn does
        try:
            binds = await nursery.start(functools.partial(hypercorn_serve, app, cfg, shutdown_trigger=shutdown_trigger))
        except BaseExceptionGroup as group:
            failure = _bind_failure(group, host, port)
            if failure is None:
                raise
        else:
            task_status.started(binds[0])
    if failure is not None:  # raised here, outside the nursery: not wrapped in a group again
        raise failure


def _bind_failure(group: BaseExceptionGroup, host: str, port: int) -> OSError | None:
    """The OSError inside hypercorn's failure to start, as one error naming the address; None if there is none."""
    match = group.subgroup(lambda exc: isinstance(exc, OSError))
    while isinstance(match, BaseExceptionGroup):
        match = match.exceptions[0]
    if match is None:
        return None
    failure = OSError(f"cannot listen on http://{bind_address(host, port)}: {match.strerror or match}")
    failure.errno = match.errno
    return failure
