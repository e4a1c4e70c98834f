"""QUIC beside TCP between machines of a testbed (network namespaces): a peer listening on both announces both; where
its firewall drops new TCP connections the head reaches it over QUIC, and when the QUIC path then blackholes in the
middle of a generation (UDP dropped, TCP let through again) the route finds the peer answering on a new connection
over TCP and goes on there. Every output equals the whole model's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from support.models import hf_greedy
from support.nat import PORT, generate, links, need_nat_testbed, swarm_on
from transformers import AutoModelForCausalLM

from dsd.node.testnet.nat_testbed import NatTestbed

pytestmark = pytest.mark.network

PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]
NEW_TCP = ("-p", "tcp", "--dport", str(PORT), "-m", "conntrack", "--ctstate", "NEW", "-j", "DROP")
UDP = ("-p", "udp", "--dport", str(PORT), "-j", "DROP")


def _wait_for(path: str, text: str, timeout: float, after: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while text not in Path(path).read_text()[after:]:
        assert time.monotonic() < deadline, f"{text!r} not in {path} after {timeout} s"
        time.sleep(0.1)


def test_quic_carries_a_route_where_tcp_is_filtered_and_tcp_takes_over_when_quic_blackholes(
    tiny_qwen2_root: Path, tmp_path: Path
) -> None:
    need_nat_testbed()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    n = 40
    reference = hf_greedy(model, PROMPT, n)
    store = tiny_qwen2_root / "store"
    with NatTestbed() as tb, swarm_on(tb, tmp_path) as swarm:
        for name in ("boot", "peer", "head"):
            tb.public(name)
        boot = swarm.start("boot", "--bootstrap-only")["addrs"][0]
        peer = swarm.start("peer", "--store", str(store), "--blocks", "0:5", "--bootstrap", boot, "--threads", "1",
                           "--quic", "on", "--reachability", "public")
        ip = tb.hosts["peer"].ip
        assert sorted(peer["addrs"]) == sorted(f"/ip4/{ip}/{t}/p2p/{peer['peer_id']}"
                                               for t in (f"tcp/{PORT}", f"udp/{PORT}/quic-v1"))
        tb.firewall("peer", "-I", "INPUT", *NEW_TCP)  # a firewall that passes only UDP to the peer

        report = generate(swarm, boot, store, PROMPT, n, "--quic", "on")
        assert report["tokens"] == reference
        assert links(report)[0] == "direct+quic", links(report)  # TCP did not get through: QUIC did

        # The same again, and while it runs the QUIC path goes dark: UDP dropped, new TCP connections let through.
        log = peer["log"]
        seen = len(Path(log).read_text())
        out: dict = {}

        def second() -> None:
            try:
                out.update(generate(swarm, boot, store, PROMPT, n, "--quic", "on", "--wan-latency-ms", "150"))
            except AssertionError as exc:  # the generation failed: its stderr, for the assertion below
                out["error"] = str(exc)

        gen = threading.Thread(target=second)
        gen.start()
        _wait_for(log, "open from", 120, after=seen)
        time.sleep(1.0)
        tb.firewall("peer", "-I", "INPUT", *UDP)
        tb.firewall("peer", "-D", "INPUT", *NEW_TCP)
        gen.join(300)
        assert not gen.is_alive()
        assert "error" not in out, out["error"]
        assert out["tokens"] == reference
        assert out["failovers"], out  # the route noticed, recovered, and replayed
        assert links(out)[0] == "direct", links(out)  # and ended on TCP
