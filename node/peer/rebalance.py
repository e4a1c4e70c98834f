"""A block peer that moves its span when the swarm would be better covered elsewhere (issue 56): the loop and the
move. The decision is `dsd.discovery.rebalance` (pure); this module reads the records, loads, swaps and drains.

Every `--rebalance-s` (jittered between half and one and a half of it, so peers do not look at once) the peer reads
the model's records and asks `move_target`. A move chosen at two looks in a row (one more per peer that would make
the same move and comes first: `queue_position`) is made: the new span's files the store lacks are fetched from the
peers (a peer started with `--model` holds only its span's; each file checked against the manifest), the span is
loaded beside the old one, announcing the tokens/s per layer measured at start; if a last look still asks for it
(another peer that saw the same hole may have moved meanwhile), it is served (new sessions go to it) and the
records say so at once; the old span drains as a stopped peer does (its open sessions get `--drain-s` to finish,
then end with "draining", which heads take as a reason to go elsewhere, not as blame).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import trio

from dsd.discovery.announce import Announcer
from dsd.discovery.rebalance import Confirm, Move, move_target, queue_position
from dsd.discovery.survey import live_records
from dsd.node.fetch.fetch import Fetcher
from dsd.node.fetch.local import manifest_sha256
from dsd.node.fetch.plan import span_files
from dsd.node.fetch.shard_server import announce_manifest
from dsd.node.server.block import BlockServer

from .host import Peer
from .loading import Prepared

log = logging.getLogger(__name__)

SURVEY_TIMEOUT_S = 30.0  # a check whose records take longer is skipped


class Rebalancer:
    """Looks at the swarm every `interval_s` (jittered) and moves this peer's span when looks in a row say so."""

    def __init__(self, prepared: Prepared, peer: Peer, announcer: Announcer, interval_s: float, shutdown_s: float,
                 info: dict[str, Any]) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.prepared, self.peer, self.announcer, self.interval_s = prepared, peer, announcer, interval_s
        self.shutdown_s = shutdown_s
        self.info = info
        self.moves: list[dict[str, Any]] = []  # every move made: when, from, to, and the coverage before and after
        self._confirm = Confirm()

    @property
    def server(self) -> BlockServer:
        server = self.peer.dispatcher.server
        assert server is not None
        return server

    def holds(self, span: tuple[int, int]) -> bool:
        """Whether the peer's store holds the files of `span` (a fetched store holds only the span it fetched)."""
        store = self.prepared.store
        return all((store.path / name).exists() for name in span_files(store.manifest, *span))

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check and move until cancelled (or the server closes); `task_status` once started. Old spans drain in
        the loop's own nursery."""
        async with trio.open_nursery() as draining:
            task_status.started()
            while not self.server.closing:
                await trio.sleep(self.interval_s * random.uniform(0.5, 1.5))
                move, ahead = await self.look()
                if self._confirm.seen(move, needed=2 + ahead):
                    assert move is not None
                    await self.move(move, draining)

    async def look(self) -> tuple[Move | None, int]:
        """One look at the swarm: the move it asks for (None: none, or a survey that failed) and how many peers that
        would make the same move come first (`queue_position`)."""
        server, store = self.server, self.prepared.store
        num_layers = int(store.manifest.num_layers)
        try:
            with trio.fail_after(SURVEY_TIMEOUT_S):
                records = await live_records(self.peer.node, server.model_id, num_layers)
        except Exception as exc:  # the DHT failed or timed out: look again at the next check
            log.info("rebalance check skipped: reading the records failed (%r)", exc)
            return None
        me = self.peer.node.peer_id
        move = move_target(records, me, (server.start, server.end), server.throughput, num_layers)
        if move is None:
            return None, 0
        if not self.holds(move.to) and self.prepared.fetch is None:
            log.info("rebalance: %s would help, but this peer's store lacks those layers' files (a peer started "
                     "with --model fetches them)", move.describe())
            return None, 0
        ahead = queue_position(records, me, move, num_layers)
        log.info("rebalance: %s (made once %d looks in a row agree: %d peers would make it first)", move.describe(),
                 2 + ahead, ahead)
        return move, ahead

    async def fetch_span(self, span: tuple[int, int]) -> None:
        """Fetch the files of `span` this peer's store lacks from the peers that serve the model, each checked
        against the manifest's sha256 (the fetch that `start --model` ran, into the same store)."""
        assert self.prepared.fetch is not None
        store = self.prepared.store
        missing = [name for name in span_files(store.manifest, *span) if not (store.path / name).exists()]
        fetcher = Fetcher(self.peer.node, self.prepared.fetch)
        report = await fetcher.fetch(missing)
        log.info("fetched %d files of blocks %d:%d (%.1f MB) in %.1f s", len(report["fetched_files"]), *span,
                 report["bytes_needed"] / 1e6, report["seconds"])

    async def move(self, move: Move, draining: trio.Nursery) -> None:
        """Load and serve `move.to`, announce it, and drain the old span in `draining`."""
        cfg, store, placement = self.prepared.cfg, self.prepared.store, self.prepared.placement
        old = self.server
        log.warning("moving: %s", move.describe())
        t0 = time.perf_counter()
        start, end = move.to
        if not self.holds(move.to):
            try:
                await self.fetch_span(move.to)
            except Exception as exc:  # no peer served them, a lie, a timeout: stay where it is
                log.warning("not moving: fetching blocks %d:%d failed: %s", start, end, exc)
                return
        new = await trio.to_thread.run_sync(
            lambda: BlockServer(self.peer.node, store, start, end, limits=cfg.limits, wire=cfg.wire,
                                device=placement.device, dtype=placement.dtype, fault=cfg.fault,
                                batching=cfg.batching, weights=placement.weights, metrics=old.metrics))
        # Same hardware, other layers: the tokens/s per layer it measured at start stay (a measurement now would
        # say as much about what else runs on the machine as about the span).
        new.throughput = throughput = old.throughput * (old.end - old.start) / (end - start)
        if old.closing:  # the peer was stopped meanwhile: it leaves from where it was
            log.warning("not moving: this peer is stopping")
            return
        again, _ = await self.look()  # another peer may have moved while this one loaded (both saw the same hole)
        if again is None or again.to != move.to:
            log.warning("not moving: the swarm changed while blocks %d:%d loaded (%s)", start, end,
                        "nothing to do now" if again is None else f"now {again.describe()}")
            return
        self.peer.dispatcher.server = new  # new sessions from here on
        self.announcer.record_fn = announce_manifest(new.records, manifest_sha256(store.path))
        await self.announcer.publish_now()
        seconds = time.perf_counter() - t0
        self.info.update(start=start, end=end, throughput=throughput)
        self.moves.append({"at": time.time(), "from": list(move.span), "to": list(move.to), "seconds": round(seconds, 3),
                           "before": move.before.describe(), "after": move.after.describe()})
        log.warning("moved to blocks %d:%d in %.1f s (%.3g tokens/s); draining %d:%d (%d sessions open)", start, end,
                    seconds, throughput, old.start, old.end, len(old.sessions))
        draining.start_soon(old.drain, cfg.drain_s, trio.Event(), self.shutdown_s)
