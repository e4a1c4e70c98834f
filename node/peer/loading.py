"""What a serving peer loads before it serves: the store (fetched first with `--model`), the span that fits
its memory, and the block server or federated worker on its device, with the store's files served by hash.

The daemon imports this module only when it serves a store, so a bootstrap node loads no torch.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import trio

from dsd.discovery.announce import Announcer
from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.planner import choose_blocks
from dsd.discovery.survey import live_records
from dsd.node.federated.worker import FederatedWorker
from dsd.node.fetch.fetch import Fetcher
from dsd.node.fetch.local import manifest_sha256
from dsd.node.fetch.plan import files_for
from dsd.node.fetch.progress import fetch_progress
from dsd.node.fetch.request import FetchRequest
from dsd.node.fetch.shard_server import ShardServer, announce_manifest
from dsd.node.server.block import BlockServer
from dsd.node.server.limits import ServerLimits
from dsd.node.server.metrics import PeerMetrics
from dsd.protocol.ids import FEDERATED_PROTOCOL, SHARD_PROTOCOL
from dsd.shard_store import Store
from dsd.shard_store.devices import Placement, free_memory_bytes, resolve_placement
from dsd.shard_store.memory import GIB, layers_that_fit, span_memory

from .config import DaemonConfig, parse_blocks
from .host import Peer, open_peer

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A serving peer before it joins: its config (with a fetched store's path), store, placement, the layers it
    will serve, and the fetch report (`start --model`)."""

    cfg: DaemonConfig
    store: Store
    placement: Placement
    want: int
    fetched: dict | None = None
    fetch: FetchRequest | None = None  # how the store was fetched (`start --model`): a move fetches its new span so


async def prepare(cfg: DaemonConfig) -> Prepared:
    """Check the device (StoreError when it is not there), fetch the store with `--model`, open it and check
    that the span fits (ValueError); set the torch threads. Nothing is loaded yet."""
    placement = resolve_placement(cfg.device, cfg.dtype, cfg.weights)
    if cfg.federated and placement.quantized:
        raise ValueError(f"--weights {placement.weights} packs a block span's layers; a federated worker serves "
                         "the whole model in a float format (--weights fp32 | bf16 | fp16)")
    fetched: dict | None = None
    request = cfg.fetch
    if request is not None:
        cfg, fetched = await fetch_store(cfg)
        request = replace(request, out=cfg.store, manifest_sha256=fetched["manifest_sha256"])
    assert cfg.store is not None
    store = Store(cfg.store)
    if cfg.weights in (None, "auto") and store.manifest.weights and not cfg.federated:
        placement = resolve_placement(cfg.device, cfg.dtype, store.manifest.weights)  # a quantized store's own
    want = plan_layers(cfg, store, placement)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    return Prepared(cfg, store, placement, want, fetched, request)


async def load(prepared: Prepared, peer: Peer, info: dict) -> tuple[BlockServer | None, Announcer]:
    """Load the span (or the whole model as a federated worker) onto the device, serve the store's files by hash,
    add what was loaded to the ready `info`; returns the block server (None for a worker) and the announcer."""
    cfg, store, placement, fetched, node = prepared.cfg, prepared.store, prepared.placement, prepared.fetched, peer.node
    if fetched is not None:
        info["fetch"] = fetched
    server: BlockServer | None = None
    if cfg.federated:
        announcer = await load_worker(cfg, node, store, placement, info, peer.dispatcher.metrics)
    else:
        server = peer.dispatcher.server = await load_blocks(cfg, node, store, placement, prepared.want, info)
        peer.dispatcher.metrics = server.metrics  # one registry: the dispatcher's counts and the server's
        announcer = Announcer(node, server.records, ttl_s=cfg.record_ttl_s)
    verified = [] if fetched is None else fetched["fetched_files"] + fetched["kept_files"]
    node.set_handler(SHARD_PROTOCOL, ShardServer(store, verified=verified))
    announcer.record_fn = announce_manifest(announcer.record_fn, manifest_sha256(store.path))
    return server, announcer


def blocks_that_fit(
    store: Store, memory_gb: float | None, *, dtype: torch.dtype | None = None, limits: ServerLimits | None = None,
    weights: str | None = None,
) -> int:
    """How many layers of `store` fit in `memory_gb` (all of them when no budget is set): their weights in
    `dtype` (default the store's) or the weight format `weights`, plus with `limits` the KV cache of its whole token
    budget and one window's activations (`shard_store.memory`)."""
    num_layers = int(store.manifest.num_layers)
    if memory_gb is None:
        return num_layers
    dtype = dtype or store.dtype
    kv = {"kv_tokens": limits.kv_budget_tokens, "window": limits.max_window, "max_len": limits.max_len} if limits else {}
    fit = layers_that_fit(store, int(memory_gb * GIB), dtype, weights=weights, **kv)
    if fit < 1:
        one = span_memory(store, 0, 1, dtype, weights=weights, **kv)
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
        fit = blocks_that_fit(store, budget, dtype=placement.dtype, limits=limits, weights=placement.weights)
        if cfg.num_blocks is not None and not 1 <= cfg.num_blocks <= num_layers:
            raise ValueError(f"--num-blocks must be in 1..{num_layers} (the model has {num_layers} layers), got {cfg.num_blocks}")
        want = cfg.num_blocks or fit
        start, end = 0, want
    if budget is not None:
        need = span_memory(store, start, end, placement.dtype, kv_tokens=limits.kv_budget_tokens,
                           window=limits.max_window, max_len=limits.max_len, with_head=cfg.federated,
                           weights=placement.weights)
        if need.total > budget * GIB:
            what = "the whole model" if cfg.federated else f"{want} layers"
            raise ValueError(
                f"{what} of {store.manifest.model_id} do not fit on {placement}: they need {need.describe()}, but "
                f"{source}; serve fewer layers (--num-blocks / --blocks), lower --kv-budget or use --dtype bfloat16"
            )
    return want


async def load_worker(
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
    throughput = await announced_throughput(cfg, worker)
    info.update(role="federated", model=worker.model_id, start=0, end=worker.num_layers,
                num_layers=worker.num_layers, vocab_size=worker.vocab_size, topk_cap=worker.topk_cap,
                throughput=throughput, device=str(placement.device), dtype=placement.dtype_name)
    node.set_handler(FEDERATED_PROTOCOL, worker.serve)
    return Announcer(node, worker.records, ttl_s=cfg.record_ttl_s)


async def announced_throughput(cfg: DaemonConfig, server: BlockServer | FederatedWorker) -> float:
    """The tokens/s the peer announces: `--throughput` as given, else measured on its device now."""
    if cfg.throughput is None:
        return await server.measure_throughput()
    server.throughput = cfg.throughput
    log.info("announcing a throughput of %g tokens/s as given (--throughput), not measured", cfg.throughput)
    return cfg.throughput


async def choose_span(cfg: DaemonConfig, node: P2PNode, store: Store, want: int) -> tuple[int, int]:
    """`--blocks A:B` as given, or `auto`: the least-covered span of `want` layers (see `plan_layers`)."""
    num_layers = int(store.manifest.num_layers)
    if cfg.blocks not in (None, "auto"):
        return parse_blocks(cfg.blocks, num_layers)
    records = await live_records(node, store.manifest.model_id, num_layers) if cfg.bootstrap else []
    start, end = choose_blocks(records, num_layers, min(want, num_layers))
    log.info("--blocks auto chose %d:%d (%d live peers' records seen)", start, end, len(records))
    return start, end


async def load_blocks(
    cfg: DaemonConfig, node: P2PNode, store: Store, placement: Placement, want: int, info: dict
) -> BlockServer:
    """Load a span of layers onto the device and measure it there (the announced throughput), to serve on `/dsd/infer/1`."""
    start, end = await choose_span(cfg, node, store, want)
    t0 = time.perf_counter()
    server = await trio.to_thread.run_sync(
        lambda: BlockServer(node, store, start, end, limits=cfg.limits, wire=cfg.wire,
                            device=placement.device, dtype=placement.dtype, fault=cfg.fault, batching=cfg.batching,
                            weights=placement.weights)
    )
    log.info("loaded blocks %d:%d of %s on %s in %.1f s", start, end, server.model_id, placement, time.perf_counter() - t0)
    throughput = await announced_throughput(cfg, server)
    info.update(model=server.model_id, start=start, end=end, num_layers=int(store.manifest.num_layers),
                throughput=throughput, device=str(placement.device), dtype=placement.dtype_name, codec=server.wire.codec,
                zstd=server.wire.zstd, weights=server.span.weights)
    if cfg.fault is not None:
        info["fault"] = str(cfg.fault)
    return server


async def fetch_store(cfg: DaemonConfig) -> tuple[DaemonConfig, dict]:
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
                    want = plan_layers(cfg, store, resolve_placement(cfg.device, cfg.dtype, cfg.weights))
                    start, end = await choose_span(cfg, peer.node, store, want)
                report = await fetcher.fetch(files_for(store.manifest, (start, end), head=cfg.federated))
            except Exception as exc:  # raised below, outside the node's nursery (not as an exception group)
                failure = exc
    if failure is not None:
        raise failure
    log.info("fetched %d files (%.1f MB, %d kept) of %s blocks %d:%d in %.1f s into %s",
             len(report["fetched_files"]), report["bytes_needed"] / 1e6, len(report["kept_files"]),
             cfg.fetch.model, start, end, report["seconds"], report["out"])
    return replace(cfg, store=Path(report["out"]), blocks=f"{start}:{end}", fetch=None), report
