"""The `dsd-node start` daemon: a libp2p host that serves a span of layers and announces it.

Every role is this one process with different options: a bootstrap node (DHT
only), a block peer (DHT + `/dsd/infer/1`), and — from the head's side — the
sink of return legs. The daemon owns one nursery; SIGINT/SIGTERM drain the peer (records withdrawn, new sessions
refused, open ones given `--drain-s` to finish) and then cancel it; a second signal ends the sessions at once.
What a serving peer loads lives in `loading` (imported only by a peer that serves).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import trio

from dsd.discovery.announce import Announcer
from dsd.discovery.identity import load_or_create_identity
from dsd.discovery.nat import NatOptions
from dsd.discovery.relays import keep_relays, relay_announcer, watch_reachability
from dsd.shard_store.errors import StoreError
from dsd.shard_store.files import atomic_write_bytes

from .config import DaemonConfig
from .host import Peer, open_peer
from .metrics_http import serve_metrics

if TYPE_CHECKING:
    from dsd.node.server.block import BlockServer

    from .loading import Prepared

log = logging.getLogger(__name__)

SHUTDOWN_DEADLINE_S = 10.0


async def run_daemon(cfg: DaemonConfig, *, task_status: trio.TaskStatus[dict] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGINT/SIGTERM (or cancellation); on a signal withdraw the records, then end sessions."""
    # A bootstrap node computes nothing (and loads no torch); a serving one fails here, before fetching or
    # loading anything, when its device is not there (StoreError), or when its span does not fit (ValueError).
    prepared: Prepared | None = None
    if cfg.store or cfg.fetch:
        from .loading import prepare

        prepared = await prepare(cfg)
        cfg = prepared.cfg
    key_pair = load_or_create_identity(cfg.identity)
    failure: Exception | None = None
    relay = cfg.relay if cfg.relay is not None else not (cfg.store or cfg.fetch)
    async with open_peer(
        key_pair, cfg.bootstrap, cfg.link, listen=cfg.listen, seed=cfg.seed, allow_peers=cfg.allow_peers,
        nat=NatOptions(cfg.reachability, relay, port_mapping=cfg.port_mapping),
    ) as peer, trio.open_nursery() as nursery:
        try:
            info, server, announcer = await _start_serving(cfg, peer, nursery, prepared)
        except (OSError, ValueError, StoreError) as exc:  # raised below, outside the peer's nurseries (not as a group)
            failure = exc
            nursery.cancel_scope.cancel()
        if failure is None:
            if cfg.status_s > 0:
                nursery.start_soon(_report_status, cfg, peer, announcer, info)
            await _serve_until_signal(cfg, peer, info, server, announcer, task_status)
            nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def _start_serving(
    cfg: DaemonConfig, peer: Peer, nursery: trio.Nursery, prepared: Prepared | None
) -> tuple[dict, BlockServer | None, Announcer | None]:
    """Load what this peer serves, start announcing it and the metrics endpoint in `nursery`: the ready info,
    the block server and the announcer (None for what this peer does not run). A span that does not fit
    (ValueError), a store that cannot load (StoreError) or a metrics port that cannot be bound (OSError) fail."""
    node = peer.node
    auto = node.nat is not None and node.nat.options.reachability == "auto"
    if node.reachability == "private" or auto:  # behind a NAT: relay slots first, so the first record is reachable
        await nursery.start(keep_relays, node)
    if node.nat is not None and node.nat.options.relay:
        await nursery.start(relay_announcer(node, cfg.record_ttl_s).run)
    info: dict = {"peer_id": node.peer_id, "addrs": list(node.addrs), "pid": os.getpid(),
                  "reachability": node.reachability, "relay": bool(node.nat and node.nat.options.relay)}
    portmap = node.nat.portmap if node.nat is not None else None
    if portmap is not None and (node.nat.mapped or portmap.failure):
        info["port_mapping"] = node.nat.mapped or f"none: {portmap.failure}"
    server: BlockServer | None = None
    announcer: Announcer | None = None
    if prepared is not None:
        from .loading import load

        server, announcer = await load(prepared, peer, info)
    if cfg.metrics_port is not None:  # before announcing: a port in use ends the start before anyone is told
        try:
            info["metrics_url"] = await nursery.start(serve_metrics, peer.dispatcher.metrics, cfg.metrics_host,
                                                      cfg.metrics_port)
        except OSError as exc:
            raise OSError(f"--metrics-port {cfg.metrics_port}: {exc}") from None
    if announcer is not None:
        await nursery.start(announcer.run)
    if auto and cfg.reachability_check_s > 0:
        nursery.start_soon(watch_reachability, node, cfg.reachability_check_s,
                           announcer.publish_now if announcer is not None else None)
    if server is not None and announcer is not None and prepared is not None and cfg.rebalance_s > 0:
        from .rebalance import Rebalancer

        await nursery.start(Rebalancer(prepared, peer, announcer, cfg.rebalance_s, SHUTDOWN_DEADLINE_S / 2, info).run)
    return info, server, announcer


async def _serve_until_signal(
    cfg: DaemonConfig, peer: Peer, info: dict, server: BlockServer | None, announcer: Announcer | None,
    task_status: trio.TaskStatus[dict],
) -> None:
    """Say we are ready, wait for SIGINT/SIGTERM, then withdraw the records and drain the sessions together."""
    node = peer.node
    print(f"dsd-node {node.peer_id} listening on {' '.join(node.addrs)}", flush=True)
    if cfg.ready_file:
        atomic_write_bytes(cfg.ready_file, json.dumps(info, indent=2).encode())
    task_status.started(info)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.warning("received %s: shutting down", signal.Signals(signum).name)
            break
        # Withdraw the records and drain at once: a withdrawal can wait on a publication in flight, and new
        # sessions meanwhile are refused with "draining", which heads take as a reason to go elsewhere, not as blame.
        now = trio.Event()
        async with trio.open_nursery() as stopping:
            stopping.start_soon(_second_signal, signals, now)
            async with trio.open_nursery() as leaving:
                if announcer is not None:
                    leaving.start_soon(_withdraw, announcer)
                if server is not None:  # the span served now (a peer that moved serves another than at start)
                    current = peer.dispatcher.server or server
                    leaving.start_soon(current.drain, cfg.drain_s, now, SHUTDOWN_DEADLINE_S / 2)
            stopping.cancel_scope.cancel()
    log.warning("shut down cleanly")


async def _report_status(cfg: DaemonConfig, peer: Peer, announcer: Announcer | None, info: dict) -> None:
    """Tell the volunteer in plain lines what this peer serves and why, how it is reached and that it is announced;
    then one status line every `cfg.status_s`, also kept in the ready file (`dsd-node status`)."""
    from .status import peer_status, status_line, why_serving, write_status

    if "start" in info:
        print(why_serving(info, cfg.blocks), flush=True)
    reach = {"public": "reachable directly (AutoNAT: peers dialled it back)",
             "private": "behind a NAT: reached through relays, hole punches tried per link"}
    nat = peer.node.nat
    if nat is not None and nat.mapped:
        print(f"behind a NAT whose gateway maps it a port (UPnP): reachable directly at {nat.mapped} (AutoNAT: "
              "peers dialled it back there)", flush=True)
    else:
        print(reach.get(peer.node.reachability, f"reachability: {peer.node.reachability}"), flush=True)
        if nat is not None and nat.portmap is not None and nat.portmap.failure:
            print(f"no port mapping: {nat.portmap.failure}", flush=True)
    if announcer is not None:
        print(f"announced: records stored on {announcer.last_stored_at} DHT nodes, refreshed every "
              f"{announcer.refresh_s:.0f} s", flush=True)
    while True:
        await trio.sleep(cfg.status_s)
        st = peer_status(peer, announcer, info.get("role", "block"))
        print(status_line(st), flush=True)
        if cfg.ready_file:
            write_status(cfg.ready_file, info, st)


async def _second_signal(signals: AsyncIterator[int], now: trio.Event) -> None:
    """A second SIGINT/SIGTERM while draining: end the open sessions now."""
    async for signum in signals:
        log.warning("received %s again: ending the open sessions now", signal.Signals(signum).name)
        now.set()
        return


async def _withdraw(announcer: Announcer) -> None:
    """Withdraw the peer's records, giving up after half the shutdown deadline (their TTL ends them anyway)."""
    with trio.move_on_after(SHUTDOWN_DEADLINE_S / 2):
        await announcer.stop()
