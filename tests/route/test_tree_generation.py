"""Token-tree windows end to end over a real 3-peer testnet (separate daemons on loopback, tiny random
Qwen2): greedy generation with tree windows in `sd` and `dsd` equals HF generate token for token with a
draft that differs from the target; `dsd-node generate --tree-nodes 0` sends only chains and a node
budget sends trees; and a hop killed while a tree window is in flight is replaced: the committed tokens
are replayed as a chain, the tree is re-sent on the new route and the output is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
from support.heads import KillOnTree, generate_on, swarm_of
from support.models import hf_greedy
from support.processes import cli, cli_testnet, daemon

from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.node.route.open import open_route_client
from dsd.node.testnet.processes import stop_processes, wait_ready
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
PROMPTS = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 250, 3, 3, 3, 3, 8]]
N_NEW = 24




@pytest.fixture(scope="module")
def testnet(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with cli_testnet(tmp_path_factory.mktemp("treenet"), "--store", str(tiny_qwen2_root / "store"), "--peers", "3", "--record-ttl", "6") as info:
        yield info


def test_greedy_tree_generation_over_the_ring_equals_hf(testnet: dict, tiny_qwen2_root: Path, tiny_qwen2_hf, noisy_draft) -> None:
    head = Store(tiny_qwen2_root / "store").load_head()
    trees: dict[tuple[str, int | None], int] = {}

    async def main() -> None:
        async with head_node([testnet["bootstrap"]]) as (node, legs):
            for prompt in PROMPTS:
                expected = hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
                for mode in ("sd", "dsd"):
                    for tree_nodes in (None, 12):
                        setup = HeadSetup(head, MODEL, 5, ModelDrafter(noisy_draft, SamplingParams()))
                        cfg = GenerationConfig(mode=mode, max_new_tokens=N_NEW, tree_nodes=tree_nodes)
                        report = await generate_on(node, legs, setup, prompt, cfg)
                        assert report.tokens == expected, (mode, tree_nodes, prompt)
                        trees[mode, tree_nodes] = trees.get((mode, tree_nodes), 0) + report.result.tree_windows
                        if report.result.tree_windows:
                            assert report.result.mean_tree_nodes > report.result.mean_window_depth

    trio.run(main)
    print(f"\ntree windows per (mode, budget): {trees}")
    assert all(n > 0 for n in trees.values()), trees  # trees went round the ring in every setting


def test_cli_tree_nodes_zero_sends_chains_and_a_budget_sends_trees(testnet: dict, tiny_qwen2_root: Path, tiny_qwen2_hf,
                                                                    noisy_draft_store: Path) -> None:
    prompt = PROMPTS[0]
    common = ["generate", "--bootstrap", testnet["bootstrap"], "--store", str(tiny_qwen2_root / "store"),
              "--draft", str(noisy_draft_store), "--prompt-ids", ",".join(map(str, prompt)),
              "--max-new-tokens", str(N_NEW), "--mode", "sd", "--json"]
    reports = {}
    for budget in ("0", "10"):
        out = cli(*common, "--tree-nodes", budget, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        reports[budget] = json.loads(out.stdout)
        assert reports[budget]["tokens"] == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
    chains, trees = reports["0"], reports["10"]
    assert chains["tree_windows"] == 0 and chains["mean_tree_nodes"] == chains["mean_window_depth"]
    assert trees["tree_windows"] > 0 and trees["mean_tree_nodes"] > trees["mean_window_depth"]
    bad = cli(*common[:-1], "--tree-nodes", "10", "--draft", "ngram", timeout=60)
    assert bad.returncode != 0 and "--tree-nodes" in bad.stderr


def test_a_hop_killed_with_a_tree_in_flight_is_replaced_and_output_is_unchanged(
    testnet: dict, tiny_qwen2_root: Path, tiny_qwen2_hf, noisy_draft, tmp_path: Path
) -> None:
    """Runs last in this module: it kills a peer. A standby peer serves the last span, so a route is left."""
    store = Store(tiny_qwen2_root / "store")
    prompt = PROMPTS[1]
    proc = daemon("standby", ["start", "--store", str(tiny_qwen2_root / "store"), "--blocks", "4:5",
                             "--bootstrap", testnet["bootstrap"], "--identity", str(tmp_path / "standby.key"),
                             "--ready-file", str(tmp_path / "standby.json"), "--threads", "1", "--record-ttl", "6"],
                 tmp_path)
    try:
        standby = wait_ready(tmp_path / "standby.json", proc, 120)
        pids = {p["peer_id"]: p["pid"] for p in testnet["peers"]} | {standby["peer_id"]: proc.pid}

        async def main():
            async with head_node([testnet["bootstrap"]]) as (node, legs):
                async with open_route_client(node, legs, swarm_of(node, MODEL, 5), max_len=256) as client:
                    backend = KillOnTree(store.load_head(), client, timeout_s=60, pids=pids)
                    drafter = ModelDrafter(noisy_draft, SamplingParams())
                    cfg = GenerationConfig(mode="sd", max_new_tokens=N_NEW, tree_nodes=12)
                    result = await HeadEngine(backend, drafter, cfg).run(prompt)
                    return result, backend, list(client.events)

        result, backend, events = trio.run(main)
    finally:
        stop_processes([proc])
    assert backend.killed is not None and backend.replayed_tree
    assert len(events) == 1 and events[0].blamed == [backend.killed]
    assert result.tree_windows > 1  # trees went on after the failover
    assert result.tokens == hf_greedy(tiny_qwen2_hf, prompt, N_NEW)
