"""Federated mode over real worker processes on loopback (`testnet up --federated`, two different
tiny Qwen2 models sharing a vocabulary): the workers listing, K = V greedy output equal to greedy
decoding of the weighted average of the workers' full distributions, the CLI's --json report,
refused vocabularies, a stopped worker left out after its deadlines, and a killed worker."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import trio
from support.federated import average_greedy, run_federated
from support.models import TINY_VOCAB
from support.processes import cli

from dsd.node.federated.pool import FederatedError, WorkerInfo, list_workers
from dsd.node.head.config import GenerationConfig
from dsd.node.peer.host import head_node

pytestmark = pytest.mark.network

V = TINY_VOCAB
PROMPTS = [[1, 17, 42, 99, 5, 17, 42], [1, 250, 3, 3, 8, 9]]




def test_testnet_starts_workers_and_workers_lists_them(federated_net: dict) -> None:
    assert [(w["start"], w["end"]) for w in (federated_net["a"], federated_net["b"])] == [(0, 5), (0, 3)]
    out = cli("workers", "--bootstrap", federated_net["bootstrap"], "--vocab", str(V), "--json", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    listed = {w["peer_id"]: w for w in json.loads(out.stdout)["workers"]}
    assert set(listed) == {federated_net["a"]["peer_id"], federated_net["b"]["peer_id"]}
    assert listed[federated_net["a"]["peer_id"]]["model"] == "tiny-qwen2"
    assert listed[federated_net["b"]["peer_id"]]["model"] == "tiny-qwen2-b"
    assert all(w["vocab_size"] == V and w["topk_cap"] == V and w["rtt_ms"] > 0 for w in listed.values())

    async def by_model() -> list[dict]:
        async with head_node([federated_net["bootstrap"]]) as (node, _):
            return await list_workers(node, model="tiny-qwen2-b", vocab=None)

    only_b = trio.run(by_model)
    assert [(w["peer_id"], w["num_layers"]) for w in only_b] == [(federated_net["b"]["peer_id"], 3)]


@pytest.mark.parametrize("mode", ["sd", "dsd"])
def test_k_equal_v_greedy_is_greedy_decoding_of_the_weighted_average(federated_net: dict, federated_models, mode: str) -> None:
    n, weights = 16, (0.7, 0.3)
    for prompt in PROMPTS:
        report = run_federated(federated_net, prompt, GenerationConfig(mode=mode, max_new_tokens=n, gamma=3), top_k=V, weights=weights)
        assert report["tokens"] == average_greedy(federated_models, prompt, n, weights), (mode, prompt)
        assert report["missed"] == 0 and report["dropped"] == 0
        for w in report["workers"]:
            assert w["state"] == "active" and w["k"] == V and abs(w["mean_eps"]) < 1e-5
            assert w["windows_answered"] == report["windows"] == report["rounds"]
        assert {w["model"] for w in report["workers"]} == {"tiny-qwen2", "tiny-qwen2-b"}


def test_cli_generate_federated_reports_bytes_eps_and_k(federated_net: dict, tiny_qwen2_draft_store: Path) -> None:
    out = cli("generate", "--federated", "--bootstrap", federated_net["bootstrap"], "--store", str(tiny_qwen2_draft_store),
              "--prompt-ids", "1,17,42,99,5", "--max-new-tokens", "10", "--topk", "8", "--reconstruct", "renormalize",
              "--worker-weights", "2,1", "--workers", f"{federated_net['a']['peer_id']},{federated_net['b']['peer_id']}", "--json", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["new_tokens"] == 10 and report["federated"] and report["reconstruct"] == "renormalize"
    assert [w["weight"] for w in report["workers"]] == [2.0, 1.0]
    for w in report["workers"]:
        assert w["k"] == 8 and 0 < w["mean_eps"] < 1 and w["windows_missed"] == 0
        # 8 fp32 probabilities + varint ids + framing per row: far below the 1200-byte fp32 distribution
        assert w["bytes_per_row"] < report["full_distribution_bytes_per_row"] / 4
    assert report["uplink_bytes_per_token"] > 0


def test_mismatched_vocabularies_are_refused(federated_net: dict) -> None:
    with pytest.raises(FederatedError, match="has a vocabulary of 300 tokens, the server's has 301"):
        run_federated(federated_net, PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=4), server_vocab=301)
    # A worker whose record was wrong is still caught by its Hello when the session opens.
    forged = [WorkerInfo(federated_net["a"]["peer_id"], (federated_net["a"]["multiaddr"],), 5, 301, 301)]
    with pytest.raises(FederatedError, match="vocabulary mismatch: model 'tiny-qwen2' has 300 tokens, the server's has 301"):
        run_federated(federated_net, PROMPTS[0], GenerationConfig(mode="sd", max_new_tokens=4), server_vocab=301, workers=forged)


def _fault_run(federated_net: dict, federated_models, sig: signal.Signals, timeout_s: float):
    prompt, n, weights = PROMPTS[0], 14, (0.5, 0.5)
    emitted: list[int] = []
    switched: list[int] = []

    def on_tokens(toks: list[int]) -> None:  # runs between windows: every later window is sent after the fault
        emitted.extend(toks)
        if not switched and len(emitted) >= 4:
            os.kill(federated_net["b"]["pid"], sig)
            switched.append(len(emitted))

    report = run_federated(federated_net, prompt, GenerationConfig(mode="dsd", max_new_tokens=n, gamma=3), top_k=V, weights=weights,
                 window_timeout_s=timeout_s, on_tokens=on_tokens)
    assert len(report["tokens"]) == n
    # Tokens up to the fault follow the average, every later window worker A alone.
    assert report["tokens"] == average_greedy(federated_models, prompt, n, weights, switch_at=switched[0])
    return report


def test_stopped_worker_misses_deadlines_and_is_dropped(federated_net: dict, federated_models) -> None:
    try:
        report = _fault_run(federated_net, federated_models, signal.SIGSTOP, timeout_s=1.5)
    finally:
        os.kill(federated_net["b"]["pid"], signal.SIGCONT)
    a, b = report["workers"]
    assert a["state"] == "active" and a["windows_missed"] == 0
    assert b["windows_missed"] == 3 and b["state"] == "dropped" and "3 window deadlines" in b["reason"]
    assert report["missed"] == 3 and report["dropped"] == 1


def test_killed_worker_generation_completes_on_the_other(federated_net: dict, federated_models) -> None:
    report = _fault_run(federated_net, federated_models, signal.SIGKILL, timeout_s=60.0)
    a, b = report["workers"]
    assert a["state"] == "active" and b["state"] == "failed" and report["dropped"] == 1
    assert report["elapsed_s"] < 30  # a dead stream is noticed at once, not at the 60 s deadline
