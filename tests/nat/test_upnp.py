"""Home gateways that map ports (UPnP IGD), for real: Debian's miniupnpd runs in each home router's namespace of a NAT
testbed. A peer whose gateway maps and forwards is dialled directly at the mapped address; one whose gateway refuses,
and one whose gateway lists the mapping but forwards nothing, go on through relays and say why. The mapping is
renewed while the peer runs and removed when it stops; every output equals the whole model's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy
from support.nat import PORT, generate, links, need_nat_testbed, route_peers, swarm_on
from transformers import AutoModelForCausalLM

from dsd.node.testnet.nat_testbed import UPNP_BRIDGE_NET, NatTestbed
from dsd.node.testnet.processes import stop_processes

pytestmark = pytest.mark.network

PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]


def test_a_mapped_peer_is_dialled_directly_and_refusing_or_lying_gateways_leave_peers_on_relays(
    tiny_qwen2_root: Path, tmp_path: Path
) -> None:
    need_nat_testbed(upnp=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    reference = hf_greedy(model, PROMPT, 16)
    store = tiny_qwen2_root / "store"
    with NatTestbed(bridge_net=UPNP_BRIDGE_NET) as tb, swarm_on(tb, tmp_path) as swarm:
        tb.public("boot")
        for name, upnp in (("mapped", "forward"), ("refused", "refuse"), ("lied", "lie"), ("head", None)):
            tb.home(name, upnp=upnp)
        boot = swarm.start("boot", "--bootstrap-only")["addrs"][0]
        mapped, refused, lied = (swarm.start(name, "--store", str(store), "--blocks", blocks, "--bootstrap", boot,
                                             "--threads", "1")
                                 for name, blocks in (("mapped", "0:2"), ("refused", "2:4"), ("lied", "4:5")))
        wan = tb.hosts["mapped"].wan_ip
        assert mapped["reachability"] == "public" and mapped["port_mapping"] == f"/ip4/{wan}/tcp/{PORT}"
        assert mapped["addrs"] == [f"/ip4/{wan}/tcp/{PORT}/p2p/{mapped['peer_id']}"]  # only the mapped address
        assert f"{tb.hosts['mapped'].ip}" in tb.mappings("mapped")
        assert refused["reachability"] == "private" and refused["port_mapping"].startswith("none: the gateway refused")
        assert lied["reachability"] == "private" and "nothing it forwards reaches us" in lied["port_mapping"]
        assert tb.mappings("lied") == ""  # the useless mapping was removed
        for p in (refused, lied):
            assert all("/p2p-circuit/" in a for a in p["addrs"]), p["addrs"]
        log = Path(lied["log"]).read_text()
        assert "no AutoNAT dial-back got through it" in log

        listed = route_peers(swarm, boot, {p["peer_id"] for p in (mapped, refused, lied)})
        assert listed[mapped["peer_id"]]["reachability"] == "public"
        report = generate(swarm, boot, store, PROMPT)
        assert report["tokens"] == reference
        legs = links(report)
        assert legs[0] == "direct", legs  # the head dials the mapped peer at its gateway's port

        stop_processes([p for p in swarm.procs if p.name == "mapped"])
        deadline = time.monotonic() + 10
        while tb.mappings("mapped") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tb.mappings("mapped") == ""  # removed on exit


RENEWAL = """
import trio
from dsd.discovery.portmap import PortMapper

async def main():
    pm = PortMapper()
    m = await pm.open(4001, lease_s=4)
    async with trio.open_nursery() as n:
        n.start_soon(pm.keep)
        await trio.sleep(9)
        n.cancel_scope.cancel()
    kept = pm._gateway.upnp.getspecificportmapping(4001, "TCP")
    await pm.close()
    other = PortMapper()
    await other.open(4001, lease_s=4)
    await trio.sleep(9)
    print(m.external_port, kept is not None, other._gateway.upnp.getspecificportmapping(4001, "TCP") is None)

trio.run(main)
"""


def test_a_mapping_lives_while_its_lease_is_renewed_and_lapses_without(tmp_path: Path) -> None:
    """A 4 s lease: renewed at half, still listed after 9 s; the same lease not renewed is gone by then."""
    need_nat_testbed(upnp=True)
    with NatTestbed(bridge_net=UPNP_BRIDGE_NET) as tb:
        host = tb.home("p1", upnp="forward")
        out = subprocess.run(["ip", "netns", "exec", host.netns, sys.executable, "-c", RENEWAL], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.split() == ["4001", "True", "True"], out.stdout


def _status(state: Path, machine: str, want, timeout_s: float = 40.0) -> dict:
    """The `status` a daemon keeps in its ready file, once `want(status)` holds (asserted within `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = json.loads((state / f"{machine}.json").read_text()).get("status", {})
        if (st and want(st)) or time.monotonic() > deadline:
            assert st and want(st), st
            return st
        time.sleep(0.5)


def test_a_peer_follows_its_network_a_gateway_that_appears_then_forgets_its_mapping(
    tiny_qwen2_root: Path, tmp_path: Path
) -> None:
    """Behind a router without UPnP the peer is private (relays); the router starts a gateway: at the next check
    the peer maps a port, is public there and its record says so, the head dials it directly; the router drops
    every mapping: the peer is private again, through relays. Each generation is exact."""
    need_nat_testbed(upnp=True)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    reference = hf_greedy(model, PROMPT, 16)
    store = tiny_qwen2_root / "store"
    with NatTestbed(bridge_net=UPNP_BRIDGE_NET) as tb, swarm_on(tb, tmp_path) as swarm:
        tb.public("boot"), tb.home("p1"), tb.home("head")
        boot = swarm.start("boot", "--bootstrap-only")["addrs"][0]
        p1 = swarm.start("p1", "--store", str(store), "--blocks", "0:5", "--bootstrap", boot, "--threads", "1",
                         "--reachability-check-s", "3", "--status-s", "1", "--record-ttl", "6")
        assert p1["reachability"] == "private" and p1["port_mapping"] == "none: no UPnP gateway answered on the LAN"
        mapped = f"/ip4/{tb.hosts['p1'].wan_ip}/tcp/{PORT}/p2p/{p1['peer_id']}"

        tb.add_gateway("p1")
        _status(tmp_path, "p1", lambda st: st["reachability"] == "public" and st["addrs"] == [mapped])
        deadline = time.monotonic() + 30
        while route_peers(swarm, boot, {p1["peer_id"]})[p1["peer_id"]]["reachability"] != "public":
            assert time.monotonic() < deadline, "the record still says private"
            time.sleep(1)
        report = generate(swarm, boot, store, PROMPT)
        assert report["tokens"] == reference and links(report)[0] == "direct", links(report)

        tb.remove_gateway("p1")
        _status(tmp_path, "p1", lambda st: st["reachability"] == "private"
                and all("/p2p-circuit/" in a for a in st["addrs"]))
        report = generate(swarm, boot, store, PROMPT)
        assert report["tokens"] == reference and links(report)[0] in ("relayed", "hole-punched"), links(report)
        assert "the network changed: public" in Path(p1["log"]).read_text()
