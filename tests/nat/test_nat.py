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
from support.nat import PORT, NatSwarm, generate, links, need_nat_testbed, route_peers, swarm_on
from support.processes import ForkServer
from transformers import AutoModelForCausalLM

from dsd.discovery.addrs import relay_of
from dsd.node.testnet.nat_testbed import NatTestbed
from dsd.node.testnet.processes import pid_alive, stop_processes

pytestmark = pytest.mark.network

PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]


@contextlib.contextmanager
def home_swarm(tmp_path: Path, symmetric: bool) -> Iterator[NatSwarm]:
    """A testbed with a public bootstrap node's and a second relay's machines, and p1, p2 and the head each behind a
    home NAT (symmetric or port-preserving); its `dsd-node` processes stopped and namespaces removed after."""
    need_nat_testbed()
    with NatTestbed() as tb:
        tb.public("boot"), tb.public("relay2")
        for name in ("p1", "p2", "head"):
            tb.home(name, symmetric=symmetric)
        with swarm_on(tb, tmp_path) as swarm:
            yield swarm


@pytest.fixture(scope="module")
def reference(tiny_qwen2_root: Path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    return hf_greedy(model, PROMPT, 16)


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
        listed = route_peers(swarm, boot["addrs"][0], {p["peer_id"] for p in peers})
        for p in peers:  # reached through a relay from the head's home, the RTT measured through it
            assert listed[p["peer_id"]]["reachability"] == "private" and listed[p["peer_id"]]["rtt_ms"] is not None
            assert listed[p["peer_id"]]["link"] in ("relayed", "hole-punched")

        # p1 meets p2 when the session opens, over a relay; 80 ms on the head's links make the generation outlast
        # the punch: on a port-preserving NAT p1 moves the session's leg onto the punched link while it runs
        first = generate(swarm, boot["addrs"][0], store, PROMPT, 16, "--wan-latency-ms", "80")
        assert first["tokens"] == reference and first["failovers"] == 0, first["failover_events"]
        assert all(link in ("relayed", "hole-punched") for link in links(first)), links(first)
        moved = {m["from"]: m["link"] for m in first["link_moves"]}
        if symmetric:
            assert not moved and links(first)[1] == "relayed", first["link_moves"]
        else:  # upgrade in place: no replay (no failover), the ring leg ends on the punched link
            assert moved.get(peers[0]["peer_id"]) == "hole-punched" and links(first)[1] == "hole-punched", first
        if symmetric:  # punches run in the background of the peers and fail after ~22 s: wait them out
            time.sleep(25)  # (on a port-preserving NAT the punch already happened: the leg moved onto it)
        second = generate(swarm, boot["addrs"][0], store, PROMPT)
        assert second["tokens"] == reference
        ring = links(second)[1:-1]  # the peer-to-peer legs: p1 -> p2 (the head's own legs are new each run)
        assert ring == (["relayed"] if symmetric else ["hole-punched"]), links(second)


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
        route_peers(swarm, relay2["addrs"][0], {p["peer_id"] for p in peers})
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
