"""`dsd-node testnet up|down|status`: a local swarm of real daemons on loopback."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dsd.node.server.faults import MODES

from .options import (
    add_codec_options,
    add_device_options,
    add_wan_options,
    add_weights_option,
    cpu_list,
    fail,
    link_profile,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testnet", help="run a local multi-peer swarm on loopback")
    tsub = p.add_subparsers(dest="testnet_command", metavar="ACTION")
    tsub.required = True

    up = tsub.add_parser("up", help="start a bootstrap node and N block peers; return once a full route is visible")
    up.add_argument("--store", type=Path, default=None, help="model store the peers serve (default: the default target "
                    "as `dsd-node models prepare` made it, q4k, or the format --weights names; federated: "
                    "--worker-stores instead)")
    up.add_argument("--peers", type=int, default=4, help="number of block peers (default 4)")
    up.add_argument("--replicas", type=int, default=1, help="peers per span: the layers are split into PEERS/REPLICAS spans")
    up.add_argument("--state", type=Path, required=True, metavar="DIR", help="where testnet.json, keys and logs go")
    up.add_argument("--threads", type=int, default=1, help="torch threads per peer (default 1)")
    add_codec_options(up, "the peers'")
    up.add_argument("--batching", choices=("on", "off"), default="on", help="the block peers' start --batching: windows of different sessions in one step (default on)")
    up.add_argument("--record-ttl", type=float, default=30.0, metavar="S")
    up.add_argument("--timeout", type=float, default=180.0, metavar="S", help="give up if no full route after S seconds")
    up.add_argument("--json", action="store_true", help="print the state as JSON")
    up.add_argument("--spawn", choices=("fork", "exec"), default="fork",
                    help="how the daemons after the bootstrap start: fork = copies of this process, which imports torch, "
                         "transformers and libp2p once for all of them (default); exec = a new interpreter each")
    up.add_argument("--faulty", action="append", default=[], metavar="INDEX:MODE", help=f"block peer INDEX (0-based) lies on purpose, for tests and demos only (repeatable); MODE: {', '.join(MODES)}")
    up.add_argument("--metrics", action="store_true", help="every daemon serves its Prometheus metrics on a free 127.0.0.1 port (start --metrics-port 0); the URLs are in the state")
    fed = up.add_argument_group("federated mode: whole-model workers instead of block peers")
    fed.add_argument("--federated", action="store_true", help="start one federated worker per store (--store, --store2 or --worker-stores)")
    fed.add_argument("--store2", type=Path, default=None, help="a second worker's store (same vocabulary)")
    fed.add_argument("--worker-stores", default=None, metavar="A,B,...", help="the workers' stores, one worker each")
    fed.add_argument("--topk-cap", type=int, default=None, metavar="K", help="every worker's K cap")
    fed.add_argument("--topk-codec", choices=("fp16", "bf16", "fp32"), default="fp16")
    add_device_options(up)
    add_weights_option(up, "the block peers'")
    wan = add_wan_options(up, sender="the testnet's daemons")
    wan.add_argument("--peer-profile", action="append", default=[], metavar="INDEX:NAME", help="block peer (or federated worker) INDEX, 0-based, sends on the named link profile instead (repeatable: a heterogeneous swarm); it gets that profile's own numbers, not the --wan-* overrides (paper: the swarm's latency)")
    up.add_argument("--peer-cpus", type=cpu_list, default=None, metavar="LIST", help="pin the bootstrap and every peer to these CPUs (e.g. 1 or 1-3 or 1,2); with generate/serve --cpus on the others, the head drafts on cores of its own (default: anywhere)")
    up.set_defaults(func=cmd_up)

    down = tsub.add_parser("down", help="stop every process of the testnet")
    down.add_argument("--state", type=Path, required=True, metavar="DIR")
    down.set_defaults(func=cmd_down)

    status = tsub.add_parser("status", help="show which testnet processes run")
    status.add_argument("--state", type=Path, required=True, metavar="DIR")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)


def spec_of(args: argparse.Namespace):
    """The `testnet up` options as a swarm spec."""
    from dsd.node.testnet.swarm import SwarmSpec

    if args.worker_stores:
        workers = [Path(x.strip()) for x in args.worker_stores.split(",") if x.strip()]
    else:
        workers = [s for s in (args.store, args.store2) if s is not None]
    return SwarmSpec(
        state=args.state, store=args.store, peers=args.peers, replicas=args.replicas, threads=args.threads,
        codec=args.codec, zstd=args.zstd, batching=args.batching, record_ttl_s=args.record_ttl, timeout_s=args.timeout, link=link_profile(args),
        federated=args.federated, worker_stores=workers, topk_cap=args.topk_cap, topk_codec=args.topk_codec,
        device=args.device, dtype=args.dtype, weights=args.weights, metrics=args.metrics,
        fork_program=args.program if args.spawn == "fork" else None, faults=args.faulty,
        link_name=args.link_profile, peer_profiles=args.peer_profile, peer_cpus=args.peer_cpus,
    )


def default_target(weights: str) -> Path:
    """The store `testnet up` serves without --store: the default target in `weights` (auto: q4k, what `models
    prepare` makes); StoreError naming the command to run when it is not prepared."""
    from dsd.shard_store.default_models import DEFAULT_WEIGHTS, require_prepared

    return require_prepared(None, DEFAULT_WEIGHTS if weights == "auto" else weights, roles=("target",))["target"]


def cmd_up(args: argparse.Namespace) -> int:
    from dsd.node.testnet.swarm import SwarmError, bring_up, state_report
    from dsd.shard_store import Manifest, StoreError

    if args.store is None and not args.federated:
        try:
            args.store = default_target(args.weights)
        except StoreError as exc:
            return fail(f"testnet up without --store serves the default target: {exc}, or give --store")
        if args.weights == "auto":  # the peers serve the default store's own format, named on their command line
            args.weights = Manifest.read(args.store).weights or "auto"
    try:
        state = bring_up(spec_of(args))
    except SwarmError as exc:
        return fail(str(exc))
    except (TimeoutError, RuntimeError) as exc:
        return fail(f"testnet did not come up: {exc}", 1)
    if args.json:
        print(json.dumps(state_report(state), indent=2))
    else:
        print(f"testnet up in {state.up_seconds:.1f} s: bootstrap {state.bootstrap}; {_swarm_line(state)}")
        for p in state.peers[1:]:
            what = "federated worker" if p.role == "federated" else "blocks"
            print(f"  {p.name}  {what} {p.start}:{p.end}  pid {p.pid}  {p.multiaddr}{_peer_extras(state, vars(p))}")
        print(f"state in {args.state}; stop with: dsd-node testnet down --state {args.state}")
    return 0


def _swarm_line(state) -> str:
    """The swarm's common link and the CPUs its daemons are pinned to, for `up` and `status`."""
    from dsd.node.peer.cpus import format_cpus
    from dsd.node.testnet.link_profiles import describe

    cpus = f"  peer cpus {format_cpus(state.peer_cpus)}" if state.peer_cpus else ""
    return f"link {describe(state.wan)}{cpus}"


def _peer_extras(state, p: dict) -> str:
    """What sets one daemon apart: its CPUs when pinned, its link when not the swarm's, its fault."""
    from dsd.node.peer.cpus import format_cpus
    from dsd.node.testnet.link_profiles import describe

    cpus = f"  cpus {format_cpus(p['cpus'])}" if state.peer_cpus and p.get("cpus") else ""
    link = f"  link {describe(p['link'])}" if p.get("link") and p["link"] != state.wan else ""
    lies = f"  faulty {p['fault']}" if p.get("fault") else ""
    return f"{cpus}{link}{lies}"


def _load(state_dir: Path):
    """The testnet recorded in `state_dir`, or None after printing why there is none."""
    from dsd.node.testnet.processes import TestnetState

    try:
        return TestnetState.load(state_dir)
    except FileNotFoundError as exc:
        fail(str(exc), 1)
        return None


def cmd_down(args: argparse.Namespace) -> int:
    from dsd.node.testnet.processes import stop_processes

    state = _load(args.state)
    if state is None:
        return 1
    outcome = stop_processes(list(reversed(state.peers)))
    for p in state.peers:
        print(f"{p.name:10s} pid {p.pid}: {outcome.get(p.pid, 'unknown')}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dsd.node.testnet.swarm import state_report

    state = _load(args.state)
    if state is None:
        return 1
    d = state_report(state)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"bootstrap {state.bootstrap}  model {state.model}  {_swarm_line(state)}")
        for p in d["peers"]:
            span = "" if p["start"] is None else f"blocks {p['start']}:{p['end']}"
            print(f"  {p['name']:10s} {'up  ' if p['alive'] else 'DOWN'} pid {p['pid']:<8d} {span:14s} {p['peer_id']}"
                  f"{_peer_extras(state, p)}")
    return 0 if all(p["alive"] for p in d["peers"]) else 1
