"""`dsd-node start --metrics-port P`: a peer's Prometheus metrics at `GET /metrics`, from the daemon's trio loop.

A tiny starlette app on hypercorn's trio worker (`dsd.node.peer.http`), in the daemon's
nursery: no prometheus_client HTTP thread. The numbers are counted by the server rooms
(`dsd.node.server.metrics`); this only renders them when scraped.
"""

from __future__ import annotations

import functools

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from dsd.discovery.tasks import owned_nursery
from dsd.node.server.metrics import PeerMetrics

from .http import serve_http

DEFAULT_METRICS_HOST = "127.0.0.1"  # this machine only, unless --metrics-host says otherwise


def metrics_app(metrics: PeerMetrics) -> Starlette:
    """`GET /metrics` in Prometheus' text format; every other path is 404."""

    async def scrape(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"content-type": content_type})

    return Starlette(routes=[Route("/metrics", scrape, methods=["GET"])])


async def serve_metrics(metrics: PeerMetrics, host: str, port: int, *,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `metrics` on `host:port` until cancelled; `task_status.started` gets the URL of `/metrics`.
    A port that cannot be bound is one plain OSError naming it, before `started`."""
    async with owned_nursery() as nursery:  # a failure to start comes out as itself
        url = await nursery.start(functools.partial(serve_http, metrics_app(metrics), host, port, graceful_s=1.0))
        task_status.started(f"{url}/metrics")
