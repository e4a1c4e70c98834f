"""`dsd-node start --throughput`: a peer announces the figure it is given instead of the one it measures at start
(a load spike during that measurement otherwise sticks to the peer for its whole life), heads see it in the DHT,
and a figure that is not a positive number is refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.processes import DaemonSwarm, cli

pytestmark = pytest.mark.network


def test_the_given_throughput_is_announced_and_the_measured_one_otherwise(tiny_qwen2_root: Path,
                                                                          tmp_path: Path) -> None:
    store = tiny_qwen2_root / "store"
    with DaemonSwarm(tmp_path) as net:
        given = net.peer("given", store, "0:3", "--throughput", "4321.5")
        measured = net.peer("measured", store, "3:5")
        net.wait_route("tiny-qwen2", 5)
        route = cli("route", "--bootstrap", net.bootstrap, "--model", "tiny-qwen2", "--json")
    assert route.returncode == 0, route.stderr[-2000:]
    announced = {p["peer_id"]: p["throughput"] for p in json.loads(route.stdout)["peers"]}
    assert given["throughput"] == 4321.5 and announced[given["peer_id"]] == 4321.5
    # the other peer timed its own layers: a measured figure, not the default placeholder of 1 token/s
    assert measured["throughput"] > 1.0 and announced[measured["peer_id"]] == measured["throughput"]


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf"])
def test_a_throughput_that_is_not_a_positive_number_is_refused(tiny_qwen2_root: Path, tmp_path: Path,
                                                               value: str) -> None:
    r = cli("start", "--store", str(tiny_qwen2_root / "store"), "--identity", str(tmp_path / "k.key"),
            f"--throughput={value}", timeout=60)
    assert r.returncode == 2 and "--throughput must be a positive number of tokens/s" in r.stderr, r.stderr
