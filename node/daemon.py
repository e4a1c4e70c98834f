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

from dsd.discovery.framing import FramedStream
from dsd.discovery.host import P2PNode
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.ping import install_ping_handler
from dsd.protocol import Ack, Error, OpenSession, ProtocolError

from .client import ReturnLegs
from .server import INFER_PROTOCOL, BlockServer
from .settings import ServerLimits, WireFormat
from .shaper import LinkProfile, LinkShaper

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


class InferDispatcher:
    """Routes each incoming `/dsd/infer/1` stream by its first message: a session to serve, or a return leg."""

    def __init__(self, server: BlockServer | None, legs: ReturnLegs, first_timeout_s: float = 30.0) -> None:
        self.server = server
        self.legs = legs
        self.first_timeout_s = first_timeout_s

    async def __call__(self, stream: FramedStream, remote: str) -> None:
        try:
            with trio.fail_after(self.first_timeout_s):
                first = await stream.receive()
        except (trio.TooSlowError, EOFError, ProtocolError, OSError, trio.BrokenResourceError) as exc:
            log.info("infer stream from %s: bad opening (%r)", remote, exc)
            code = "bad_frame" if isinstance(exc, ProtocolError) else "bad_request"
            await _refuse(stream, Error(code, f"bad opening message: {exc}"))
            return
        if isinstance(first, OpenSession) and self.server is not None:
            await self.server.serve(stream, remote, first)
        elif isinstance(first, Ack):
            await self.legs.serve(stream, remote, first)
        elif isinstance(first, OpenSession):
            await _refuse(stream, Error("bad_request", "this peer serves no blocks", first.session))
        else:
            await _refuse(stream, Error("bad_request", f"a session must start with OpenSession, got {type(first).__name__}", getattr(first, "session", None)))


async def _refuse(stream: FramedStream, error: Error) -> None:
    with trio.move_on_after(5):
        try:
            await stream.send(error)
            await stream.close()
        except Exception as exc:
            log.debug("refusal not delivered: %r", exc)


def _write_ready(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    os.replace(tmp, path)


async def run_daemon(cfg: DaemonConfig, *, task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED) -> None:
    """Run until SIGINT/SIGTERM or cancellation."""
    from dsd.discovery.planner import choose_blocks
    from dsd.discovery.records import Announcer, fetch_records
    from dsd.shard_store import Store

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    key_pair = load_or_create_identity(cfg.identity)
    store = Store(cfg.store) if cfg.store else None
    shaper = LinkShaper(cfg.link, seed=cfg.seed)
    legs = ReturnLegs()
    async with trio.open_nursery() as nursery:
        await nursery.start(shaper.run)
        async with P2PNode(
            key_pair, cfg.listen, cfg.bootstrap, stream_wrapper=shaper.wrap, allow_peers=cfg.allow_peers
        ) as node:
            install_ping_handler(node)
            server = None
            announcer = None
            info: dict = {"peer_id": node.peer_id, "addrs": list(node.addrs), "pid": os.getpid()}
            if store is not None and cfg.federated:
                from .federated import FEDERATED_PROTOCOL, FederatedWorker, make_handler

                t0 = time.perf_counter()
                worker = await trio.to_thread.run_sync(
                    lambda: FederatedWorker(node, store, topk_cap=cfg.topk_cap, prob_codec=cfg.topk_codec, limits=cfg.limits)
                )
                log.info("loaded %s as a federated worker in %.1f s", worker.model_id, time.perf_counter() - t0)
                throughput = await worker.measure_throughput()
                info.update(role="federated", model=worker.model_id, start=0, end=worker.num_layers,
                            num_layers=worker.num_layers, vocab_size=worker.vocab_size, topk_cap=worker.topk_cap,
                            throughput=throughput)
                node.set_handler(FEDERATED_PROTOCOL, make_handler(worker))
                announcer = Announcer(node, worker.records, ttl_s=cfg.record_ttl_s)
                await nursery.start(announcer.run)
            elif store is not None:
                manifest = store.manifest
                num_layers = int(manifest.num_layers)
                if cfg.blocks in (None, "auto"):
                    records = await fetch_records(node, manifest.model_id, num_layers) if cfg.bootstrap else []
                    want = cfg.num_blocks or blocks_that_fit(store, cfg.memory_gb)
                    start, end = choose_blocks(records, num_layers, min(want, num_layers))
                    log.info("--blocks auto chose %d:%d (%d records seen)", start, end, len(records))
                else:
                    start, end = parse_blocks(cfg.blocks, num_layers)
                t0 = time.perf_counter()
                server = await trio.to_thread.run_sync(
                    lambda: BlockServer(node, store, start, end, limits=cfg.limits, wire=cfg.wire)
                )
                log.info("loaded blocks %d:%d of %s in %.1f s", start, end, manifest.model_id, time.perf_counter() - t0)
                throughput = await server.measure_throughput()
                info.update(model=manifest.model_id, start=start, end=end, num_layers=num_layers, throughput=throughput)
            node.set_handler(INFER_PROTOCOL, InferDispatcher(server, legs))
            if server is not None:
                announcer = Announcer.for_block_server(node, server, throughput=info["throughput"], ttl_s=cfg.record_ttl_s)
                await nursery.start(announcer.run)
            print(f"dsd-node {node.peer_id} listening on {' '.join(node.addrs)}", flush=True)
            if cfg.ready_file:
                _write_ready(cfg.ready_file, info)
            task_status.started(info)
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.warning("received %s: shutting down", signal.Signals(signum).name)
                    break
            # Stop announcing first so heads re-plan around us, then end sessions with an error frame.
            with trio.move_on_after(SHUTDOWN_DEADLINE_S / 2):
                if announcer is not None:
                    await announcer.stop()
            if server is not None:
                await server.shutdown(SHUTDOWN_DEADLINE_S / 2)
            log.warning("shut down cleanly")
            nursery.cancel_scope.cancel()
