"""Measured costs steer routes: with jitter on every link and two of three replicas made slow
(high emulated latency), the head's RTT probes see it and the planner picks the fast replica."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dsd.discovery.survey import survey
from dsd.node.peer.host import head_node
from dsd.node.testnet.processes import spawn, stop_processes, wait_ready

pytestmark = pytest.mark.network


def test_planner_avoids_slow_peers(tiny_qwen2_root: Path, tmp_path: Path) -> None:
    boot = spawn("bootstrap", ["start", "--bootstrap-only", "--identity", str(tmp_path / "b.key"),
                               "--ready-file", str(tmp_path / "b.json")], tmp_path)
    procs = [boot]
    try:
        bootstrap = wait_ready(tmp_path / "b.json", boot, 120)["addrs"][0]
        wan = {"slow1": ["--wan-latency-ms", "250", "--wan-jitter-ms", "5"],
               "fast": ["--wan-latency-ms", "10", "--wan-jitter-ms", "5"],
               "slow2": ["--wan-latency-ms", "250", "--wan-jitter-ms", "5"]}
        for name, opts in wan.items():
            procs.append(spawn(name, ["start", "--store", str(tiny_qwen2_root / "store"), "--blocks", "0:5",
                                      "--bootstrap", bootstrap, "--identity", str(tmp_path / f"{name}.key"),
                                      "--ready-file", str(tmp_path / f"{name}.json"), "--threads", "1", *opts], tmp_path))
        ids = {p.name: wait_ready(tmp_path / f"{p.name}.json", p, 120)["peer_id"] for p in procs[1:]}

        async def main():
            async with head_node([bootstrap]) as (node, _legs):
                with trio.fail_after(60):
                    while True:
                        view = await survey(node, "tiny-qwen2", 5)
                        if len(view.records) == 3:
                            return view
                        await trio.sleep(0.5)

        view = trio.run(main)
        assert view.rtts[ids["slow1"]] > 0.24 and view.rtts[ids["slow2"]] > 0.24, view.rtts
        assert view.rtts[ids["fast"]] < 0.06, view.rtts
        assert [h.peer_id for h in view.plan.hops] == [ids["fast"]]
    finally:
        stop_processes([p.pid for p in reversed(procs)])
