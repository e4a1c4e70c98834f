"""Volunteers behind NATs, through real NATs: a public bootstrap node and a second relay on an "internet" bridge,
two block peers and the head each behind a home router of their own (network namespaces, iptables MASQUERADE).
Every process is a real `dsd-node` in its machine's namespace; output is checked against the whole model's."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy
from support.processes import ForkServer
from transformers import AutoModelForCausalLM

from dsd.discovery.addrs import relay_of
from dsd.node.testnet.nat_testbed import NatTestbed, nat_testbed_missing
from dsd.node.testnet.processes import pid_alive, stop_processes, wait_ready

pytestmark = pytest.mark.network

PORT = 4001  # every machine has its own namespace, so each may listen on the same port
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]


@contextlib.contextmanager
def home_swarm(tmp_path: Path, symmetric: bool) -> Iterator[NatSwarm]:
    """A testbed with a public bootstrap node's and a second relay's machines, and p1, p2 and the head each behind a
    home NAT (symmetric or port-preserving); its `dsd-node` processes stopped and namespaces removed after."""
    why = nat_testbed_missing()
    if why == "needs root (network namespaces)":
        pytest.skip(why)
    if why is not None:  # the README test command installs iptables: missing, the NAT tests must not pass
        pytest.fail(f"the NAT testbed cannot be built: {why}")
    with NatTestbed() as tb:
        tb.public("boot"), tb.public("relay2")
        for name in ("p1", "p2", "head"):
            tb.home(name, symmetric=symmetric)
        swarm = NatSwarm(tb, tmp_path)
        try:
            yield swarm
        finally:
            swarm.stop()


class NatSwarm:
    """`dsd-node` processes on the machines of a NatTestbed: daemons with `start`, commands with `run`."""

    def __init__(self, tb: NatTestbed, state: Path) -> None:
        self.tb, self.state, self.procs = tb, state, []

    def start(self, machine: str, *args: str) -> dict:
        host = self.tb.hosts[machine]
        ready = self.state / f"{machine}.json"
        proc = ForkServer.session().start(machine, ["start", "--listen", f"/ip4/{host.ip}/tcp/{PORT}",
                                                    "--identity", str(self.state / f"{machine}.key"),
                                                    "--ready-file", str(ready), *args], self.state, netns=host.netns)
        self.procs.append(proc)
        return {**wait_ready(ready, proc, 120), "log": proc.log}

    def run(self, machine: str, *args: str, timeout: float = 240):
        host = self.tb.hosts[machine]
        return ForkServer.session().run([*args, "--listen", f"/ip4/{host.ip}/tcp/{PORT}"], timeout, netns=host.netns)

    def stop(self) -> None:
        stop_processes(list(reversed(self.procs)))


@pytest.fixture(scope="module")
def reference(tiny_qwen2_root: Path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPT, 16)


def _generate(swarm: NatSwarm, boot: str, store: Path) -> dict:
    out = swarm.run("head", "generate", "--bootstrap", boot, "--store", str(store), "--draft", "ngram",
                    "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16", "--mode", "dsd", "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _route_peers(swarm: NatSwarm, boot: str, want: set[str]) -> dict[str, dict]:
    """`route --json` from the head's machine, until it lists every peer of `want`; its peers by id."""
    deadline = time.monotonic() + 60
    while True:
        out = swarm.run("head", "route", "--bootstrap", boot, "--model", "tiny-qwen2", "--json")
        assert out.returncode in (0, 1) and out.stdout, out.stderr[-3000:]
        listed = {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}
        if want <= set(listed) or time.monotonic() > deadline:
            assert want <= set(listed), listed
            return listed
        time.sleep(1)


def _links(report: dict) -> list[str | None]:
    return [h["link"] for h in report["hops"] if not h["local"]] + [report["return_link"]]


@pytest.mark.parametrize("symmetric", [False, True], ids=["port-preserving", "symmetric"])
def test_nated_peers_serve_through_relays_and_punch_when_the_nat_allows(
    tiny_qwen2_root: Path, reference: list[int], tmp_path: Path, symmetric: bool
) -> None:
    store = tiny_qwen2_root / "store"
    with home_swarm(tmp_path, symmetric) as swarm:
        boot = swarm.start("boot", "--bootstrap-only")
        assert boot["relay"] and boot["reachability"] in ("unknown", "public")
        relay2 = swarm.start("relay2", "--bootstrap-only", "--bootstrap", boot["addrs"][0])
        assert relay2["reachability"] == "public"
        peers = [swarm.start(name, "--store", str(store), "--blocks", blocks, "--bootstrap", boot["addrs"][0],
                             "--threads", "1", "--record-ttl", "6")
                 for name, blocks in (("p1", "0:3"), ("p2", "3:5"))]
        for p in peers:  # announced only through the two relays: never the LAN address, never 0.0.0.0
            assert p["reachability"] == "private"
            assert len(p["addrs"]) == 2 and all("/p2p-circuit/p2p/" + p["peer_id"] in a for a in p["addrs"])
        listed = _route_peers(swarm, boot["addrs"][0], {p["peer_id"] for p in peers})
        for p in peers:  # reached through a relay from the head's home, the RTT measured through it
            assert listed[p["peer_id"]]["reachability"] == "private" and listed[p["peer_id"]]["rtt_ms"] is not None
            assert listed[p["peer_id"]]["link"] in ("relayed", "hole-punched")

        first = _generate(swarm, boot["addrs"][0], store)
        assert first["tokens"] == reference
        assert all(link in ("relayed", "hole-punched") for link in _links(first)), _links(first)
        time.sleep(25)  # punches run in the background of the peers (and fail after ~22 s on a symmetric NAT)
        second = _generate(swarm, boot["addrs"][0], store)
        assert second["tokens"] == reference
        ring = _links(second)[1:-1]  # the peer-to-peer legs: p1 -> p2 (the head's own legs are new each run)
        assert ring == (["relayed"] if symmetric else ["hole-punched"]), _links(second)


def test_a_relay_killed_mid_generation_is_a_failover_through_the_other_relay(
    tiny_qwen2_root: Path, reference: list[int], tmp_path: Path
) -> None:
    """Symmetric NATs: every leg stays relayed. The relay the route's circuits go through is killed while the
    generation runs; the route is opened again through each peer's second relay and the output is exact."""
    store, wan = tiny_qwen2_root / "store", ["--wan-latency-ms", "60"]
    with home_swarm(tmp_path, symmetric=True) as swarm:
        tb = swarm.tb
        boot = swarm.start("boot", "--bootstrap-only", *wan)
        relay2 = swarm.start("relay2", "--bootstrap-only", "--bootstrap", boot["addrs"][0], *wan)
        peers = [swarm.start(name, "--store", str(store), "--blocks", blocks, "--bootstrap", boot["addrs"][0],
                             "--threads", "1", *wan) for name, blocks in (("p1", "0:3"), ("p2", "3:5"))]
        _route_peers(swarm, relay2["addrs"][0], {p["peer_id"] for p in peers})
        used = relay_of(peers[0]["addrs"][0])  # the head dials this relay first
        victim = next(p for p in swarm.procs if p.name == ("boot" if used == boot["peer_id"] else "relay2"))
        head = ForkServer.session().start("head", [
            "generate", "--bootstrap", boot["addrs"][0], "--bootstrap", relay2["addrs"][0], "--store", str(store),
            "--draft", "ngram", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "16",
            "--mode", "ar", "--json", "--listen", f"/ip4/{tb.hosts['head'].ip}/tcp/{PORT}", *wan,
        ], tmp_path, netns=tb.hosts["head"].netns)
        log = Path(head.log)
        deadline = time.monotonic() + 60
        while "open over" not in _text(log) and time.monotonic() < deadline:  # the route is open
            time.sleep(0.2)
        time.sleep(1.0)
        stop_processes([victim])
        while pid_alive(head.pid) and time.monotonic() < deadline + 120:
            time.sleep(0.5)
        report = json.loads(next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{")))
        assert report["tokens"] == reference[:16], log.read_text()[-3000:]
        assert report["failovers"] >= 1, log.read_text()[-3000:]


def _text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""
