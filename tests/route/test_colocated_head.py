"""A co-located head (`generate --blocks A:B`): the head serves the model's first (or last) layers itself and
the route covers the rest, over real daemons on loopback serving only those layers (tiny random Qwen2, 5
layers split as a 3-peer testnet would: 0:2, 2:4, 4:5). Greedy output equals HF generate token for token in
`sd` and `dsd`, with token trees (auto, a fixed budget) and without; the route has one peer fewer than the
ring (the `--json` hops mark the head's own span `local`); bad spans are refused before any network; and a
peer killed with a tree window in flight is replaced while the head's own span is rebuilt consistently."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
from support.heads import KillOnTree, generate_on, swarm_of
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.node.route.open import open_route_client
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
PROMPTS = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 250, 3, 3, 3, 3, 8]]
N_NEW = 20
LAYERS = 5


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonSwarm, dict]]:
    """Peers for blocks 2:4 and 4:5 only: the head serves 0:2."""
    with DaemonSwarm(tmp_path_factory.mktemp("colocated")) as net:
        store = tiny_qwen2_root / "store"
        peers = {"mid": net.peer("mid", store, "2:4", "--record-ttl", "6"),
                 "last": net.peer("last", store, "4:5", "--record-ttl", "6")}
        net.wait_route(MODEL, LAYERS, (2, LAYERS))
        yield net, peers


def local_hops(report) -> list[tuple[int, int]]:
    return [(h.start, h.end) for h in report.transport.hops if h.local]


def test_greedy_with_the_head_serving_the_first_layers_equals_hf(swarm, tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                                 noisy_draft) -> None:
    net, peers = swarm
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    trees: dict[tuple[str, int | None], int] = {}

    async def main() -> None:
        async with head_node([net.bootstrap]) as (node, legs):
            for prompt in PROMPTS:
                expected = hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
                for mode in ("sd", "dsd"):
                    for tree_nodes in (None, 12, 0):
                        setup = HeadSetup(head, MODEL, LAYERS, ModelDrafter(noisy_draft, SamplingParams()))
                        cfg = GenerationConfig(mode=mode, max_new_tokens=N_NEW, tree_nodes=tree_nodes)
                        report = await generate_on(node, legs, setup, prompt, cfg, local_span=store.load_span(0, 2))
                        assert report.tokens == expected, (mode, tree_nodes, prompt)
                        assert report.transport.route == [peers["mid"]["peer_id"], peers["last"]["peer_id"]]
                        assert [(h.start, h.end, h.local) for h in report.transport.hops] == [
                            (0, 2, True), (2, 4, False), (4, 5, False)]
                        assert report.transport.hops[0].peer_id == node.peer_id
                        trees[mode, tree_nodes] = trees.get((mode, tree_nodes), 0) + report.result.tree_windows

    trio.run(main)
    print(f"\ntree windows per (mode, budget): {trees}")
    assert trees["sd", 12] > 0 and trees["dsd", 12] > 0 and trees["sd", 0] == trees["dsd", 0] == 0


def test_cli_generate_blocks_reports_the_local_hop_and_refuses_bad_spans(swarm, tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                                         noisy_draft_store: Path) -> None:
    net, peers = swarm
    prompt = PROMPTS[0]
    common = ["generate", "--bootstrap", net.bootstrap, "--store", str(tiny_qwen2_root / "store"),
              "--draft", str(noisy_draft_store), "--prompt-ids", ",".join(map(str, prompt)),
              "--max-new-tokens", str(N_NEW), "--mode", "dsd", "--tree-nodes", "10", "--json"]
    out = cli(*common, "--blocks", "0:2", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["tokens"] == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
    assert len(report["route"]) == 2 and [(h["start"], h["end"]) for h in report["hops"] if h["local"]] == [(0, 2)]  # a 3-hop ring with one hop on the head
    assert report["tree_windows"] > 0
    out = cli(*common, "--blocks", "1:3", timeout=60)  # a span in the middle of the ring (other spans: test_discovery_planner)
    assert out.returncode == 2 and "the head serves the first layers" in out.stderr, out.stderr[-1000:]


def test_greedy_with_the_head_serving_the_last_layers_equals_hf(swarm, tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                                noisy_draft) -> None:
    """A peer for 0:2 joins; the head serves 4:5, so the ring ends before it and its span runs on each result."""
    net, peers = swarm
    first = net.peer("first", tiny_qwen2_root / "store", "0:2", "--record-ttl", "6")
    net.wait_route(MODEL, LAYERS, (0, 4))
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[1]

    async def main() -> None:
        async with head_node([net.bootstrap]) as (node, legs):
            for mode, tree_nodes in (("sd", 0), ("dsd", 12), ("sd", None)):
                setup = HeadSetup(store.load_head(), MODEL, LAYERS, ModelDrafter(noisy_draft, SamplingParams()))
                cfg = GenerationConfig(mode=mode, max_new_tokens=N_NEW, tree_nodes=tree_nodes)
                report = await generate_on(node, legs, setup, prompt, cfg, local_span=store.load_span(4, 5))
                assert report.tokens == hf_greedy(tiny_qwen2_hf, prompt, N_NEW), (mode, tree_nodes)
                assert report.transport.route == [first["peer_id"], peers["mid"]["peer_id"]]
                assert local_hops(report) == [(4, 5)] and report.transport.hops[-1].local
                if tree_nodes is not None:  # auto may choose either
                    assert (report.result.tree_windows > 0) == (tree_nodes > 0)

    trio.run(main)


def test_a_peer_killed_with_a_tree_in_flight_is_replaced_and_the_head_span_replayed(
    swarm, tiny_qwen2_root: Path, tiny_qwen2_hf, noisy_draft
) -> None:
    """Runs last in this module: it kills the route's peer for 4:5; a second peer for 4:5 takes over."""
    net, peers = swarm
    standby = net.peer("standby", tiny_qwen2_root / "store", "4:5", "--record-ttl", "6")
    pids = {info["peer_id"]: info["pid"] for info in (*peers.values(), standby)}
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[0]

    async def main():
        async with head_node([net.bootstrap]) as (node, legs):
            async with open_route_client(node, legs, swarm_of(node, MODEL, LAYERS, blocks=(2, LAYERS)), max_len=256) as client:
                backend = KillOnTree(store.load_head(), client, timeout_s=60, pids=pids, local=store.load_span(0, 2))
                drafter = ModelDrafter(noisy_draft, SamplingParams())
                cfg = GenerationConfig(mode="dsd", max_new_tokens=N_NEW, tree_nodes=12)
                result = await HeadEngine(backend, drafter, cfg).run(prompt)
                return result, backend, list(client.events), client.session.peers

    result, backend, events, route = trio.run(main)
    assert backend.killed is not None and backend.replayed_tree
    assert len(events) == 1 and events[0].blamed == [backend.killed]
    assert route[0] == peers["mid"]["peer_id"] and route[1] in pids and route[1] != backend.killed  # the other 4:5 peer
    assert result.tree_windows > 1
    assert result.tokens == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
