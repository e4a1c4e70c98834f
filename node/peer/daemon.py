"""The `dsd-node start` daemon: a libp2p host that serves a span of layers and announces it.

Every role is this one process with different options: a bootstrap node (DHT
only), a block peer (DHT + `/dsd/infer/1`), and — from the head's side — the
sink of return legs. The daemon owns one nursery; SIGINT/SIGTERM cancel it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import trio

from dsd.discovery.announce import Announcer, fetch_records
from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.planner import choose_blocks
from dsd.node.federated.worker import FederatedWorker
from dsd.node.server.block import BlockServer
from dsd.node.server.ledger import ServerLimits
from dsd.protocol import WireFormat
from dsd.protocol.ids import FEDERATED_PROTOCOL
from dsd.shard_store import Store
from dsd.shard_store.files import atomic_write_bytes

from .host import open_peer
from .shaper import LinkProfile

log = logging.getLogger(__name__)

SHUTDOWN_DEADLINE_S = 10.0


@dataclass
class DaemonConfig:
    """Everything `dsd-node start` was asked to do."""

    identity: Path
    listen: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    bootstrap: list[str] = field(default_factory=list)
    store: Path | None = None
    blocks: str | None = None  # "A:B" or "auto"
    num_blocks: int | None = None  # for auto
    memory_gb: float | None = None  # for auto without num_blocks: serve as many layers as fit
    link: LinkProfile = field(default_factory=LinkProfile)
    limits: ServerLimits = field(default_factory=ServerLimits)
    wire: WireFormat = field(default_factory=WireFormat)
    threads: int | None = None
    ready_file: Path | None = None
    allow_peers: set[str] | None = None
    record_ttl_s: float = 30.0
    seed: int | None = None
    federated: bool = False  # serve the whole model as a federated worker (`/dsd/federated/1`)
    topk_cap: int | None = None  # federated: largest K returned (default: the vocabulary)
    topk_codec: str = "fp16"  # federated: probability codec of the top-K answers


def parse_blocks(text: str, num_layers: int) -> tuple[int, int]:
    """Parse "A:B" into a half-open span inside [0, num_layers)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"--blocks must look like START:END (e.g. 0:7) or auto, got {text!r}") from exc
    if not 0 <= a < b <= num_layers:
        raise ValueError(f"--blocks {text}: need 0 <= START < END <= {num_layers} (the model has {num_layers} layers)")
    return a, b


def blocks_that_fit(store, memory_gb: float | None) -> int:
    """How many layers of `store` fit in `memory_gb` of weights (all of them when no budget is set)."""
    num_layers = int(store.manifest.num_layers)
    if memory_gb is None:
        return num_layers
    per_layer = max(1, store.span_nbytes(0, 1))
    fit = int(memory_gb * 2**30 // per_layer)
    if fit < 1:
        raise ValueError(f"--memory-gb {memory_gb} is less than one layer ({per_layer / 2**30:.2f} GiB)")
    return min(fit, num_layers)


async def _load_worker(cfg: DaemonConfig, node: P2PNode, store: Store, info: dict) -> Announcer:
    """Serve the whole model as a federated worker on `/dsd/federated/1`; returns its announcer."""
    t0 = time.perf_counter()
    worker = await trio.to_thread.run_sync(
        lambda: FederatedWorker(node, store, topk_cap=cfg.topk_cap, prob_codec=cfg.topk_codec, limits=cfg.limits)
    )
    log.info("loaded %s as a federated worker in %.1f s", worker.model_id, time.perf_counter() - t0)
    throughput = await worker.measure_throughput()
    info.update(role="federated", model=worker.model_id, start=0, end=worker.num_layers,
                num_layers=worker.num_layers, vocab_size=worker.vocab_size, topk_cap=worker.topk_cap,
                throughput=throughput)
    node.set_handler(FEDERATED_PROTOCOL, worker.serve)
    return Announcer(node, worker.records, ttl_s=cfg.record_ttl_s)


async def _choose_span(cfg: DaemonConfig, node: P2PNode, store: Store) -> tuple[int, int]:
    """`--blocks A:B` as given, or `auto`: the least-covered span of as many layers as allowed."""
    num_layers = int(store.manifest.num_layers)
    if cfg.blocks not in (None, "auto"):
        return parse_blocks(cfg.blocks, num_layers)
    records = await fetch_records(node, store.manifest.model_id, num_layers) if cfg.bootstrap else []
    want = cfg.num_blocks or blocks_that_fit(store, cfg.memory_gb)
    start, end = choose_blocks(records, num_layers, min(want, num_layers))
    log.info("--blocks auto chose %d:%d (%d records seen)", start, end, len(records))
    return start, end


async def _load_blocks(cfg: DaemonConfig, node: P2PNode, store: Store, info: dict) -> BlockServer:
    """Load and measure a span of layers to serve on `/dsd/infer/1`."""
    start, end = await _choose_span(cfg, node, store)
    t0 = time.perf_counter()
    server = await trio.to_thread.run_sync(
        lambda: BlockServer(node, store, start, end, limits=cfg.limits, wire=cfg.wire)
    )
    log.info("loaded blocks %d:%d of %s in %.1f s", start, end, server.model_id, time.perf_counter() - t0)
    throughput = await server.measure_throughput()
    info.update(model=server.model_id, start=start, end=end, num_layers=int(store.manifest.num_layers),
                throughput=throughput)
    return server


async def run_daemon(cfg: DaemonConfig, *, task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation); on a signal withdraw the records, then end sessions."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    key_pair = load_or_create_identity(cfg.identity)
    store = Store(cfg.store) if cfg.store else None
    async with open_peer(
        key_pair, cfg.bootstrap, cfg.link, listen=cfg.listen, seed=cfg.seed, allow_peers=cfg.allow_peers
    ) as peer, trio.open_nursery() as nursery:
        node = peer.node
        info: dict = {"peer_id": node.peer_id, "addrs": list(node.addrs), "pid": os.getpid()}
        server: BlockServer | None = None
        announcer: Announcer | None = None
        if store is not None and cfg.federated:
            announcer = await _load_worker(cfg, node, store, info)
        elif store is not None:
            server = peer.dispatcher.server = await _load_blocks(cfg, node, store, info)
            announcer = Announcer(node, server.records, ttl_s=cfg.record_ttl_s)
        if announcer is not None:
            await nursery.start(announcer.run)
        print(f"dsd-node {node.peer_id} listening on {' '.join(node.addrs)}", flush=True)
        if cfg.ready_file:
            atomic_write_bytes(cfg.ready_file, json.dumps(info, indent=2).encode())
        task_status.started(info)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.warning("received %s: shutting down", signal.Signals(signum).name)
                break
        # Stop announcing first so heads re-plan around us, then end sessions with an error frame.
        if announcer is not None:
            with trio.move_on_after(SHUTDOWN_DEADLINE_S / 2):
                await announcer.stop()
        if server is not None:
            await server.shutdown(SHUTDOWN_DEADLINE_S / 2)
        log.warning("shut down cleanly")
        nursery.cancel_scope.cancel()
