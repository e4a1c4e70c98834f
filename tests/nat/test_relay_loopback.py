"""Relays and reachability on loopback (no namespaces needed): a peer told `--reachability private` is served
through the swarm's relays exactly as a peer behind a NAT would be; peers that can be dialled learn so from
AutoNAT; relays announce themselves; nothing announces an unspecified address."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli
from transformers import AutoModelForCausalLM

from dsd.discovery.addrs import relay_of
from dsd.node.testnet.processes import PeerProcess, stop_processes

pytestmark = pytest.mark.network

PROMPT = [3, 8, 13, 21, 34, 55, 89, 144]


def test_a_private_peer_serves_through_two_relays_on_loopback(tiny_qwen2_root: Path, tmp_path: Path) -> None:
    store = tiny_qwen2_root / "store"
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    with DaemonSwarm(tmp_path) as net:
        relay2 = net.start("relay2", "--bootstrap-only", "--bootstrap", net.bootstrap)
        assert relay2["relay"] and relay2["reachability"] == "public"  # AutoNAT: the bootstrap node dialled it back
        public = net.peer("public", store, "0:2", "--record-ttl", "6")
        private = net.peer("private", store, "2:5", "--record-ttl", "6", "--reachability", "private")
        assert public["reachability"] == "public" and public["addrs"] == [a for a in public["addrs"] if "/p2p-circuit" not in a]
        relays = {net.bootstrap.rsplit("/p2p/", 1)[1], relay2["peer_id"]}
        assert private["reachability"] == "private" and len(private["addrs"]) == 2
        assert {relay_of(a) for a in private["addrs"]} == relays
        net.wait_route("tiny-qwen2", 5)
        assert _relays_in_the_dht(net.bootstrap) == relays

        route = cli("route", "--bootstrap", net.bootstrap, "--model", "tiny-qwen2", "--json")
        assert route.returncode == 0, route.stderr[-2000:]
        peers = {p["peer_id"]: p for p in json.loads(route.stdout)["peers"]}
        assert peers[private["peer_id"]]["reachability"] == "private"
        assert peers[private["peer_id"]]["link"] in ("relayed", "hole-punched")  # punching works on loopback
        assert peers[public["peer_id"]]["reachability"] == "public" and peers[public["peer_id"]]["link"] == "direct"

        out = cli("generate", "--bootstrap", net.bootstrap, "--store", str(store), "--draft", "ngram", "--prompt-ids",
                  ",".join(map(str, PROMPT)), "--max-new-tokens", "12", "--mode", "dsd", "--json")
        assert out.returncode == 0, out.stderr[-2000:]
        report = json.loads(out.stdout)
        assert report["tokens"] == hf_greedy(model, PROMPT, 12)
        links = [h["link"] for h in report["hops"]] + [report["return_link"]]
        assert links[0] == "direct" and all(link in ("direct", "relayed", "hole-punched") for link in links), links

        # A relay goes away: the private peer takes a slot on another one and announces it instead.
        relay3 = net.start("relay3", "--bootstrap-only", "--bootstrap", net.bootstrap)
        stop_processes([PeerProcess.from_dict(relay2)])
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            out = cli("route", "--bootstrap", net.bootstrap, "--model", "tiny-qwen2", "--json")
            addrs = {p["peer_id"]: p["addrs"] for p in json.loads(out.stdout)["peers"]}.get(private["peer_id"], [])
            via = {relay_of(a) for a in addrs}
            if via == {net.bootstrap.rsplit("/p2p/", 1)[1], relay3["peer_id"]}:
                break
            time.sleep(1)
        else:
            raise AssertionError(f"the private peer still announces {addrs} after its relay left")


def test_start_help_documents_reachability_and_relay() -> None:
    out = cli("start", "--help")
    assert out.returncode == 0
    for flag in ("--reachability", "{auto,public,private}", "--relay", "--no-relay"):
        assert flag in out.stdout


def _relays_in_the_dht(bootstrap: str) -> set[str]:
    """The peers whose relay records a new head reads from the DHT."""
    import trio

    from dsd.discovery.announce import fetch_records
    from dsd.discovery.relays import RELAYS_KEY
    from dsd.node.peer.host import head_node

    async def main() -> set[str]:
        async with head_node([bootstrap]) as (node, _legs):
            return {r.peer_id for r in await fetch_records(node, RELAYS_KEY, 0) if r.role == "relay"}

    return trio.run(main)
