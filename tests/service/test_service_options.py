"""`dsd-node serve` with the options every head role takes, against real daemons on loopback (tiny random
Qwen2, 5 layers) that serve only layers 2:5:

- a co-located head (`--blocks 0:2`): the service serves layers 0:2 itself and its greedy completions
  equal HF greedy; the route has the two remote peers, `/api/swarm` and `/v1/models` show the ring
  with the head's own hop and count its layers in the coverage;
- no `--store` (`--model --manifest-sha256`): the head's files and its layers are fetched from the
  peers, exactly those, and the greedy completions are again HF's;
- `--federated` is refused in one line (a `--device` not there: see test_devices).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.models import hf_greedy
from support.processes import DaemonSwarm, cli, cli_serve
from transformers import AutoModelForCausalLM

from dsd.node.fetch.local import manifest_sha256
from dsd.node.fetch.plan import files_for
from dsd.shard_store import Store
from dsd.shard_store.manifest import layer_file

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
LAYERS = 5
PROMPT = [1, 17, 42, 99, 5, 17, 42, 99]
N_NEW = 16


@pytest.fixture(scope="module")
def swarm(tiny_qwen2_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """Peers for blocks 2:4 and 4:5 only: without a head serving 0:2 there is no route."""
    with DaemonSwarm(tmp_path_factory.mktemp("serve_options")) as net:
        store = tiny_qwen2_root / "store"
        peers = [net.peer("mid", store, "2:4", "--record-ttl", "6"), net.peer("last", store, "4:5", "--record-ttl", "6")]
        net.wait_route(MODEL, LAYERS, (2, LAYERS))
        yield net, peers


@pytest.fixture(scope="module")
def expected(tiny_qwen2_root: Path) -> tuple[str, int]:
    """HF greedy after PROMPT, cut at its end of sequence as the service stops there: (text, tokens)."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_root / "hf"), dtype=torch.float32).eval()
    tokens = hf_greedy(model, PROMPT, N_NEW)
    if 2 in tokens:  # the tiny models' eos id
        tokens = tokens[: tokens.index(2) + 1]
    tokenizer = Store(tiny_qwen2_root / "store").load_tokenizer()
    return tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def complete(server: dict, prompt: list[int] = PROMPT) -> dict:
    """A greedy completion of `prompt` (token ids) from the service."""
    r = httpx.post(server["url"] + "/v1/completions", timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": N_NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def ring(hops: list[dict]) -> list[tuple[int, int, bool]]:
    return [(h["start"], h["end"], h["local"]) for h in hops]


def test_a_head_serving_the_first_layers_completes_like_hf_and_shows_its_hop(
    swarm, tiny_qwen2_root: Path, expected: tuple[str, int], tmp_path: Path
) -> None:
    net, (mid, last) = swarm
    with cli_serve(tmp_path, net.bootstrap, tiny_qwen2_root / "store", "--blocks", "0:2") as server:
        assert server["blocks"] == [0, 2] and (server["device"], server["dtype"]) == ("cpu", "float32")
        body = complete(server)
        assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == expected
        stats = body["dsd"]
        assert stats["route"] == [mid["peer_id"], last["peer_id"]]  # one peer fewer than the ring's three hops
        assert ring(stats["hops"]) == [(0, 2, True), (2, 4, False), (4, 5, False)]
        assert stats["hops"][0]["peer_id"] == server["peer_id"]

        page = httpx.get(server["url"] + "/api/swarm", timeout=10).json()
        assert page["local"] == {"peer_id": server["peer_id"], "short_id": server["peer_id"][-12:], "start": 0, "end": 2}
        assert ring(page["route"]["hops"]) == [(0, 2, True), (2, 4, False), (4, 5, False)]
        assert page["route"]["hops"][0]["short_id"] == server["peer_id"][-12:]
        assert page["coverage"] == [1] * LAYERS and page["missing_blocks"] == [] and page["error"] is None
        assert {p["peer_id"] for p in page["peers"]} == {mid["peer_id"], last["peer_id"]}
        assert (page["service"]["device"], page["service"]["dtype"]) == ("cpu", "float32")

        (model,) = httpx.get(server["url"] + "/v1/models", timeout=30).json()["data"]
        assert model["dsd"]["local_blocks"] == [0, 2]
        assert ring(model["dsd"]["route"]) == [(0, 2, True), (2, 4, False), (4, 5, False)]

        # concurrent requests (head batching, the default): their windows through 0:2 run as joint steps, and each
        # gets what it gets alone
        prompts = [PROMPT, [1, 250, 3, 3, 3, 3, 8], PROMPT[:5], [1, 9, 9, 40]]
        alone = [complete(server, p)["choices"][0]["text"] for p in prompts]
        for _ in range(3):  # whether a step holds several windows depends on timing: a few rounds make it sure
            with ThreadPoolExecutor(len(prompts)) as pool:
                assert list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], prompts)) == alone
            text = httpx.get(server["url"] + "/metrics", timeout=10).text
            span = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                    if f.name.startswith("dsd_serve_joint") and s.labels.get("part") == "span"}
            if span["dsd_serve_joint_calls"] > span["dsd_serve_joint_runs"] > 0:
                break
        assert span["dsd_serve_joint_calls"] > span["dsd_serve_joint_runs"] > 0, span  # some steps held several


def test_a_head_without_a_store_fetches_its_files_from_the_peers(
    swarm, tiny_qwen2_root: Path, expected: tuple[str, int], tmp_path: Path
) -> None:
    net, _ = swarm
    store = tiny_qwen2_root / "store"
    sha = manifest_sha256(store)
    manifest = Store(store).manifest
    with cli_serve(tmp_path, net.bootstrap, None, "--model", MODEL, "--manifest-sha256", sha, "--blocks", "0:2",
                   "--fetch-dir", str(tmp_path / "fetched")) as server:
        fetched = Path(server["store"])
        assert fetched == tmp_path / "fetched" / MODEL / sha[:16]
        files = {str(f.relative_to(fetched)) for f in fetched.rglob("*") if f.is_file() and not f.name.startswith(".")}
        wanted = files_for(manifest, (0, 2), True)  # the head's files and layers 0-1, nothing else
        assert {layer_file(0), layer_file(1), *manifest.tokenizer_files} <= set(wanted)
        assert layer_file(2) not in wanted
        assert files == {"manifest.json", "fetched.json", *wanted}
        body = complete(server)
        assert (body["choices"][0]["text"], body["usage"]["completion_tokens"]) == expected
        assert ring(body["dsd"]["hops"])[0] == (0, 2, True)


def test_serve_refuses_federated_in_one_line(tiny_qwen2_root: Path) -> None:
    out = cli("serve", "--bootstrap", "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
              "--store", str(tiny_qwen2_root / "store"), "--federated", timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "generate --federated" in lines[0]
