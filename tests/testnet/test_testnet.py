"""A real 3-peer testnet (separate daemon processes on loopback, tiny random Qwen2):
route inspection, exact logits through the ring, greedy generation in every mode equal to
HF generate, KV rollback on the peers, and a killed peer leaving the DHT."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import trio
from support.heads import generate_on, swarm_of
from support.models import hf_greedy, make_tiny_model
from support.processes import cli, cli_testnet, daemon
from transformers import AutoModelForCausalLM

from dsd.discovery.survey import survey
from dsd.node.head.config import GenerationConfig
from dsd.node.head.drafters import ModelDrafter, NgramDrafter
from dsd.node.head.engine import HeadEngine
from dsd.node.head.sampling import SamplingParams
from dsd.node.head.setup import HeadSetup
from dsd.node.peer.host import head_node
from dsd.node.route.backend import RouteBackend
from dsd.node.route.open import open_route_client
from dsd.node.route.session import open_route_session
from dsd.shard_store import Store

pytestmark = pytest.mark.network

MODEL = "tiny-qwen2"
RECORD_TTL_S = 6.0




@pytest.fixture(scope="module")
def testnet(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    state = tmp_path_factory.mktemp("testnet")
    up = cli("testnet", "up", "--store", str(tiny_qwen2_root / "store"), "--peers", "3", "--state", str(state),
             "--record-ttl", str(RECORD_TTL_S), "--json")
    assert up.returncode == 0, up.stderr[-3000:]
    info = json.loads(up.stdout)
    yield info
    down = cli("testnet", "down", "--state", str(state), timeout=60)
    assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def reference(tiny_qwen2_root: Path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()


def test_testnet_state_and_status(testnet: dict) -> None:
    peers = [p for p in testnet["peers"] if p["role"] == "block"]
    assert sorted((p["start"], p["end"]) for p in peers) == [(0, 2), (2, 4), (4, 5)]
    assert all(p["alive"] for p in testnet["peers"])
    assert all(p["started"] for p in testnet["peers"])  # what `down` checks before it signals a pid
    assert testnet["bootstrap"].startswith("/ip4/127.0.0.1/tcp/") and "/p2p/" in testnet["bootstrap"]


def test_down_signals_a_pid_only_when_its_start_time_is_the_recorded_one() -> None:
    """A pid from an old state may belong to another process by now: stop_processes leaves it alone unless the
    process started when the recorded one did (forked daemons share their parent's command line, so the start
    time is the check)."""
    import subprocess

    from dsd.node.testnet.processes import PeerProcess, pid_alive, process_start, stop_processes

    other = subprocess.Popen(["sleep", "60"])
    try:
        started = process_start(other.pid)
        assert started is not None
        stale = PeerProcess("peer0", other.pid, "", started=started - 1)
        assert stop_processes([stale], timeout_s=1) == {other.pid: "not running"}
        assert pid_alive(other.pid)
        ours = PeerProcess("peer0", other.pid, "", started=started)
        assert stop_processes([ours], timeout_s=10) == {other.pid: "terminated"}
        assert not pid_alive(other.pid)
    finally:
        other.kill()


def test_route_json_lists_every_peer_and_a_complete_route(testnet: dict) -> None:
    out = cli("route", "--bootstrap", testnet["bootstrap"], "--model", MODEL, "--json", timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    ids = {p["peer_id"]: (p["start"], p["end"]) for p in testnet["peers"] if p["role"] == "block"}
    assert {p["peer_id"]: (p["start"], p["end"]) for p in report["peers"]} == ids
    assert all(p["rtt_ms"] is not None and p["rtt_ms"] > 0 for p in report["peers"])
    assert report["coverage"] == [1, 1, 1, 1, 1]
    hops = report["route"]["hops"]
    assert [(h["start"], h["end"]) for h in hops] == [(0, 2), (2, 4), (4, 5)]
    assert report["missing_blocks"] == []


def test_ring_gives_the_whole_models_logits_with_truncate(testnet: dict, tiny_qwen2_root: Path, reference) -> None:
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    g = torch.Generator().manual_seed(7)
    seq = torch.randint(3, 300, (1, 26), generator=g)

    def embed(ids: torch.Tensor):
        with torch.no_grad():
            return head.embed(ids)[0].numpy()

    def logits(hidden) -> torch.Tensor:
        with torch.no_grad():
            return head.logits(torch.from_numpy(hidden).unsqueeze(0))[0]

    def full(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return reference(input_ids=ids).logits[0]

    async def main() -> None:
        async with head_node([testnet["bootstrap"]]) as (node, legs):
            view = await survey(node, MODEL, 5)
            assert view.plan is not None
            async with open_route_session(node, legs, list(view.plan.protocol_hops()), model=MODEL, max_len=64) as session:
                out = await session.forward(embed(seq[:, :20]), start=0, commit=0)
                assert torch.allclose(logits(out), full(seq[:, :20]), atol=1e-4)
                at = 20
                for size in (1, 3, 2):
                    out = await session.forward(embed(seq[:, at:at + size]), start=at, commit=at)
                    at += size
                    assert torch.allclose(logits(out), full(seq[:, :at])[-size:], atol=1e-4)
                # Roll back 3 tokens (rejected drafts) and append different ones.
                other = torch.tensor([[5, 6, 7, 8]])
                out = await session.forward(embed(other), start=at - 3, commit=at - 3)
                new_seq = torch.cat([seq[:, : at - 3], other], dim=1)
                assert torch.allclose(logits(out), full(new_seq)[-4:], atol=1e-4)
                # An explicit Truncate is acknowledged by the last peer with the new length.
                assert await session.truncate(10) == 10
                out = await session.forward(embed(seq[:, 10:12]), start=10, commit=None)
                assert torch.allclose(logits(out), full(seq[:, :12])[-2:], atol=1e-4)

    trio.run(main)


@pytest.mark.parametrize("drafter_kind", ["self", "random", "ngram"])
def test_greedy_generation_over_the_swarm_equals_hf(testnet: dict, tiny_qwen2_root: Path, reference, drafter_kind: str) -> None:
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    prompts = [[1, 17, 42, 99, 5, 17, 42, 99], [1, 250, 3, 3, 3, 3, 8]]
    n = 20

    def drafter():
        if drafter_kind == "self":
            return ModelDrafter(store.load_full(), SamplingParams())
        if drafter_kind == "random":
            return ModelDrafter(make_tiny_model("qwen2", seed=99, layers=2), SamplingParams())
        return NgramDrafter()

    async def main() -> None:
        async with head_node([testnet["bootstrap"]]) as (node, legs):
            for prompt in prompts:
                expected = hf_greedy(reference, prompt, n)
                for mode in ("ar", "sd", "dsd"):
                    setup = HeadSetup(head, MODEL, 5, None if mode == "ar" else drafter())
                    report = await generate_on(node, legs, setup, prompt, GenerationConfig(mode=mode, max_new_tokens=n))
                    assert report.tokens == expected, (mode, drafter_kind, prompt)
                    assert report.transport.bytes_sent > 0 and report.transport.bytes_received > 0
                    if mode == "ar":
                        assert report.result.rounds == n
                    elif drafter_kind == "self":
                        assert report.result.acceptance_rate == 1.0 and report.result.rounds < n

    trio.run(main)


def test_peers_kv_equals_committed_length_after_rejections(testnet: dict, tiny_qwen2_root: Path, reference) -> None:
    """After a generation full of rejections, the peers' caches hold exactly the committed prefix:
    a window at the committed length gives the whole model's next-token logits, and afterwards the
    peers' KV length is exactly committed + 1 (a window claiming another start is refused).
    The epoch is set past the engine's (it bumps the epoch at every rejection)."""
    store = Store(tiny_qwen2_root / "store")
    head = store.load_head()
    prompt = [1, 17, 42, 99, 5]

    async def main() -> None:
        async with head_node([testnet["bootstrap"]]) as (node, legs):
            view = await survey(node, MODEL, 5)
            async with open_route_client(node, legs, swarm_of(node, MODEL, 5), max_len=128, hops=list(view.plan.protocol_hops())) as client:
                session = client.session
                backend = RouteBackend(head, client)
                drafter = ModelDrafter(make_tiny_model("qwen2", seed=5, layers=2), SamplingParams())
                result = await HeadEngine(backend, drafter, GenerationConfig(mode="dsd", max_new_tokens=16, gamma=4)).run(prompt)
                assert result.drafted > result.accepted  # rejections happened
                committed = len(prompt) + len(result.tokens) - 1
                # Peers hold at least `committed` entries (the last window may have appended drafts).
                with torch.no_grad():
                    h = head.embed(torch.tensor([[result.tokens[-1]]]))[0].numpy()
                out = await session.forward(h, start=committed, commit=committed, epoch=10_000)
                whole = prompt + result.tokens
                with torch.no_grad():
                    want = reference(input_ids=torch.tensor([whole])).logits[0, -1]
                    got = head.logits(torch.from_numpy(out).unsqueeze(0))[0, -1]
                assert torch.allclose(got, want, atol=1e-4)
                # Now the KV length is exactly committed + 1: a window claiming another start is refused.
                from dsd.node.route.errors import RouteError

                with pytest.raises(RouteError, match="starts at"):
                    await session.forward(h, start=committed, commit=None, epoch=10_000, timeout=30)

    trio.run(main)


def test_prompt_longer_than_a_peer_window_is_sent_in_chunks(testnet: dict, tiny_qwen2_root: Path, reference) -> None:
    """Peers accept at most 256 tokens per window; a 300-token prompt must still work."""
    store = Store(tiny_qwen2_root / "store")
    prompt = torch.randint(3, 300, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = hf_greedy(reference, prompt, 6)

    async def main():
        async with head_node([testnet["bootstrap"]]) as (node, legs):
            setup = HeadSetup(store.load_head(), MODEL, 5, NgramDrafter())
            return await generate_on(node, legs, setup, prompt, GenerationConfig(mode="dsd", max_new_tokens=6))

    assert trio.run(main).tokens == expected


def test_generate_cli_streams_text_and_reports_json(testnet: dict, tiny_qwen2_root: Path, reference) -> None:
    store = str(tiny_qwen2_root / "store")
    prompt = [1, 17, 42, 99, 5, 17, 42, 99]
    expected = hf_greedy(reference, prompt, 12)
    common = ["generate", "--bootstrap", testnet["bootstrap"], "--store", store, "--draft", "ngram",
              "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "12", "--mode", "dsd"]
    out = cli(*common, "--json", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["tokens"] == expected
    for key in ("mode", "text", "new_tokens", "elapsed_s", "tokens_per_s", "rounds", "mean_accepted",
                "acceptance_rate", "bytes_sent", "bytes_received", "route", "time_breakdown", "failovers",
                "drafted", "accepted", "ready_rounds", "ready_share", "windows_after_prefill", "tokens_per_trip"):
        assert key in report, key
    assert set(report["time_breakdown"]) >= {"drafting_s", "waiting_s", "verifying_s", "drafting_hidden_used_s",
                                             "drafting_hidden_wasted_s", "drafting_exposed_s"}
    assert report["accepted"] <= report["drafted"]
    assert report["ready_rounds"] <= report["windows_after_prefill"] <= report["rounds"]
    plain = cli(*common, timeout=180)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.strip() == report["text"].strip()
    assert "tok/s" in plain.stderr


def test_killed_peer_leaves_the_dht_and_route_names_missing_blocks(testnet: dict) -> None:
    victim = next(p for p in testnet["peers"] if p["role"] == "block" and (p["start"], p["end"]) == (2, 4))
    os.kill(victim["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    deadline = killed_at + RECORD_TTL_S + 20
    report = None
    while time.monotonic() < deadline:
        out = cli("route", "--bootstrap", testnet["bootstrap"], "--model", MODEL, "--num-layers", "5", "--json", timeout=120)
        report = json.loads(out.stdout)
        if victim["peer_id"] not in {p["peer_id"] for p in report["peers"]}:
            break
        time.sleep(1)
    assert report is not None
    assert victim["peer_id"] not in {p["peer_id"] for p in report["peers"]}, "dead peer still announced"
    assert out.returncode == 1
    assert report["route"] is None
    assert report["missing_blocks"] == [2, 3]
    assert "2" in report["error"] and "3" in report["error"]


def test_generate_without_a_span_says_why_in_the_log_and_the_json(testnet: dict, tiny_qwen2_root: Path) -> None:
    """After the kill above, nobody serves blocks 2-3: the head waits its bounded time for them, then fails
    with the verdict, the missing blocks and the wait in its log, and the same in `--json`."""
    out = cli("generate", "--bootstrap", testnet["bootstrap"], "--store", str(tiny_qwen2_root / "store"),
              "--prompt-ids", "1,17,42,99", "--max-new-tokens", "4", "--mode", "ar", "--hole-wait-s", "4", "--json",
              timeout=180)
    assert out.returncode == 1, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["tokens"] == [] and report["failure"]["verdict"] == "no_route"
    assert report["failure"]["missing_blocks"] == [2, 3]
    assert "after waiting 4 s for peers to serve them" in report["error"]
    assert "generation failed after 0 tokens (no_route)" in out.stderr and "blocks 2-3" in out.stderr
    assert re.search(r"blocks 2-3 .*; waiting up to \d+ s more for the swarm's records", out.stderr), out.stderr[-2000:]


def test_blocks_auto_fills_the_gap(testnet: dict, tiny_qwen2_root: Path, tmp_path: Path) -> None:
    """After the kill above, blocks 2-3 are uncovered: a peer started with `--blocks auto` serves them."""
    from dsd.node.testnet.processes import stop_processes, wait_ready

    proc = daemon("auto", ["start", "--store", str(tiny_qwen2_root / "store"), "--blocks", "auto", "--num-blocks", "2",
                          "--bootstrap", testnet["bootstrap"], "--identity", str(tmp_path / "auto.key"),
                          "--ready-file", str(tmp_path / "auto.json"), "--threads", "1", "--record-ttl", "6"], tmp_path)
    try:
        info = wait_ready(tmp_path / "auto.json", proc, 120)
        assert (info["start"], info["end"]) == (2, 4)
        out = cli("route", "--bootstrap", testnet["bootstrap"], "--model", MODEL, "--num-layers", "5", "--json", timeout=120)
        report = json.loads(out.stdout)
        assert out.returncode == 0 and report["missing_blocks"] == []
        assert info["peer_id"] in [h["peer_id"] for h in report["route"]["hops"]]
    finally:
        stop_processes([proc])


def test_testnet_up_serves_the_default_q4k_target_without_a_store(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`testnet up` without --store serves the default target as `models prepare` makes it, q4k, its peers started
    with --weights q4k; where only a float32 store was prepared it says so and what to run, and never uses it."""
    from support.gguf_files import write_q4k_gguf

    from dsd.shard_store import convert
    from dsd.shard_store.default_models import TARGET, store_path

    cache = tmp_path / "cache"
    monkeypatch.setenv("DSD_CACHE", str(cache))
    gguf = write_q4k_gguf(tmp_path / "tiny.gguf", layers=2)
    convert(gguf, store_path(TARGET, cache, "fp32"), model_id=TARGET.model_id)
    refused = cli("testnet", "up", "--state", str(tmp_path / "none"), "--peers", "2")
    assert refused.returncode == 2
    assert ("the default target is not prepared as q4k" in refused.stderr
            and "(prepared here already: float32): run `dsd-node models prepare`" in refused.stderr), refused.stderr
    convert(gguf, store_path(TARGET, cache), model_id=TARGET.model_id, weights="q4k")
    state = tmp_path / "tn"
    with cli_testnet(state, "--peers", "2", "--record-ttl", "10") as net:
        peers = [p for p in net["peers"] if p["role"] == "block"]
        assert [(p["start"], p["end"]) for p in peers] == [(0, 1), (1, 2)]
        ready = [json.loads(p.read_text()) for p in sorted((state / "ready").glob("peer*.json"))]
        assert {(r["weights"], r["dtype"]) for r in ready} == {("q4k", "bfloat16")}
        assert net["model"] == TARGET.model_id and net["store"] == str(store_path(TARGET, cache))
