"""Bringing up a local swarm: a bootstrap node plus block peers or federated workers, as real processes.

One bring-up path for both kinds: start the bootstrap, spawn the daemons, wait for
their ready files, save the state (so `down` works even if the wait fails), then wait
until a head can use the swarm (a complete route, or every worker announced).

This process reads manifests without torch and loads the network stack only to wait for the
swarm, so `testnet up` spends its time in the daemons, and `down` and `status` return at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from dsd.node.peer.cpus import affinity_of, check_cpus, children_pinned
from dsd.node.peer.shaper import LinkProfile
from dsd.node.server.faults import parse_fault
from dsd.shard_store.manifest import Manifest

from .link_profiles import link_record, parse_peer_profiles, peer_link
from .processes import (
    PeerProcess,
    TestnetState,
    even_spans,
    fork_daemon,
    pid_alive,
    preload_daemon_imports,
    spawn,
    stop_processes,
    wait_ready,
)


class SwarmError(RuntimeError):
    """The swarm cannot be brought up as asked (bad options, a testnet already running, mixed vocabularies)."""


@dataclass
class SwarmSpec:
    """What `testnet up` starts: block peers over one store, or one federated worker per store."""

    state: Path
    store: Path | None = None
    peers: int = 4
    replicas: int = 1
    threads: int = 1
    codec: str = "auto"
    zstd: bool = False  # every block peer zstd-compresses the hidden states it sends
    batching: str = "on"  # every block peer's `--batching` (windows of different sessions in one step)
    record_ttl_s: float = 30.0
    timeout_s: float = 180.0
    link: LinkProfile = field(default_factory=LinkProfile)  # what every daemon sends on, unless peer_profiles says
    link_name: str | None = None  # the named profile `link` was built from (recorded; None: none named)
    peer_profiles: list[str] = field(default_factory=list)  # "INDEX:NAME": that peer sends on another named profile
    peer_cpus: frozenset[int] | None = None  # the bootstrap and every peer run on these CPUs only (None: anywhere)
    federated: bool = False
    worker_stores: list[Path] = field(default_factory=list)  # federated: one worker each (default: store)
    topk_cap: int | None = None
    topk_codec: str = "fp16"
    device: str = "auto"  # every daemon's --device (one GPU can hold several peers' spans)
    dtype: str = "auto"  # every daemon's --dtype
    weights: str = "auto"  # every block peer's --weights
    metrics: bool = False  # every daemon serves its Prometheus metrics on a free loopback port
    # The `dsd-node` program (`run(argv)`) to fork the daemons after the bootstrap into: this process imports
    # what they load once, instead of each starting a new interpreter. Only for a caller that has run no
    # thread, event loop or torch yet (the CLI's `testnet up`); None: every daemon is a new interpreter.
    fork_program: Callable[[list[str]], None] | None = None
    faults: list[str] = field(default_factory=list)  # "INDEX:MODE": block peer INDEX lies on purpose (tests, demos)


def prepare_state_dir(state_dir: Path) -> Path:
    """Create the state directory (refusing one whose testnet still runs); returns its empty ready/ folder."""
    state_dir.mkdir(parents=True, exist_ok=True)
    try:
        old = TestnetState.load(state_dir)
        if any(pid_alive(p.pid) for p in old.peers):
            raise SwarmError(f"a testnet already runs from {state_dir}; `dsd-node testnet down --state {state_dir}` first")
    except FileNotFoundError:
        pass
    ready_dir = state_dir / "ready"
    ready_dir.mkdir(exist_ok=True)
    for f in ready_dir.glob("*.json"):
        f.unlink()
    return ready_dir


class _Launch:
    """The processes of one bring-up, so that a failure anywhere stops every one already started."""

    def __init__(self, spec: SwarmSpec) -> None:
        self.spec = spec
        self.ready_dir = prepare_state_dir(spec.state)
        self.started: list[PeerProcess] = []
        self.t0 = time.monotonic()

    def left(self) -> float:
        return max(1.0, self.spec.timeout_s - (time.monotonic() - self.t0))

    def spawn(self, name: str, args: list[str], link: tuple[str, LinkProfile] | None = None) -> PeerProcess:
        """Start one daemon sending on `link` (named; default the spec's) and pinned to the spec's CPUs: forked
        from this process after the bootstrap with `fork_program`, else a new interpreter."""
        link_name, profile = link or (self.spec.link_name, self.spec.link)
        common = ["--identity", str(self.spec.state / "keys" / f"{name}.key"),
                  "--ready-file", str(self.ready_dir / f"{name}.json"), *profile.cli_args(),
                  "--device", self.spec.device, "--dtype", self.spec.dtype, "--weights", self.spec.weights,
                  *(["--metrics-port", "0"] if self.spec.metrics else [])]
        program = self.spec.fork_program
        with children_pinned(self.spec.peer_cpus):
            if program is not None and self.started:
                proc = fork_daemon(name, [*args, *common], self.spec.state, program)
            else:
                proc = spawn(name, [*args, *common], self.spec.state)
        proc.cpus, proc.link = affinity_of(proc.pid), link_record(link_name, profile)
        self.started.append(proc)
        return proc

    def recorded(self) -> dict:
        """What the state records of the whole swarm besides its processes: the common link, the peers' CPUs."""
        cpus = self.spec.peer_cpus
        return {"wan": link_record(self.spec.link_name, self.spec.link), "peer_cpus": sorted(cpus) if cpus else None}

    def bootstrap(self) -> PeerProcess:
        """Start the bootstrap node (light: no torch) and, while it starts, import what forked daemons load."""
        boot = self.spawn("bootstrap", ["start", "--bootstrap-only"])
        if self.spec.fork_program is not None:
            preload_daemon_imports(_family_module(self.spec))
        info = wait_ready(self.ready_dir / "bootstrap.json", boot, self.left())
        boot.peer_id, boot.multiaddr, boot.role = info["peer_id"], info["addrs"][0], "bootstrap"
        boot.metrics_url = info.get("metrics_url")
        return boot

    def await_peers(self) -> None:
        """Wait for every daemon after the bootstrap to write its ready file; record its id, address and span."""
        for proc in self.started[1:]:
            info = wait_ready(self.ready_dir / f"{proc.name}.json", proc, self.left())
            proc.peer_id, proc.multiaddr = info["peer_id"], info["addrs"][0]
            proc.start, proc.end = info.get("start", proc.start), info.get("end", proc.end)
            proc.metrics_url = info.get("metrics_url")

    def record_up(self, state: TestnetState, wait: Callable[[float], None]) -> TestnetState:
        """Save the state (so `down` works even if waiting fails), wait until usable, save again."""
        state.save(self.spec.state)
        wait(self.left())
        state.up_seconds = round(time.monotonic() - self.t0, 3)
        state.save(self.spec.state)
        return state


def bring_up(spec: SwarmSpec) -> TestnetState:
    """Start the processes, wait until a head can use the swarm, return the state (stopping all on failure)."""
    faults = peer_faults(spec)
    if spec.peer_cpus is not None:
        try:
            check_cpus(spec.peer_cpus)
        except ValueError as exc:
            raise SwarmError(f"--peer-cpus: {exc}") from None
    if spec.federated:
        stores = spec.worker_stores or ([spec.store] if spec.store else [])
        if not stores:
            raise SwarmError("testnet up --federated needs --store (and optionally --store2) or --worker-stores")
        vocabs = {str(s): int(Manifest.read(s).vocab_size) for s in stores}
        if len(set(vocabs.values())) != 1:
            raise SwarmError(f"federated workers must share the vocabulary, got {vocabs}")
    elif spec.store is None:
        raise SwarmError("testnet up needs --store")
    elif spec.peers < 1 or spec.replicas < 1 or spec.peers % spec.replicas:
        raise SwarmError("--peers must be a positive multiple of --replicas")
    links = peer_links(spec, len(stores) if spec.federated else spec.peers)
    launch = _Launch(spec)
    try:
        boot = launch.bootstrap()
        if spec.federated:
            return _up_workers(launch, boot, stores, next(iter(vocabs.values())), links)
        return _up_blocks(launch, boot, faults, links)
    except BaseException:
        stop_processes(list(reversed(launch.started)))
        raise


def _family_module(spec: SwarmSpec) -> str | None:
    """The transformers module of the served model's family (None when the manifest does not say one we know)."""
    from dsd.shard_store.families import FAMILIES

    store = spec.store or (spec.worker_stores[0] if spec.worker_stores else None)
    if store is None:
        return None
    adapter = FAMILIES.get(Manifest.read(store).family)
    return adapter.module if adapter else None


def peer_faults(spec: SwarmSpec) -> dict[int, str]:
    """`--faulty INDEX:MODE` values as {block peer index: mode}; SwarmError for a bad form, index or mode."""
    if spec.faults and spec.federated:
        raise SwarmError("--faulty makes block peers lie; a --federated testnet has none")
    faults: dict[int, str] = {}
    for item in spec.faults:
        index, sep, mode = item.partition(":")
        if not sep or not index.strip().isdigit():
            raise SwarmError(f"--faulty {item}: expected INDEX:MODE, e.g. 1:noise")
        if not 0 <= int(index) < spec.peers:
            raise SwarmError(f"--faulty {item}: block peer index {int(index)} is not in 0..{spec.peers - 1}")
        if int(index) in faults:
            raise SwarmError(f"--faulty {item}: block peer {int(index)} already has a fault ({faults[int(index)]})")
        try:
            faults[int(index)] = str(parse_fault(mode))
        except ValueError as exc:
            raise SwarmError(f"--faulty {item}: {exc}") from None
    return faults


def peer_links(spec: SwarmSpec, count: int) -> dict[int, tuple[str, LinkProfile]]:
    """`--peer-profile INDEX:NAME` values as {peer index: (name, link)} for `count` peers (`paper` taking the
    swarm's latency); SwarmError for a bad form, index or name."""
    try:
        names = parse_peer_profiles(spec.peer_profiles, count)
    except ValueError as exc:
        raise SwarmError(str(exc)) from None
    return {i: (name, peer_link(name, spec.link.latency_s * 1000)) for i, name in names.items()}


def _up_blocks(launch: _Launch, boot: PeerProcess, faults: dict[int, str],
               links: dict[int, tuple[str, LinkProfile]]) -> TestnetState:
    spec = launch.spec
    assert spec.store is not None
    manifest = Manifest.read(spec.store)
    num_layers = int(manifest.num_layers)
    spans = even_spans(num_layers, spec.peers // spec.replicas)
    for i in range(spec.peers):
        start, end = spans[i // spec.replicas]
        proc = launch.spawn(f"peer{i}", [
            "start", "--store", str(spec.store), "--blocks", f"{start}:{end}", "--bootstrap", boot.multiaddr,
            "--threads", str(spec.threads), "--codec", spec.codec, "--record-ttl", str(spec.record_ttl_s),
            *(["--zstd"] if spec.zstd else []), *(["--faulty", faults[i]] if i in faults else []),
            "--batching", spec.batching,
        ], links.get(i))
        proc.start, proc.end, proc.fault = start, end, faults.get(i)
    launch.await_peers()
    state = TestnetState(bootstrap=boot.multiaddr, model=manifest.model_id, store=str(spec.store),
                         num_layers=num_layers, peers=launch.started, **launch.recorded())
    return launch.record_up(state, lambda left: trio.run(_wait_route, state, left))


def _up_workers(launch: _Launch, boot: PeerProcess, stores: list[Path], vocab: int,
                links: dict[int, tuple[str, LinkProfile]]) -> TestnetState:
    from dsd.node.federated.pool import pool_key

    spec = launch.spec
    for i, store in enumerate(stores):
        extra = ["--topk-cap", str(spec.topk_cap)] if spec.topk_cap else []
        proc = launch.spawn(f"worker{i}", [
            "start", "--federated", "--store", str(store), "--bootstrap", boot.multiaddr,
            "--threads", str(spec.threads), "--record-ttl", str(spec.record_ttl_s), "--topk-codec", spec.topk_codec,
            *extra,
        ], links.get(i))
        proc.role = "federated"
    launch.await_peers()
    state = TestnetState(bootstrap=boot.multiaddr, model=pool_key(vocab), store=",".join(str(s) for s in stores),
                         num_layers=None, peers=launch.started, **launch.recorded())
    return launch.record_up(state, lambda left: trio.run(_wait_workers, state, vocab, left))


async def _wait_workers(state: TestnetState, vocab: int, timeout_s: float) -> None:
    from dsd.node.federated.pool import find_workers
    from dsd.node.peer.host import head_node

    want = {p.peer_id for p in state.peers if p.role == "federated"}
    async with head_node([state.bootstrap]) as (node, _legs):
        with trio.move_on_after(timeout_s):
            while True:
                if want <= {w.peer_id for w in await find_workers(node, vocab)}:
                    return
                await trio.sleep(0.5)
    raise TimeoutError(f"federated workers not all announced after {timeout_s:.0f} s")


async def _wait_route(state: TestnetState, timeout_s: float) -> None:
    from dsd.discovery.survey import wait_for_route
    from dsd.node.peer.host import head_node

    async with head_node([state.bootstrap]) as (node, _legs):
        await wait_for_route(node, state.model or "", state.num_layers or 0, timeout_s)


def state_report(state: TestnetState) -> dict:
    """The state as `testnet status --json` prints it, with each process's liveness."""
    from dataclasses import asdict

    d = asdict(state)
    for p in d["peers"]:
        p["alive"] = pid_alive(p["pid"])
    return d
