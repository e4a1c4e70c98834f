"""Peers that move their span (issue 56), over real daemons on loopback (tiny random Qwen2, 5 layers): two peers
serve 0:3 and one 3:5, each looking at the swarm every second. While all serve, nobody moves; when the 3:5 peer is
killed, exactly one of the 0:3 peers moves to fill the hole (the other sees it filled, or would open a hole), and a
head's greedy generation over the healed swarm equals HF's."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from support.heads import generate_on
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli

from dsd.node.fetch.local import manifest_sha256
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import NgramDrafter
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
LAYERS = 5
PROMPT = [1, 250, 3, 3, 3, 3, 8]
# One announced throughput for all: measured on a busy machine the peers' figures differ enough (205 against 450
# tokens/s, seen) that a move raises the bottleneck by 25 % and the "stable" swarm is not
LOOK = ("--rebalance-s", "1", "--record-ttl", "4", "--status-s", "1", "--throughput", "400")
MOVED = re.compile(r"moved to blocks (\d+):(\d+)")


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonSwarm, dict]]:
    with DaemonSwarm(tmp_path_factory.mktemp("rebalance")) as net:
        store = tiny_qwen2_root / "store"
        peers = {name: net.peer(name, store, blocks, *LOOK) for name, blocks in (("a", "0:3"), ("b", "0:3"),
                                                                                 ("c", "3:5"))}
        net.wait_route(MODEL, LAYERS)
        yield net, peers


def moves(peer: dict) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in MOVED.findall(Path(peer["log"]).read_text())]


def test_a_stable_swarm_stays_still_and_a_hole_is_filled_by_exactly_one_move(swarm, tiny_qwen2_root: Path,
                                                                            tiny_qwen2_hf) -> None:
    net, peers = swarm
    time.sleep(6)  # several looks each: a and b share 0:3 and c alone serves 3:5; no move helps
    assert [moves(p) for p in peers.values()] == [[], [], []]
    log = Path(peers["a"]["log"]).read_text()  # what a volunteer reads: what it serves and why, reachability,
    assert "serving blocks 0:3 of tiny-qwen2 (5 layers): as asked (--blocks 0:3); weights fp32" in log  # announced
    assert "reachable directly" in log and "announced: records stored on" in log
    assert re.search(r"serving blocks 0:3 of tiny-qwen2 \(fp32\) · 0 sessions open · \d+ tokens served", log), log[-2000:]
    out = cli("status", str(net.state / "a.json"), timeout=60)
    assert out.returncode == 0 and "s ago: serving blocks 0:3 of tiny-qwen2 (fp32) · 0 sessions open" in out.stdout, (
        out.stdout, out.stderr[-1000:])
    os.kill(peers["c"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not (moves(peers["a"]) or moves(peers["b"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(4)  # time for a second, wrong move to show up if there were one
    made = {name: moves(peers[name]) for name in ("a", "b")}
    assert sorted(len(m) for m in made.values()) == [0, 1], made  # one peer moved, once
    assert [m for m in made.values() if m] == [[(2, 5)]]  # three layers ending at the last: the hole 3:5 filled
    mover = next(name for name, m in made.items() if m)
    log = Path(peers[mover]["log"]).read_text()
    assert "moving: blocks 0:3 -> 2:5 (2 unserved blocks" in log, log[-3000:]
    time.sleep(1.5)  # a status line after the move
    status = json.loads(cli("status", "--json", str(net.state / f"{mover}.json"), timeout=60).stdout)["status"]
    assert (status["start"], status["end"]) == (2, 5)
    assert cli("status", str(net.state / "c.json"), timeout=60).returncode == 1  # killed: not running

    store = Store(tiny_qwen2_root / "store")
    net.wait_route(MODEL, LAYERS)

    async def main() -> list[int]:
        async with head_node([net.bootstrap]) as (node, legs):
            setup = HeadSetup(store.load_head(), MODEL, LAYERS, NgramDrafter())
            report = await generate_on(node, legs, setup, PROMPT, GenerationConfig(mode="dsd", max_new_tokens=16))
            assert {h.peer_id for h in report.transport.hops} >= {peers[mover]["peer_id"]}
            return report.tokens

    assert trio.run(main) == hf_greedy(tiny_qwen2_hf, PROMPT, 16)


def test_a_peer_that_fetched_only_its_span_fetches_the_blocks_it_moves_to(tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                                          tmp_path: Path) -> None:
    """A volunteer started with `--model` holds only its span's files: when the only peer of 3:5 dies it moves to 2:5
    all the same, fetching layers 3 and 4 from the peer that holds them (each file checked against the manifest),
    and a generation over the healed swarm equals HF's. The full-store peers here never move (`--rebalance-s 0`)."""
    store_dir = tiny_qwen2_root / "store"
    sha = manifest_sha256(store_dir)
    with DaemonSwarm(tmp_path / "net") as net:
        full = net.peer("full", store_dir, "0:3", "--rebalance-s", "0", "--record-ttl", "4")
        last = net.peer("last", store_dir, "3:5", "--rebalance-s", "0", "--record-ttl", "4")
        fetched = net.start("fetched", "--model", MODEL, "--manifest-sha256", sha, "--blocks", "0:3",
                            "--fetch-dir", str(tmp_path / "fetched"), "--bootstrap", net.bootstrap, "--threads", "1",
                            "--rebalance-s", "1", "--record-ttl", "4")
        held = {p.name for p in (tmp_path / "fetched").rglob("*.safetensors")}
        net.wait_route(MODEL, LAYERS)
        os.kill(last["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 90
        while not moves(fetched) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert moves(fetched) == [(2, 5)], Path(fetched["log"]).read_text()[-3000:]
        log = Path(fetched["log"]).read_text()
        assert re.search(r"fetched 2 files of blocks 2:5", log), log[-3000:]
        now = {p.name for p in (tmp_path / "fetched").rglob("*.safetensors")}
        assert len(now) == len(held) + 2  # layers 3 and 4, beside the span it fetched at start
        net.wait_route(MODEL, LAYERS)
        store = Store(store_dir)

        async def main() -> list[int]:
            async with head_node([net.bootstrap]) as (node, legs):
                setup = HeadSetup(store.load_head(), MODEL, LAYERS, NgramDrafter())
                report = await generate_on(node, legs, setup, PROMPT, GenerationConfig(mode="dsd", max_new_tokens=16))
                assert [h.peer_id for h in report.transport.hops] == [full["peer_id"], fetched["peer_id"]]
                return report.tokens

        assert trio.run(main) == hf_greedy(tiny_qwen2_hf, PROMPT, 16)
