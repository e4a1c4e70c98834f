"""The swarm page of `dsd-node serve`, loaded in a real headless Chromium against a live 2-peer testnet.

Chromium (Debian's `chromium` package) runs the page's JavaScript, which polls `/api/swarm`;
the DOM it dumps must show every peer (short id, as displayed), the route, the coverage and the
last request's statistics. A screenshot is saved outside the repository and its path printed.
Then a peer stops: after the next survey the page shows it dead and the layers it leaves
uncovered. Without chromium the test fails in CI (CI=true) and is skipped elsewhere.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from support.page import Dom, cell, chromium_or_skip, page_until, run_chromium
from support.processes import cli_serve, cli_testnet

from dsd.node.testnet.processes import PeerProcess, stop_processes

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
KEY = "sk-page-test"
SHORT = 12  # the page shows the last 12 characters of a peer id (as `dsd-node route` does)


@pytest.fixture(scope="module")
def chromium() -> str:
    return chromium_or_skip()


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_store: Path, tmp_path_factory: pytest.TempPathFactory):
    with cli_testnet(tmp_path_factory.mktemp("page_net"), "--store", str(tiny_qwen2_store), "--peers", "2") as net:
        yield net


@pytest.fixture(scope="module")
def server(swarm: dict, tiny_qwen2_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """`dsd-node serve` with an API key, surveying every second (the page shows a stopped peer soon)."""
    state = tmp_path_factory.mktemp("page_serve")
    (state / "key").write_text(KEY + "\n")
    with cli_serve(state, swarm["bootstrap"], tiny_qwen2_store, "--api-key", str(state / "key"),
                   "--refresh", "1") as info:
        yield info


def block_peers(swarm: dict) -> list[dict]:
    return [p for p in swarm["peers"] if p["role"] == "block"]


def test_page_shows_peers_route_coverage_and_requests(chromium: str, server: dict, swarm: dict,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    url = server["url"] + "/"
    peers = sorted(block_peers(swarm), key=lambda p: p["start"])
    shorts = {p["peer_id"][-SHORT:]: p for p in peers}
    # the API needs the key, the page and its JSON do not
    assert httpx.get(server["url"] + "/v1/models", timeout=10).status_code == 401
    assert httpx.get(server["url"] + "/api/swarm", timeout=10).status_code == 200
    done = httpx.post(server["url"] + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                      json={"model": MODEL, "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0})
    assert done.status_code == 200, done.text
    rid = done.json()["id"]

    profile = tmp_path_factory.mktemp("chromium")
    dom = page_until(chromium, profile, url, lambda d: len(d.with_class("peer")) == len(peers)
                     and len(d.with_class("request")) >= 1)
    assert next(e for e in dom.elements if e["tag"] == "body")["attrs"].get("data-ready") == "yes"
    cells = dom.with_class("peer-id")
    assert sorted(dom.text(c) for c in cells) == sorted(shorts), [dom.text(c) for c in cells]
    assert {c["attrs"]["title"] for c in cells} == {p["peer_id"] for p in peers}  # the full id on hover
    assert [dom.text(e) for e in dom.with_class("alive")] == ["alive"] * len(peers)
    assert [dom.text(e) for e in dom.with_class("reach")] == ["public"] * len(peers)  # AutoNAT dialled them back
    loads = [dom.text(e) for e in dom.with_class("load")]  # what each peer announces of its load
    assert len(loads) == len(peers) and all(re.fullmatch(r"\d+ % busy · [\d.]+ rows/step( · \d+ queued)?", t)
                                           for t in loads), loads
    route = dom.by_id("route")
    want = " → ".join(f"{p['peer_id'][-SHORT:]} [{p['start']}:{p['end']}]" for p in peers)
    assert f"head → {want} → head" in route, route
    assert [dom.text(e) for e in dom.with_class("layer")] == ["1"] * 5  # every layer covered once
    assert dom.by_id("model") == MODEL

    row = next(r for r in dom.with_class("request") if r["attrs"].get("data-id") == rid)
    stats = {cls: dom.text(cell(dom, row, cls)) for cls in ("tokens-per-s", "mean-accepted", "speedup")}
    assert float(stats["tokens-per-s"]) > 0 and float(stats["mean-accepted"]) >= 0, stats
    assert stats["speedup"].endswith("×") and float(stats["speedup"][:-1]) >= 1.0, stats

    shot = tmp_path_factory.mktemp("swarm_page") / "swarm-page.png"
    out = run_chromium(chromium, profile, url, "--window-size=1280,1000", f"--screenshot={shot}")
    assert out.returncode == 0 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", out.stderr[-2000:]
    print(f"\nswarm page screenshot: {shot}")


def test_page_shows_the_span_a_head_serves_itself(chromium: str, swarm: dict, tiny_qwen2_store: Path,
                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """`serve --blocks 0:3`: the ring is the head's own hop, then the peer serving 3:5 (the one for 0:3 is
    not needed); the page shows the head's lane and hop, and every layer covered once by the route."""
    last = next(p for p in block_peers(swarm) if p["start"] == 3)
    state = tmp_path_factory.mktemp("page_serve_local")
    with cli_serve(state, swarm["bootstrap"], tiny_qwen2_store, "--blocks", "0:3") as local:
        dom = page_until(chromium, tmp_path_factory.mktemp("chromium_local"), local["url"] + "/",
                         lambda d: "head [0:3]" in d.by_id("route"))
        route = dom.by_id("route")
        assert route.startswith(f"head [0:3] → {last['peer_id'][-SHORT:]} [3:5] → head"), route
        assert [dom.text(e) for e in dom.with_class("local")] == ["0:3", "head [0:3]"]  # its lane's bar, its hop
        assert [dom.text(e) for e in dom.with_class("layer")] == ["2", "2", "2", "1", "1"]  # the head and the 0:3 peer


def test_page_shows_a_stopped_peer_dead_and_its_layers_uncovered(chromium: str, server: dict, swarm: dict,
                                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    """Last: stops the peer serving blocks 3:5."""
    last = next(p for p in block_peers(swarm) if p["start"] == 3)
    stop_processes([PeerProcess.from_dict(last)])
    profile = tmp_path_factory.mktemp("chromium_dead")

    def shows_dead(dom: Dom) -> bool:
        return any(r["attrs"].get("data-peer") == last["peer_id"] and cell(dom, r, "dead") is not None
                   for r in dom.with_class("peer"))

    def shows_left(dom: Dom) -> bool:  # in the swarm changes: it withdrew its record on the way out
        return any(r["attrs"].get("data-peer") == last["peer_id"] for r in dom.with_class("left"))

    dom = page_until(chromium, profile, server["url"] + "/", lambda d: shows_dead(d) and shows_left(d))
    assert shows_dead(dom), [dom.text(r) for r in dom.with_class("peer")]
    assert shows_left(dom), [dom.text(r) for r in dom.with_class("change")]
    assert "3:5" in dom.text(next(r for r in dom.with_class("left") if r["attrs"]["data-peer"] == last["peer_id"]))
    assert [dom.text(e) for e in dom.with_class("layer")] == ["1", "1", "1", "0", "0"]
    assert "no complete route" in dom.by_id("route"), dom.by_id("route")
    shot = tmp_path_factory.mktemp("swarm_page_dead") / "swarm-page-dead-peer.png"
    out = run_chromium(chromium, profile, server["url"] + "/", "--window-size=1280,1000", f"--screenshot={shot}")
    assert out.returncode == 0 and shot.exists(), out.stderr[-2000:]
    print(f"\nswarm page with a stopped peer: {shot}")
    alive = [r for r in dom.with_class("peer") if cell(dom, r, "alive") is not None]
    assert [r["attrs"]["data-peer"] for r in alive] == [p["peer_id"] for p in block_peers(swarm) if p is not last]
