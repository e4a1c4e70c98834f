"""`dsd-node start --metrics-port`: a real peer's Prometheus endpoint, scraped over HTTP.

A peer serving all 5 layers of the tiny Qwen2 with `--metrics-port 0`: hand-made windows of
known sizes through a real session (the open-session and KV gauges while it runs, one forward
step observation per window in its size's bucket, bytes both ways), then a `dsd-node generate`
through the peer, then a malformed frame and a refused open, each counted by its error code.
A federated worker counts the same way (a `generate --federated` through it, a refused open).
A port already in use ends `start` with one line.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families
from support.frames import raw_exchange
from support.processes import DaemonSwarm, cli

from dsd.node.peer.host import head_node
from dsd.node.route.session import open_route_session
from dsd.protocol import Error, Hop, OpenSession, encode
from dsd.protocol.ids import FEDERATED_PROTOCOL, INFER_PROTOCOL
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(240)]

MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def net(tmp_path_factory: pytest.TempPathFactory):
    with DaemonSwarm(tmp_path_factory.mktemp("peer_metrics")) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def peer(net: DaemonSwarm, tiny_qwen2_root: Path) -> dict:
    """One peer serving blocks 0:5 with its metrics on a free loopback port."""
    return net.peer("peer", tiny_qwen2_root / "store", "0:5", "--max-len", "512", "--kv-budget", "2000",
                    "--metrics-port", "0")


@pytest.fixture(scope="module")
def worker(net: DaemonSwarm, tiny_qwen2_root: Path) -> dict:
    """A federated worker holding the whole tiny Qwen2, with its metrics on a free loopback port."""
    info = net.start("worker", "--federated", "--store", str(tiny_qwen2_root / "store"), "--bootstrap", net.bootstrap,
                     "--threads", "1", "--kv-budget", "3000", "--metrics-port", "0")
    return {**info, "bootstrap": net.bootstrap}


def scrape(url: str) -> dict[str, float]:
    """Every sample of the peer's endpoint as {"name{label=value,...}": value}."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def forward_counts(samples: dict[str, float]) -> dict[str, float]:
    """Forward step observations by window bucket."""
    prefix = "dsd_peer_forward_step_seconds_count{window="
    return {k[len(prefix):-1]: v for k, v in samples.items() if k.startswith(prefix)}


def test_metrics_count_sessions_windows_bytes_and_kv(peer: dict, tiny_qwen2_root: Path) -> None:
    url = peer["metrics_url"]
    assert urlsplit(url).hostname == "127.0.0.1" and urlsplit(url).path == "/metrics"  # loopback by default
    assert httpx.get(url.replace("/metrics", "/other"), timeout=10).status_code == 404
    before = scrape(url)
    assert before["dsd_peer_sessions_open"] == 0 and before["dsd_peer_sessions_opened_total"] == 0
    assert before["dsd_peer_kv_budget_tokens"] == 2000 and forward_counts(before) == {}

    head = Store(tiny_qwen2_root / "store").load_head()
    hops = [Hop(peer["peer_id"], tuple(peer["addrs"]), 0, 5)]
    during: dict[str, float] = {}

    def embed(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return head.embed(torch.tensor([ids]))[0].numpy()

    async def main() -> None:
        async with head_node([peer["bootstrap"]]) as (node, legs):
            async with open_route_session(node, legs, hops, model=MODEL, max_len=48) as session:
                await session.forward(embed([1, 17, 42, 99, 5, 6]), start=0, commit=0)  # a window of 6
                await session.forward(embed([7]), start=6, commit=6)  # 1
                await session.forward(embed([8, 9, 10]), start=7, commit=7)  # 3
                during.update(await trio.to_thread.run_sync(scrape, url))

    trio.run(main)
    assert during["dsd_peer_sessions_open"] == 1
    assert during["dsd_peer_kv_tokens_reserved"] == 48 and during["dsd_peer_kv_tokens_used"] == 10
    assert forward_counts(during) == {"5-8": 1, "1": 1, "3-4": 1}
    assert during['dsd_peer_bytes_total{direction=in}'] > 10 * 64 * 4  # ten rows of float32 hidden states came in
    assert during['dsd_peer_bytes_total{direction=out}'] > 10 * 64 * 4  # and went out (to the head)

    gen = cli("generate", "--bootstrap", peer["bootstrap"], "--store", str(tiny_qwen2_root / "store"),
              "--prompt-ids", "1,17,42,99,5,6,7,8", "--max-new-tokens", "12", "--threads", "1", "--json")
    assert gen.returncode == 0, gen.stderr[-3000:]
    report = json.loads(gen.stdout)
    after = scrape(url)
    assert after["dsd_peer_sessions_open"] == 0 and after["dsd_peer_kv_tokens_used"] == 0
    assert after["dsd_peer_kv_tokens_reserved"] == 0
    assert after["dsd_peer_sessions_opened_total"] == 2
    windows = sum(forward_counts(after).values()) - 3
    assert windows >= report["rounds"] >= 1, (forward_counts(after), report["rounds"])
    assert forward_counts(after)["5-8"] >= 2  # the generation's 8-token prompt
    for direction in ("in", "out"):
        key = f"dsd_peer_bytes_total{{direction={direction}}}"
        assert after[key] > during[key]
    assert not any(k.startswith("dsd_peer_errors_total") for k in after), after


def test_errors_are_counted_by_code(peer: dict) -> None:
    url = peer["metrics_url"]
    before = scrape(url)
    answers: list = []

    async def main() -> None:
        async with head_node([peer["bootstrap"]]) as (node, _legs):
            answers.extend(await raw_exchange(node, peer, INFER_PROTOCOL, b"\xff\xff\xff\xff" + b"x" * 16))  # a 4 GiB header
            head_hop = Hop(node.peer_id, tuple(node.addrs), 0, 0)
            answers.extend(await raw_exchange(node, peer, INFER_PROTOCOL, encode(OpenSession(
                "s1", "other-model", 0, 5, 16, (head_hop,)))))

    trio.run(main)
    assert [type(a) for a in answers] == [Error, Error], answers
    bad_frame, refused = answers
    assert (bad_frame.code, refused.code) == ("bad_frame", "bad_request"), answers
    after = scrape(url)

    def grew(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)

    assert grew("dsd_peer_errors_total{code=bad_frame}") == 1
    assert grew("dsd_peer_errors_total{code=bad_request}") == 1
    assert grew("dsd_peer_sessions_refused_total{code=bad_request}") == 1
    assert grew("dsd_peer_sessions_opened_total") == 0 and after["dsd_peer_sessions_open"] == 0


def test_metrics_port_out_of_range_is_refused(tiny_qwen2_root: Path, tmp_path: Path) -> None:
    r = cli("start", "--store", str(tiny_qwen2_root / "store"), "--identity", str(tmp_path / "k.key"),
            "--metrics-port", "70000", timeout=60)
    assert r.returncode == 2 and "--metrics-port must be in 0..65535" in r.stderr, r.stderr


def test_a_federated_worker_counts_sessions_windows_bytes_and_refusals(worker: dict,
                                                                       tiny_qwen2_draft_store: Path) -> None:
    url = worker["metrics_url"]
    before = scrape(url)
    assert before["dsd_peer_sessions_opened_total"] == 0 and before["dsd_peer_kv_budget_tokens"] == 3000
    gen = cli("generate", "--federated", "--bootstrap", worker["bootstrap"], "--store", str(tiny_qwen2_draft_store),
              "--workers", worker["peer_id"], "--prompt-ids", "1,17,42,99,5,6,7,8", "--max-new-tokens", "12",
              "--mode", "sd", "--threads", "1", "--json")
    assert gen.returncode == 0, gen.stderr[-3000:]
    answered = json.loads(gen.stdout)["workers"][0]["windows_answered"]
    after = scrape(url)
    assert after["dsd_peer_sessions_opened_total"] == 1
    assert after["dsd_peer_sessions_open"] == 0 and after["dsd_peer_kv_tokens_used"] == 0
    assert sum(forward_counts(after).values()) - sum(forward_counts(before).values()) == answered >= 1
    assert forward_counts(after).get("5-8", 0) >= 1  # the 8-token prompt went as one window
    for direction in ("in", "out"):
        assert after[f"dsd_peer_bytes_total{{direction={direction}}}"] > before[f"dsd_peer_bytes_total{{direction={direction}}}"]

    async def refused() -> list:
        async with head_node([worker["bootstrap"]]) as (node, _legs):
            return await raw_exchange(node, worker, FEDERATED_PROTOCOL, encode(OpenSession("s9", "other-model", 0, 5, 16, ())))

    (answer,) = trio.run(refused)
    assert isinstance(answer, Error) and answer.code == "bad_request", answer
    last = scrape(url)
    assert last.get("dsd_peer_sessions_refused_total{code=bad_request}", 0) == 1
    assert last.get("dsd_peer_errors_total{code=bad_request}", 0) == 1
    assert last["dsd_peer_sessions_opened_total"] == 1


def test_a_metrics_port_in_use_ends_start_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = cli("start", "--bootstrap-only", "--identity", str(tmp_path / "k.key"), "--metrics-port", str(port),
                  timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr and "ExceptionGroup" not in out.stderr, out.stderr
    assert lines == [f"dsd-node: --metrics-port {port}: cannot listen on http://127.0.0.1:{port}: Address already in use"]
