"""`dsd-node start` (run a peer) and `dsd-node route` (show the swarm and the route a head would take)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dsd.node.server.faults import Fault, parse_fault
from dsd.node.server.limits import (
    DEFAULT_MAX_BATCH_SESSIONS,
    DEFAULT_MAX_BATCH_TOKENS,
    BatchOptions,
    ServerLimits,
)

from .options import (
    DEFAULT_IDENTITY,
    DEFAULT_LISTEN,
    add_codec_options,
    add_device_options,
    add_listen_option,
    add_wan_options,
    add_weights_option,
    link_profile,
    listen_addrs,
    read_allow_list,
    wire_format,
)
from .store import add_fetch_options, fetch_request

log = logging.getLogger(__name__)

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("start", help="run a peer: serve a span of layers (or only the DHT) on the swarm")
    role = p.add_mutually_exclusive_group(required=True)
    role.add_argument("--store", type=Path, help="model store to serve layers from (see `dsd-node convert`)")
    role.add_argument("--bootstrap-only", action="store_true", help="serve only the DHT, as a bootstrap node")
    role.add_argument("--model", default=None, metavar="MODEL_ID", help="no local store: fetch this model's manifest and the files of the span to serve from peers (needs --manifest-sha256), then serve them")
    p.add_argument("--blocks", default="auto", help="layers to serve, START:END (half-open) or auto (least-covered span; default)")
    p.add_argument("--num-blocks", type=int, default=None, help="with --blocks auto: how many layers to serve (default: what --memory-gb allows, else all)")
    p.add_argument("--memory-gb", type=float, default=None, help="device memory this peer may fill with weights (in --dtype) + its --kv-budget of KV cache + activations: --blocks auto serves as many layers as fit, a span that does not fit is refused (default: on a GPU 90%% of its free memory, on the CPU unaccounted)")
    add_listen_option(p, "this peer's")
    p.add_argument("--bootstrap", action="append", default=[], metavar="MULTIADDR", help="a peer to join the swarm through (repeatable)")
    p.add_argument("--identity", type=Path, default=DEFAULT_IDENTITY, metavar="KEYFILE", help=f"private key file, created with mode 0600 (default {DEFAULT_IDENTITY})")
    p.add_argument("--allow-peers", type=Path, default=None, metavar="FILE", help="private swarm: accept streams only from these peer ids (one per line)")
    p.add_argument("--max-sessions", type=int, default=ServerLimits.max_sessions)
    p.add_argument("--kv-budget", type=int, default=ServerLimits.kv_budget_tokens, metavar="TOKENS", help="KV cache tokens reserved across sessions")
    p.add_argument("--max-len", type=int, default=ServerLimits.max_len, metavar="TOKENS", help="longest session this peer accepts")
    p.add_argument("--idle-timeout", type=float, default=ServerLimits.idle_timeout_s, metavar="S", help="free a session after S seconds without a message")
    p.add_argument("--batching", choices=("on", "off"), default="on", help="run windows of different sessions that wait while the span computes as one step (the weights are read once for all their rows); off: one window per step, as before (default on)")
    p.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS, metavar="ROWS", help=f"most rows (window tokens) one batched step holds; the oldest window always goes in the next step (default {DEFAULT_MAX_BATCH_TOKENS}, at most {DEFAULT_MAX_BATCH_SESSIONS} sessions a step)")
    add_codec_options(p, "this peer's")
    p.add_argument("--threads", type=int, default=None, help="torch threads for this peer's compute")
    p.add_argument("--throughput", type=float, default=None, metavar="TOKENS_PER_S", help="announce this throughput (decode tokens/s through the whole span) instead of measuring it at start: a figure measured when the machine was idle, or a weight that steers heads' routes (default: measured)")
    nat = p.add_argument_group("NAT traversal (docs/nat.md)")
    nat.add_argument("--reachability", choices=("auto", "public", "private"), default="auto", help="whether others can dial this peer where it listens: auto asks the bootstrap peers to dial back (AutoNAT); private = behind a NAT: reserve slots on relays and announce addresses through them (default auto)")
    nat.add_argument("--port-mapping", choices=("on", "off"), default="on", help="with --reachability auto, when the dial-backs find this peer behind a NAT: ask the home gateway to map a port to it (UPnP IGD), renew it while running, remove it on exit, and announce the mapped address once a dial-back gets through it (default on)")
    nat.add_argument("--reachability-check-s", type=float, default=300.0, metavar="S", help="with --reachability auto, ask the dial-backs again about every S seconds (and the gateway for its mapping): a network that changed (a router that now maps a port, a mapping it forgot) changes what this peer announces, at once (default 300; 0 = never)")
    nat.add_argument("--relay", action=argparse.BooleanOptionalAction, default=None, help="serve circuit relay v2 for peers behind NATs (default: on for --bootstrap-only, off otherwise)")
    p.add_argument("--record-ttl", type=float, default=30.0, metavar="S", help="lifetime of this peer's DHT records (refreshed at a third of it)")
    p.add_argument("--ready-file", type=Path, default=None, help="write peer id, addresses and span here (JSON) once serving")
    p.add_argument("--rebalance-s", type=float, default=60.0, metavar="S", help="a block peer looks at the swarm about every S seconds (jittered) and moves its span where the swarm is worse covered: to fill blocks no one serves, or to raise the least-served block's throughput by 25 %%, never leaving a block it alone serves, and only when two looks in a row agree (docs/failures.md); 0 = never move (default 60)")
    p.add_argument("--status-s", type=float, default=60.0, metavar="S", help="print a one-line status every S seconds (span, sessions, tokens served, load, reachability), also kept in --ready-file for `dsd-node status` (default 60; 0 = none)")
    p.add_argument("--drain-s", type=float, default=30.0, metavar="S", help="on SIGTERM or Ctrl-C: withdraw the records, refuse new sessions (heads go elsewhere, blaming no one) and let open ones finish for up to S seconds before ending them (their heads fail over at once); a second signal ends them now (default 30)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P", help="serve this peer's Prometheus metrics at http://HOST:P/metrics (sessions, forward step times by window size, bytes, KV tokens, errors by code); 0 = any free port, its URL goes to --ready-file (default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST", help="address --metrics-port listens on (default 127.0.0.1: this machine only)")
    p.add_argument("--faulty", default=None, metavar="MODE", help=argparse.SUPPRESS)  # lie on purpose: tests, demos
    fed = p.add_argument_group("federated worker (SpecFed)")
    fed.add_argument("--federated", action="store_true", help="load the whole model of --store and answer draft windows with top-K distributions")
    fed.add_argument("--topk-cap", type=int, default=None, metavar="K", help="largest K this worker returns (default: the vocabulary size)")
    fed.add_argument("--topk-codec", choices=("fp16", "bf16", "fp32"), default="fp16", help="probability codec of the top-K answers")
    add_device_options(p)
    add_weights_option(p, "the served layers'")
    add_wan_options(p)
    add_fetch_options(p, model_help=None)
    p.set_defaults(func=cmd_start)

    st = sub.add_parser("stop", help="stop a running peer gracefully: it drains (new sessions go elsewhere, open ones "
                                     "may finish within its --drain-s), then exits")
    st.add_argument("ready_file", type=Path, metavar="READY_FILE", help="the peer's --ready-file (it holds its pid)")
    st.add_argument("--now", action="store_true", help="end its open sessions at once (their heads fail over)")
    st.add_argument("--wait", type=float, default=60.0, metavar="S", help="how long to wait for it to exit (default 60)")
    st.set_defaults(func=cmd_stop)

    ss = sub.add_parser("status", help="what a running peer is doing: its span, sessions, tokens served, load, "
                                       "reachability (from its --ready-file, refreshed every --status-s)")
    ss.add_argument("ready_file", type=Path, metavar="READY_FILE", help="the peer's --ready-file")
    ss.add_argument("--json", action="store_true", help="print the status as JSON")
    ss.set_defaults(func=cmd_status)

    r = sub.add_parser("route", help="list the peers serving a model and the route a head would choose")
    r.add_argument("--bootstrap", action="append", required=True, metavar="MULTIADDR")
    r.add_argument("--model", required=True, help="model id as announced (see `dsd-node store inspect`)")
    r.add_argument("--num-layers", type=int, default=None, help="layers of the model (default: the largest span end announced)")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    add_listen_option(r, "the head's")
    add_wan_options(r)
    r.set_defaults(func=cmd_route)


def _running_peer(path: Path) -> tuple[dict, int] | int:
    """The ready info and pid of the running peer whose --ready-file `path` is; else, having said why on stderr, the
    exit code (2: no pid to read, 1: not running)."""
    from dsd.node.testnet.processes import pid_alive

    try:
        info = json.loads(path.read_text())
        pid = int(info["pid"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"dsd-node: cannot read a peer's pid from {path}: {exc}", file=sys.stderr)
        return 2
    if not pid_alive(pid):
        print(f"dsd-node: the peer of {path} (pid {pid}) is not running", file=sys.stderr)
        return 1
    return info, pid


def cmd_status(args: argparse.Namespace) -> int:
    """Print a running peer's last status line (or JSON); 1 when it is not running."""
    import time

    from dsd.node.peer.status import status_line

    got = _running_peer(args.ready_file)
    if isinstance(got, int):
        return got
    info, pid = got
    st = info.get("status")
    if args.json:
        print(json.dumps({"running": True, "pid": pid, **info}, indent=1))
        return 0
    if st is None:
        print(f"{info.get('peer_id', pid)} is running; no status yet (the first comes after its --status-s)")
        return 0
    print(f"{info['peer_id']} (pid {pid}), {time.time() - st['at_unix']:.0f} s ago: {status_line(st)}")
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Signal the peer of a ready file (SIGTERM: drain; twice with --now) and wait for it to exit."""
    import os
    import signal
    import time

    from dsd.node.testnet.processes import pid_alive

    got = _running_peer(args.ready_file)
    if isinstance(got, int):
        return got
    info, pid = got
    os.kill(pid, signal.SIGTERM)
    if args.now:
        time.sleep(0.3)  # a second signal sent before the first is read counts once
        os.kill(pid, signal.SIGTERM)
    print(f"stopping {info.get('peer_id', pid)}: " + ("ending its sessions now" if args.now else
          "draining (new sessions go elsewhere; open ones may finish within its --drain-s)"), flush=True)
    deadline = time.monotonic() + args.wait
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if pid_alive(pid):
        print(f"dsd-node: still running after {args.wait:g} s (run again with --now to end its sessions)",
              file=sys.stderr)
        return 1
    print("stopped", flush=True)
    return 0


def cmd_start(args: argparse.Namespace) -> int:
    import trio

    from dsd.node.fetch.request import FetchError
    from dsd.node.peer.config import DaemonConfig
    from dsd.node.peer.daemon import run_daemon
    from dsd.shard_store import StoreError

    try:
        fault = faulty_option(args)
        batching = BatchOptions(enabled=args.batching == "on", max_tokens=args.max_batch_tokens)
        if not min(args.drain_s, args.rebalance_s, args.status_s, args.reachability_check_s) >= 0:
            raise ValueError("--drain-s, --rebalance-s, --status-s and --reachability-check-s must be >= 0")
    except ValueError as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 2
    cfg = DaemonConfig(
        identity=args.identity,
        listen=listen_addrs(args) or [DEFAULT_LISTEN],
        bootstrap=args.bootstrap,
        store=None if args.bootstrap_only else args.store,
        fetch=fetch_request(args) if args.model else None,
        blocks=args.blocks,
        num_blocks=args.num_blocks,
        memory_gb=args.memory_gb,
        link=link_profile(args),
        limits=ServerLimits(
            max_sessions=args.max_sessions,
            kv_budget_tokens=args.kv_budget,
            max_len=args.max_len,
            idle_timeout_s=args.idle_timeout,
        ),
        wire=wire_format(args),
        device=args.device,
        dtype=args.dtype,
        weights=args.weights,
        threads=args.threads,
        throughput=args.throughput,
        ready_file=args.ready_file,
        allow_peers=read_allow_list(args.allow_peers),
        record_ttl_s=args.record_ttl,
        drain_s=args.drain_s,
        rebalance_s=args.rebalance_s,
        status_s=args.status_s,
        federated=args.federated,
        topk_cap=args.topk_cap,
        topk_codec=args.topk_codec,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        reachability=args.reachability,
        port_mapping=args.port_mapping == "on",
        reachability_check_s=args.reachability_check_s,
        relay=args.relay,
        fault=fault,
        batching=batching,
    )
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        print(f"dsd-node: --metrics-port must be in 0..65535, got {args.metrics_port}", file=sys.stderr)
        return 2
    if args.throughput is not None and not 0 < args.throughput < float("inf"):
        print(f"dsd-node: --throughput must be a positive number of tokens/s, got {args.throughput:g}", file=sys.stderr)
        return 2
    if args.federated and cfg.store is None and cfg.fetch is None:
        print("dsd-node: --federated needs --store or --model (the whole model the worker serves)", file=sys.stderr)
        return 2
    if args.topk_cap is not None and args.topk_cap < 1:
        print(f"dsd-node: --topk-cap must be >= 1, got {args.topk_cap}", file=sys.stderr)
        return 2
    if cfg.store is not None and not (Path(cfg.store) / "manifest.json").exists():
        print(f"dsd-node: {cfg.store} is not a model store (no manifest.json); see `dsd-node convert`", file=sys.stderr)
        return 2
    try:
        trio.run(run_daemon, cfg)
    except (ValueError, StoreError, FetchError, OSError) as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 2
    return 0


def faulty_option(args: argparse.Namespace) -> Fault | None:
    """The hidden `--faulty MODE` (a block peer that lies on purpose, for tests and demos): its Fault, or ValueError
    for a bad mode or a peer that serves no block span (a bootstrap node or a federated worker)."""
    if args.faulty is None:
        return None
    if args.bootstrap_only or args.federated:
        role = "--bootstrap-only" if args.bootstrap_only else "--federated"
        raise ValueError(f"--faulty makes a block peer lie; it cannot be used with {role}")
    return parse_fault(args.faulty)


def cmd_route(args: argparse.Namespace) -> int:
    import trio

    from dsd.discovery.announce import fetch_records
    from dsd.discovery.survey import survey
    from dsd.node.peer.host import head_node


    async def main() -> dict:
        async with head_node(args.bootstrap, link_profile(args), listen=listen_addrs(args)) as (node, _legs):
            num_layers = args.num_layers
            if num_layers is None:
                recs = await fetch_records(node, args.model, 0)
                num_layers = max((r.end for r in recs), default=0)
            if num_layers == 0:  # nobody announces the model: nothing to plan over
                return {"model": args.model, "num_layers": 0, "peers": [], "coverage": [], "route": None,
                        "missing_blocks": [], "error": f"no peer announces {args.model!r} (yet)"}
            view = await survey(node, args.model, num_layers)
            return view.report(args.model, num_layers)

    report = trio.run(main)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_route_report(report)
    return 0 if report["route"] else 1


def print_route_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"peers serving {report['model']} ({report['num_layers']} layers)")
    for col in ("peer", "blocks", "throughput", "RTT ms", "reachability", "link", "cache left", "busy", "version"):
        table.add_column(col)
    for p in report["peers"]:
        table.add_row(p["peer_id"][-12:], f"{p['start']}:{p['end']}", f"{p['throughput']:.1f}",
                      "-" if p["rtt_ms"] is None else f"{p['rtt_ms']:.1f}", p["reachability"], p["link"] or "-",
                      str(p["cache_tokens_left"]), f"{p['load']['busy']:.0%}", str(p["version"]))
    console.print(table)
    cover = report["coverage"]
    console.print("coverage: " + " ".join(str(c) if c else "[red]0[/red]" for c in cover))
    if report["route"]:
        hops = " → ".join(f"{h['peer_id'][-8:]}[{h['start']}:{h['end']}]" for h in report["route"]["hops"])
        console.print(f"route: head → {hops} → head   (est. round {report['route']['est_round_s'] * 1000:.1f} ms)")
    else:
        console.print(f"[red]no route:[/red] {report['error']}")
