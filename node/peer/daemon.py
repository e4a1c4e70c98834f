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
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import trio

from dsd.discovery.announce import Announcer, fetch_records
from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.planner import choose_blocks
from dsd.node.federated.worker import FederatedWorker
from dsd.node.fetch.fetch import Fetcher, FetchRequest
from dsd.node.fetch.local import manifest_sha256
from dsd.node.fetch.plan import files_for
from dsd.node.fetch.progress import fetch_progress
from dsd.node.fetch.serve import ShardServer, announce_manifest
from dsd.node.server.block import BlockServer
from dsd.node.server.ledger import ServerLimits
from dsd.node.server.metrics import PeerMetrics
from dsd.protocol import WireFormat
from dsd.protocol.ids import FEDERATED_PROTOCOL, SHARD_PROTOCOL
from dsd.shard_store import Store, StoreError
from dsd.shard_store.devices import Placement, free_memory_bytes, resolve_placement
from dsd.shard_store.files import atomic_write_bytes
from dsd.shard_store.memory import GIB, layers_that_fit, span_memory

from .host import Peer, open_peer
from .metrics_http import DEFAULT_METRICS_HOST, serve_metrics
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
    fetch: FetchRequest | None = None  # `start --model`: no store yet; fetch the span's files first (`_fetch_store`)
    blocks: str | None = None  # "A:B" or "auto"
    num_blocks: int | None = None  # for auto
    memory_gb: float | None = None  # for auto without num_blocks: serve as many layers as fit
    link: LinkProfile = field(default_factory=LinkProfile)
    limits: ServerLimits = field(default_factory=ServerLimits)
    wire: WireFormat = field(default_factory=lambda: WireFormat("auto"))  # auto: the codec of the compute dtype
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps (shard_store.devices)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16: the compute dtype, whatever the store holds
    threads: int | None = None
    ready_file: Path | None = None
    allow_peers: set[str] | None = None
    record_ttl_s: float = 30.0
    seed: int | None = None
    federated: bool = False  # serve the whole model as a federated worker (`/dsd/federated/1`)
    topk_cap: int | None = None  # federated: largest K returned (default: the vocabulary)
    topk_codec: str = "fp16"  # federated: probability codec of the top-K answers
    metrics_port: int | None = None  # serve Prometheus metrics at http://metrics_host:port/metrics (0: any free port)
    metrics_host: str = DEFAULT_METRICS_HOST


def parse_blocks(text: str, num_layers: int) -> tuple[int, int]:
    """Parse "A:B" into a half-open span inside [0, num_layers)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise ValueError(f"--blocks must look like START:END (e.g. 0:7) or auto, got {text!r}") from exc
    if not 0 <= a < b <= num_layers:
        raise ValueError(f"--blocks {text}: need 0 <= START < END <= {num_layers} (the model has {num_layers} layers)")
    return a, b


def blocks_that_fit(
    store: Store, memory_gb: float | None, *, dtype: torch.dtype | None = None, limits: ServerLimits | None = None
) -> int:
    """How many layers of `store` fit in `memory_gb` (all of them when no budget is set): their weights in
    `dtype` (default the store's), plus with `limits` the KV cache of its whole token budget and one window's
    activations (`shard_store.memory`)."""
    num_layers = int(store.manifest.num_layers)
    if memory_gb is None:
        return num_layers
    dtype = dtype or store.dtype
    kv = {"kv_tokens": limits.kv_budget_tokens, "window": limits.max_window, "max_len": limits.max_len} if limits else {}
    fit = layers_that_fit(store, int(memory_gb * GIB), dtype, **kv)
    if fit < 1:
        one = span_memory(store, 0, 1, dtype, **kv)
        raise ValueError(f"--memory-gb {memory_gb} is less than one layer ({one.describe()})")
    return min(fit, num_layers)


def memory_budget_gb(cfg: DaemonConfig, placement: Placement) -> tuple[float | None, str]:
    """The memory a peer may fill and where that number comes from: `--memory-gb`, else on an accelerator
    90 % of what torch reports free; on the CPU without `--memory-gb` nothing is accounted (weights are
    memory-mapped and shared through the page cache)."""
    if cfg.memory_gb is not None:
        return cfg.memory_gb, f"--memory-gb allows {cfg.memory_gb:g} GiB"
    if placement.device.type == "cpu":
        return None, ""
    free = free_memory_bytes(placement.device)
    if free is None:
        return None, ""
    return 0.9 * free / GIB, f"{placement.device} has {free / GIB:.2f} GiB free (90 % of it usable)"


def plan_layers(cfg: DaemonConfig, store: Store, placement: Placement) -> int:
    """How many layers this peer will serve, checked against its memory before anything is loaded.

    `--blocks A:B` (or the whole model for a federated worker) must fit; `--blocks auto` serves
    `--num-blocks` (which must fit) or as many as fit. ValueError, with the accounting, when not.
    """
    num_layers = int(store.manifest.num_layers)
    budget, source = memory_budget_gb(cfg, placement)
    limits = cfg.limits
    if cfg.federated or cfg.blocks not in (None, "auto"):
        start, end = (0, num_layers) if cfg.federated else parse_blocks(str(cfg.blocks), num_layers)
        want = end - start
    else:
        fit = blocks_that_fit(store, budget, dtype=placement.dtype, limits=limits)
        if cfg.num_blocks is not None and not 1 <= cfg.num_blocks <= num_layers:
            raise ValueError(f"--num-blocks must be in 1..{num_layers} (the model has {num_layers} layers), got {cfg.num_blocks}")
        want = cfg.num_blocks or fit
        start, end = 0, want
    if budget is not None:
        need = span_memory(store, start, end, placement.dtype, kv_tokens=limits.kv_budget_tokens,
                           window=limits.max_window, max_len=limits.max_len, with_head=cfg.federated)
        if need.total > budget * GIB:
            what = "the whole model" if cfg.federated else f"{want} layers"
            raise ValueError(
                f"{what} of {store.manifest.model_id} do not fit on {placement}: they need {need.describe()}, but "
                f"{source}; serve fewer layers (--num-blocks / --blocks), lower --kv-budget or use --dtype bfloat16"
            )
    return want


async def _load_worker(
    cfg: DaemonConfig, node: P2PNode, store: Store, placement: Placement, info: dict, metrics: PeerMetrics
) -> Announcer:
    """Serve the whole model as a federated worker on `/dsd/federated/1`, counting in the peer's `metrics`;
    returns its announcer."""
    t0 = time.perf_counter()
    worker = await trio.to_thread.run_sync(
        lambda: FederatedWorker(node, store, topk_cap=cfg.topk_cap, prob_codec=cfg.topk_codec, limits=cfg.limits,
                                device=placement.device, dtype=placement.dtype, metrics=metrics)
    )
    log.info("loaded %s as a federated worker in %.1f s", worker.model_id, time.perf_counter() - t0)
    throughput = await worker.measure_throughput()
    info.update(role="federated", model=worker.model_id, start=0, end=worker.num_layers,
                num_layers=worker.num_layers, vocab_size=worker.vocab_size, topk_cap=worker.topk_cap,
                throughput=throughput, device=str(placement.device), dtype=placement.dtype_name)
    node.set_handler(FEDERATED_PROTOCOL, worker.serve)
    return Announcer(node, worker.records, ttl_s=cfg.record_ttl_s)


async def _choose_span(cfg: DaemonConfig, node: P2PNode, store: Store, want: int) -> tuple[int, int]:
    """`--blocks A:B` as given, or `auto`: the least-covered span of `want` layers (see `plan_layers`)."""
    num_layers = int(store.manifest.num_layers)
    if cfg.blocks not in (None, "auto"):
        return parse_blocks(cfg.blocks, num_layers)
    records = await fetch_records(node, store.manifest.model_id, num_layers) if cfg.bootstrap else []
    start, end = choose_blocks(records, num_layers, min(want, num_layers))
    log.info("--blocks auto chose %d:%d (%d records seen)", start, end, len(records))
    return start, end


async def _load_blocks(
    cfg: DaemonConfig, node: P2PNode, store: Store, placement: Placement, want: int, info: dict
) -> BlockServer:
    """Load a span of layers onto the device and measure it there (the announced throughput), to serve on `/dsd/infer/1`."""
    start, end = await _choose_span(cfg, node, store, want)
    t0 = time.perf_counter()
    server = await trio.to_thread.run_sync(
        lambda: BlockServer(node, store, start, end, limits=cfg.limits, wire=cfg.wire,
                            device=placement.device, dtype=placement.dtype)
    )
    log.info("loaded blocks %d:%d of %s on %s in %.1f s", start, end, server.model_id, placement, time.perf_counter() - t0)
    throughput = await server.measure_throughput()
    info.update(model=server.model_id, start=start, end=end, num_layers=int(store.manifest.num_layers),
                throughput=throughput, device=str(placement.device), dtype=placement.dtype_name, codec=server.wire.codec)
    return server


async def _fetch_store(cfg: DaemonConfig) -> tuple[DaemonConfig, dict]:
    """`start --model`: join the swarm, fetch the manifest (checked against its trust root), choose the span,
    fetch its files (the whole model for a federated worker); returns the config of serving that store, and
    the fetch report. Failures (FetchError, StoreError, ValueError) come out as themselves."""
    assert cfg.fetch is not None
    failure: Exception | None = None
    key_pair = load_or_create_identity(cfg.identity)
    with fetch_progress(f"fetching {cfg.fetch.model}", sys.stderr.isatty()) as on_progress:
        async with open_peer(key_pair, cfg.bootstrap, cfg.link, seed=cfg.seed, allow_peers=cfg.allow_peers) as peer:
            try:
                fetcher = Fetcher(peer.node, cfg.fetch, on_progress=on_progress)
                store = Store((await fetcher.open()).path)
                if cfg.federated:
                    start, end = 0, store.num_layers
                else:
                    want = plan_layers(cfg, store, resolve_placement(cfg.device, cfg.dtype))
                    start, end = await _choose_span(cfg, peer.node, store, want)
                report = await fetcher.fetch(files_for(store.manifest, (start, end), head=cfg.federated))
            except Exception as exc:  # raised below, outside the node's nursery (not as an exception group)
                failure = exc
    if failure is not None:
        raise failure
    log.info("fetched %d files (%.1f MB, %d kept) of %s blocks %d:%d in %.1f s into %s",
             len(report["fetched_files"]), report["bytes_needed"] / 1e6, len(report["kept_files"]),
             cfg.fetch.model, start, end, report["seconds"], report["out"])
    return replace(cfg, store=Path(report["out"]), blocks=f"{start}:{end}", fetch=None), report


async def run_daemon(cfg: DaemonConfig, *, task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation); on a signal withdraw the records, then end sessions."""
    # A bootstrap node computes nothing; a serving one fails here, before fetching or loading anything, when
    # its device is not there (StoreError), and below when its span does not fit (ValueError).
    placement = resolve_placement(cfg.device, cfg.dtype) if cfg.store or cfg.fetch else None
    fetched: dict | None = None
    if cfg.fetch is not None:
        cfg, fetched = await _fetch_store(cfg)
    store = Store(cfg.store) if cfg.store else None
    want = plan_layers(cfg, store, placement) if store is not None and placement is not None else 0
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    key_pair = load_or_create_identity(cfg.identity)
    failure: Exception | None = None
    async with open_peer(
        key_pair, cfg.bootstrap, cfg.link, listen=cfg.listen, seed=cfg.seed, allow_peers=cfg.allow_peers
    ) as peer, trio.open_nursery() as nursery:
        try:
            info, server, announcer = await _start_serving(cfg, peer, nursery, store, placement, want, fetched)
        except (OSError, ValueError, StoreError) as exc:  # raised below, outside the peer's nurseries (not as a group)
            failure = exc
            nursery.cancel_scope.cancel()
        if failure is None:
            await _serve_until_signal(cfg, peer.node, info, server, announcer, task_status)
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _start_serving(
    cfg: DaemonConfig, peer: Peer, nursery: trio.Nursery, store: Store | None, placement: Placement | None, want: int,
    fetched: dict | None,
) -> tuple[dict, BlockServer | None, Announcer | None]:
    """Load what this peer serves, start announcing it and the metrics endpoint in `nursery`: the ready info,
    the block server and the announcer (None for what this peer does not run). A span that does not fit
    (ValueError), a store that cannot load (StoreError) or a metrics port that cannot be bound (OSError) fail."""
    node = peer.node
    info: dict = {"peer_id": node.peer_id, "addrs": list(node.addrs), "pid": os.getpid()}
    if fetched is not None:
        info["fetch"] = fetched
    server: BlockServer | None = None
    announcer: Announcer | None = None
    if store is not None and placement is not None and cfg.federated:
        announcer = await _load_worker(cfg, node, store, placement, info, peer.dispatcher.metrics)
    elif store is not None and placement is not None:
        server = peer.dispatcher.server = await _load_blocks(cfg, node, store, placement, want, info)
        peer.dispatcher.metrics = server.metrics  # one registry: the dispatcher's counts and the server's
        announcer = Announcer(node, server.records, ttl_s=cfg.record_ttl_s)
    if store is not None:  # a peer serving a store serves its files by hash, and announces its manifest's
        verified = [] if fetched is None else fetched["fetched_files"] + fetched["kept_files"]
        node.set_handler(SHARD_PROTOCOL, ShardServer(store, verified=verified))
        if announcer is not None:
            announcer.record_fn = announce_manifest(announcer.record_fn, manifest_sha256(store.path))
    if cfg.metrics_port is not None:  # before announcing: a port in use ends the start before anyone is told
        try:
            info["metrics_url"] = await nursery.start(serve_metrics, peer.dispatcher.metrics, cfg.metrics_host,
                                                      cfg.metrics_port)
        except OSError as exc:
            raise OSError(f"--metrics-port {cfg.metrics_port}: {exc}") from None
    if announcer is not None:
        await nursery.start(announcer.run)
    return info, server, announcer


async def _serve_until_signal(
    cfg: DaemonConfig, node: P2PNode, info: dict, server: BlockServer | None, announcer: Announcer | None,
    task_status: trio.TaskStatus[dict],
) -> None:
    """Say we are ready, wait for SIGINT/SIGTERM, then withdraw the records and end the sessions."""
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
