"""`dsd-node testnet up|down|status`: a local swarm of real daemons on loopback."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import trio

from .cmd_daemon import add_wan_options
from .testnet import (
    PeerProcess,
    TestnetState,
    even_spans,
    pid_alive,
    spawn,
    stop_processes,
    wait_ready,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testnet", help="run a local multi-peer swarm on loopback")
    tsub = p.add_subparsers(dest="testnet_command", metavar="ACTION")
    tsub.required = True

    up = tsub.add_parser("up", help="start a bootstrap node and N block peers; return once a full route is visible")
    up.add_argument("--store", type=Path, default=None, help="model store the peers serve (required unless --worker-stores)")
    up.add_argument("--peers", type=int, default=4, help="number of block peers (default 4)")
    up.add_argument("--replicas", type=int, default=1, help="peers per span: the layers are split into PEERS/REPLICAS spans")
    up.add_argument("--state", type=Path, required=True, metavar="DIR", help="where testnet.json, keys and logs go")
    up.add_argument("--threads", type=int, default=1, help="torch threads per peer (default 1)")
    up.add_argument("--codec", choices=("raw", "fp16", "bf16", "int8"), default="raw")
    up.add_argument("--record-ttl", type=float, default=30.0, metavar="S")
    up.add_argument("--timeout", type=float, default=180.0, metavar="S", help="give up if no full route after S seconds")
    up.add_argument("--json", action="store_true", help="print the state as JSON")
    fed = up.add_argument_group("federated mode: whole-model workers instead of block peers")
    fed.add_argument("--federated", action="store_true", help="start one federated worker per store (--store, --store2 or --worker-stores)")
    fed.add_argument("--store2", type=Path, default=None, help="a second worker's store (same vocabulary)")
    fed.add_argument("--worker-stores", default=None, metavar="A,B,...", help="the workers' stores, one worker each")
    fed.add_argument("--topk-cap", type=int, default=None, metavar="K", help="every worker's K cap")
    fed.add_argument("--topk-codec", choices=("fp16", "bf16", "fp32"), default="fp16")
    add_wan_options(up)
    up.set_defaults(func=cmd_up)

    down = tsub.add_parser("down", help="stop every process of the testnet")
    down.add_argument("--state", type=Path, required=True, metavar="DIR")
    down.set_defaults(func=cmd_down)

    status = tsub.add_parser("status", help="show which testnet processes run")
    status.add_argument("--state", type=Path, required=True, metavar="DIR")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)


def wan_args(args: argparse.Namespace) -> list[str]:
    out = ["--wan-latency-ms", str(args.wan_latency_ms), "--wan-jitter-ms", str(args.wan_jitter_ms)]
    if args.wan_mbit:
        out += ["--wan-mbit", str(args.wan_mbit)]
    return out


def prepare_state_dir(state_dir: Path) -> Path:
    """Create the state directory (refusing one whose testnet still runs); returns its empty ready/ folder."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        old = TestnetState.load(state_dir)
        if any(pid_alive(p.pid) for p in old.peers):
            raise SystemExit(f"dsd-node: a testnet already runs from {state_dir}; `dsd-node testnet down --state {state_dir}` first")
    except FileNotFoundError:
        pass
    ready_dir = state_dir / "ready"
    ready_dir.mkdir(exist_ok=True)
    for f in ready_dir.glob("*.json"):
        f.unlink()
    return ready_dir


def start_bootstrap(args: argparse.Namespace, state_dir: Path, ready_dir: Path, started: list[PeerProcess]) -> PeerProcess:
    """Start the bootstrap node (recorded in `started` at once, so a failure still stops it) and wait for it."""
    boot = spawn("bootstrap", ["start", "--bootstrap-only", "--identity", str(state_dir / "keys" / "bootstrap.key"),
                               "--ready-file", str(ready_dir / "bootstrap.json"), *wan_args(args)], state_dir)
    started.append(boot)
    info = wait_ready(ready_dir / "bootstrap.json", boot, args.timeout)
    boot.peer_id, boot.multiaddr, boot.role = info["peer_id"], info["addrs"][0], "bootstrap"
    return boot


def wan_settings(args: argparse.Namespace) -> dict:
    return {"latency_ms": args.wan_latency_ms, "jitter_ms": args.wan_jitter_ms, "mbit": args.wan_mbit}


def await_peers(args: argparse.Namespace, ready_dir: Path, started: list[PeerProcess], t0: float) -> None:
    """Wait for every daemon after the bootstrap to write its ready file; record its id, address and span."""
    for proc in started[1:]:
        info = wait_ready(ready_dir / f"{proc.name}.json", proc, max(1.0, args.timeout - (time.monotonic() - t0)))
        proc.peer_id, proc.multiaddr = info["peer_id"], info["addrs"][0]
        proc.start, proc.end = info.get("start", proc.start), info.get("end", proc.end)


def record_up(state: TestnetState, state_dir: Path, t0: float, wait: Callable[[float], None], timeout: float) -> TestnetState:
    """Save the state (so `down` works even if waiting fails), wait until the swarm is usable, save again."""
    state.save(state_dir)
    wait(max(1.0, timeout - (time.monotonic() - t0)))
    state.up_seconds = round(time.monotonic() - t0, 3)
    state.save(state_dir)
    return state


def bring_up(args: argparse.Namespace) -> TestnetState:
    """Start the processes, wait for a full route, and return the state (stopping everything on failure)."""
    from dsd.shard_store import Store

    state_dir: Path = args.state
    if getattr(args, "federated", False):
        return bring_up_federated(args)
    if args.store is None:
        raise SystemExit("dsd-node: testnet up needs --store")
    ready_dir = prepare_state_dir(state_dir)
    if args.peers < 1 or args.replicas < 1 or args.peers % args.replicas:
        raise SystemExit("dsd-node: --peers must be a positive multiple of --replicas")
    manifest = Store(args.store).manifest
    num_layers = int(manifest.num_layers)
    spans = even_spans(num_layers, args.peers // args.replicas)
    t0 = time.monotonic()
    started: list[PeerProcess] = []
    try:
        boot = start_bootstrap(args, state_dir, ready_dir, started)
        for i in range(args.peers):
            start, end = spans[i // args.replicas]
            name = f"peer{i}"
            proc = spawn(name, [
                "start", "--store", str(args.store), "--blocks", f"{start}:{end}",
                "--bootstrap", boot.multiaddr, "--identity", str(state_dir / "keys" / f"{name}.key"),
                "--ready-file", str(ready_dir / f"{name}.json"), "--threads", str(args.threads),
                "--codec", args.codec, "--record-ttl", str(args.record_ttl), *wan_args(args),
            ], state_dir)
            proc.start, proc.end = start, end
            started.append(proc)
        await_peers(args, ready_dir, started, t0)
        state = TestnetState(
            bootstrap=boot.multiaddr, model=manifest.model_id, store=str(args.store), num_layers=num_layers,
            peers=started, wan=wan_settings(args),
        )
        return record_up(state, state_dir, t0, lambda left: trio.run(_wait_route, state, left), args.timeout)
    except BaseException:
        stop_processes([p.pid for p in reversed(started)])
        raise


def worker_stores(args: argparse.Namespace) -> list[Path]:
    """The stores of `testnet up --federated`, one worker each."""
    if args.worker_stores:
        return [Path(x.strip()) for x in args.worker_stores.split(",") if x.strip()]
    if args.store is None:
        raise SystemExit("dsd-node: testnet up --federated needs --store (and optionally --store2) or --worker-stores")
    return [args.store] + ([args.store2] if args.store2 else [])


def bring_up_federated(args: argparse.Namespace) -> TestnetState:
    """Start a bootstrap node and one federated worker per store; return once every worker is announced."""
    from dsd.shard_store import Store

    from .federated import pool_key

    state_dir: Path = args.state
    ready_dir = prepare_state_dir(state_dir)
    stores = worker_stores(args)
    vocabs = {str(s): int(Store(s).manifest.vocab_size) for s in stores}
    if len(set(vocabs.values())) != 1:
        raise SystemExit(f"dsd-node: federated workers must share the vocabulary, got {vocabs}")
    vocab = next(iter(vocabs.values()))
    t0 = time.monotonic()
    started: list[PeerProcess] = []
    try:
        boot = start_bootstrap(args, state_dir, ready_dir, started)
        for i, store in enumerate(stores):
            name = f"worker{i}"
            extra = ["--topk-cap", str(args.topk_cap)] if args.topk_cap else []
            proc = spawn(name, [
                "start", "--federated", "--store", str(store), "--bootstrap", boot.multiaddr,
                "--identity", str(state_dir / "keys" / f"{name}.key"), "--ready-file", str(ready_dir / f"{name}.json"),
                "--threads", str(args.threads), "--record-ttl", str(args.record_ttl), "--topk-codec", args.topk_codec,
                *extra, *wan_args(args),
            ], state_dir)
            proc.role = "federated"
            started.append(proc)
        await_peers(args, ready_dir, started, t0)
        state = TestnetState(
            bootstrap=boot.multiaddr, model=pool_key(vocab), store=",".join(str(s) for s in stores), num_layers=None,
            peers=started, wan=wan_settings(args),
        )
        return record_up(state, state_dir, t0, lambda left: trio.run(_wait_workers, state, vocab, left), args.timeout)
    except BaseException:
        stop_processes([p.pid for p in reversed(started)])
        raise


async def _wait_workers(state: TestnetState, vocab: int, timeout_s: float) -> None:
    from .federated import find_workers
    from .headnode import head_node

    want = {p.peer_id for p in state.peers if p.role == "federated"}
    async with head_node([state.bootstrap]) as (node, _legs):
        with trio.move_on_after(timeout_s):
            while True:
                if want <= {w.peer_id for w in await find_workers(node, vocab)}:
                    return
                await trio.sleep(0.5)
    raise TimeoutError(f"federated workers not all announced after {timeout_s:.0f} s")


async def _wait_route(state: TestnetState, timeout_s: float) -> None:
    from .headnode import head_node
    from .routing import wait_for_route

    async with head_node([state.bootstrap]) as (node, _legs):
        await wait_for_route(node, state.model or "", state.num_layers or 0, timeout_s)


def cmd_up(args: argparse.Namespace) -> int:
    try:
        state = bring_up(args)
    except (TimeoutError, RuntimeError) as exc:
        print(f"dsd-node: testnet did not come up: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(_state_dict(state), indent=2))
    else:
        print(f"testnet up in {state.up_seconds:.1f} s: bootstrap {state.bootstrap}")
        for p in state.peers[1:]:
            what = "federated worker" if p.role == "federated" else "blocks"
            print(f"  {p.name}  {what} {p.start}:{p.end}  pid {p.pid}  {p.multiaddr}")
        print(f"state in {args.state}; stop with: dsd-node testnet down --state {args.state}")
    return 0


def _state_dict(state: TestnetState) -> dict:
    from dataclasses import asdict

    d = asdict(state)
    for p in d["peers"]:
        p["alive"] = pid_alive(p["pid"])
    return d


def cmd_down(args: argparse.Namespace) -> int:
    try:
        state = TestnetState.load(args.state)
    except FileNotFoundError as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 1
    outcome = stop_processes([p.pid for p in reversed(state.peers)])
    for p in state.peers:
        print(f"{p.name:10s} pid {p.pid}: {outcome.get(p.pid, 'unknown')}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    try:
        state = TestnetState.load(args.state)
    except FileNotFoundError as exc:
        print(f"dsd-node: {exc}", file=sys.stderr)
        return 1
    d = _state_dict(state)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        print(f"bootstrap {state.bootstrap}  model {state.model}  wan {state.wan}")
        for p in d["peers"]:
            span = "" if p["start"] is None else f"blocks {p['start']}:{p['end']}"
            print(f"  {p['name']:10s} {'up  ' if p['alive'] else 'DOWN'} pid {p['pid']:<8d} {span:14s} {p['peer_id']}")
    return 0 if all(p["alive"] for p in d["peers"]) else 1
