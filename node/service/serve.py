"""`dsd-node serve`: one trio loop runs the head's libp2p node, the swarm survey and the HTTP server.

hypercorn's trio worker serves the starlette app inside the same nursery as the libp2p host,
so handlers use the node and the head directly: no second event loop, no threads for I/O.
Torch work goes to worker threads as everywhere in the head. On SIGINT/SIGTERM the server
stops accepting, open requests get `graceful_s` to finish, then everything is cancelled (which
closes the generations' route sessions on the peers).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from starlette.routing import BaseRoute

from dsd.discovery.tasks import owned_nursery
from dsd.node.peer.generation import swarm_watch
from dsd.node.peer.host import head_node
from dsd.node.peer.http import serve_http
from dsd.node.peer.shaper import LinkProfile
from dsd.shard_store.files import atomic_write_bytes

from .admission import Admission
from .app import build_app
from .defaults import (
    DEFAULT_HOST,
    DEFAULT_MAX_CONCURRENT,
    DEFAULT_MAX_PER_CLIENT,
    DEFAULT_PORT,
    DEFAULT_QUEUE,
    DEFAULT_REFRESH_S,
)
from .guards import HttpLimits
from .metrics import ServiceMetrics
from .model import HeadOptions, ServedModel
from .runner import ServiceState

log = logging.getLogger(__name__)


@dataclass
class ServeConfig:
    """Everything `dsd-node serve` was asked to do."""

    bootstrap: list[str]
    head: HeadOptions
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    max_concurrent: int = DEFAULT_MAX_CONCURRENT
    queue: int = DEFAULT_QUEUE
    max_per_client: int = DEFAULT_MAX_PER_CLIENT  # 0: no fixed cap (the fair share applies when full)
    api_keys: tuple[str, ...] = ()  # /v1 takes any of them (none: no key); with several, clients are their keys
    limits: HttpLimits = field(default_factory=HttpLimits)
    link: LinkProfile = field(default_factory=LinkProfile)
    identity: Path | None = None
    listen: list[str] | None = None  # the head's libp2p listen addresses (default loopback)
    refresh_s: float = DEFAULT_REFRESH_S
    graceful_s: float = 3.0
    ready_file: Path | None = None
    seed: int | None = None


def read_api_keys(path: Path) -> tuple[str, ...]:
    """The keys in `path`, one a line (blank lines and lines starting with # skipped); ValueError when there is none.
    A file of one key is the single-key service it always was."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    keys = tuple(dict.fromkeys(line for line in lines if line and not line.startswith("#")))
    if not keys:
        raise ValueError(f"{path} holds no API key")
    return keys


ExtraRoutes = Callable[[ServiceState], Sequence[BaseRoute]]


async def run_service(
    cfg: ServeConfig,
    *,
    extra_routes: ExtraRoutes | None = None,
    shutdown: trio.Event | None = None,
    task_status: trio.TaskStatus[dict[str, Any]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the head, join the swarm, survey it, serve HTTP until `shutdown` is set (or cancellation).

    `task_status.started` gets {url, model, peer_id, pid, state} once the server listens (`url`
    carries the real port when `port` is 0); `extra_routes(state)` adds routes to the app.
    """
    head = await trio.to_thread.run_sync(ServedModel.load, cfg.head)
    joined = ", ".join(head.batching_stats())
    log.info("loaded the head of %s (%d layers, context %d, draft %s%s, mode %s) on %s %s%s", head.model_id,
             head.num_layers, head.context_limit, cfg.head.draft,
             f", work joined across requests: {joined}" if joined else "", cfg.head.mode, head.device,
             head.dtype, "" if head.local_blocks is None else ", serving blocks {}:{} itself".format(*head.local_blocks))
    shutdown = trio.Event() if shutdown is None else shutdown
    # owned nurseries: a failure to start (the port in use, say) comes out as itself, not in an exception group
    async with head_node(cfg.bootstrap, cfg.link, identity=cfg.identity, seed=cfg.seed, listen=cfg.listen) as (node, legs):
        async with owned_nursery() as nursery:
            admission = Admission(cfg.max_concurrent, cfg.queue, cfg.max_per_client)
            metrics = ServiceMetrics(lambda: admission.running, lambda: admission.waiting,
                                     head.batching_stats())
            swarm = swarm_watch(node, head.setup, head.local_blocks, refresh_s=cfg.refresh_s,
                                on_survey=metrics.observe_survey)
            await nursery.start(swarm.run)
            state = ServiceState(head=head, node=node, legs=legs, swarm=swarm, admission=admission, metrics=metrics,
                                 api_key=cfg.api_keys[0] if cfg.api_keys else None)
            app = build_app(state, extra_routes(state) if extra_routes else (), limits=cfg.limits,
                            api_keys=cfg.api_keys)
            async with owned_nursery() as http:  # returns when hypercorn does: after shutdown + graceful_s
                url = await http.start(functools.partial(serve_http, app, cfg.host, cfg.port,
                                                         shutdown_trigger=shutdown.wait, graceful_s=cfg.graceful_s))
                info = {"url": url, "model": head.model_id, "peer_id": node.peer_id, "pid": os.getpid(),
                        "max_concurrent": cfg.max_concurrent, "queue": cfg.queue, "max_per_client": cfg.max_per_client,
                        "max_body_bytes": cfg.limits.max_body_bytes, "device": head.device,
                        "dtype": head.dtype, "store": str(cfg.head.store),
                        "blocks": list(head.local_blocks) if head.local_blocks else None}
                print(f"dsd-node serve: {head.model_id} on {url}/v1 (head peer {node.peer_id})", flush=True)
                if cfg.ready_file:
                    atomic_write_bytes(cfg.ready_file, json.dumps(info, indent=2).encode())
                task_status.started({**info, "state": state})
            nursery.cancel_scope.cancel()


def serve_until_signal(cfg: ServeConfig, extra_routes: ExtraRoutes | None = None) -> None:
    """Run the service until SIGINT or SIGTERM (the `dsd-node serve` main loop)."""

    async def main() -> None:
        shutdown = trio.Event()
        async with owned_nursery() as nursery:  # a failure to start comes out as itself
            await nursery.start(functools.partial(run_service, cfg, extra_routes=extra_routes, shutdown=shutdown))
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.warning("received %s: shutting down", signal.Signals(signum).name)
                    break
            shutdown.set()

    trio.run(main)
    log.warning("stopped")
