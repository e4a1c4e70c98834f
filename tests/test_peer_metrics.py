"""`dsd-node start --metrics-port`: a real block peer's Prometheus endpoint, scraped over HTTP.

A peer serving all 5 layers of the tiny Qwen2 with `--metrics-port 0`: hand-made windows of
known sizes through a real session (the open-session and KV gauges while it runs, one forward
step observation per window in its size's bucket, bytes both ways), then a `dsd-node generate`
through the peer, then a malformed frame and a refused open, each counted by its error code.
"""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import pytest
import torch
import trio
from prometheus_client.parser import text_string_to_metric_families

from conftest import cli
from dsd.node.peer.host import head_node
from dsd.node.route.session import open_route_session
from dsd.node.testnet.processes import spawn, stop_processes, wait_ready
from dsd.protocol import Error, FrameDecoder, Hop, OpenSession, encode
from dsd.protocol.ids import INFER_PROTOCOL
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(240)]

MODEL = "tiny-qwen2"


@pytest.fixture(scope="module")
def peer(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A bootstrap node and one peer serving blocks 0:5 with its metrics on a free loopback port."""
    state = tmp_path_factory.mktemp("peer_metrics")
    boot = spawn("bootstrap", ["start", "--bootstrap-only", "--identity", str(state / "boot.key"),
                               "--ready-file", str(state / "boot.json")], state)
    procs = [boot]
    try:
        binfo = wait_ready(state / "boot.json", boot, 120)
        p = spawn("peer", ["start", "--store", str(tiny_qwen2_root / "store"), "--blocks", "0:5",
                           "--bootstrap", binfo["addrs"][0], "--identity", str(state / "peer.key"),
                           "--ready-file", str(state / "peer.json"), "--threads", "1", "--max-len", "512",
                           "--kv-budget", "2000", "--metrics-port", "0"], state)
        procs.append(p)
        info = wait_ready(state / "peer.json", p, 120)
        yield {"bootstrap": binfo["addrs"][0], "peer_id": info["peer_id"], "addrs": info["addrs"],
               "metrics_url": info["metrics_url"], "log": p.log}
    finally:
        stop_processes([x.pid for x in reversed(procs)])


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


async def raw_exchange(node, peer: dict, data: bytes) -> list:
    """Write raw bytes on a fresh infer stream; the frames answered before the stream closed."""
    stream = await node.open_raw(peer["peer_id"], peer["addrs"], INFER_PROTOCOL)
    decoder, got = FrameDecoder(), []
    with trio.fail_after(20):
        await stream.write(data)
        while True:
            try:
                chunk = await stream.read(65536)
            except Exception:
                break
            if not chunk:
                break
            got.extend(decoder.feed(chunk))
    return got


def test_errors_are_counted_by_code(peer: dict) -> None:
    url = peer["metrics_url"]
    before = scrape(url)
    answers: list = []

    async def main() -> None:
        async with head_node([peer["bootstrap"]]) as (node, _legs):
            answers.extend(await raw_exchange(node, peer, b"\xff\xff\xff\xff" + b"x" * 16))  # a 4 GiB frame header
            head_hop = Hop(node.peer_id, tuple(node.addrs), 0, 0)
            answers.extend(await raw_exchange(node, peer, encode(OpenSession("s1", "other-model", 0, 5, 16,
                                                                             (head_hop,)))))

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
