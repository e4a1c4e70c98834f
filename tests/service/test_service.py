"""`dsd-node serve` against a real 2-peer testnet on loopback (tiny random Qwen2 with a chat template).

The service runs as a real `dsd-node serve` process; clients are the official `openai` client
and raw httpx. Checked: /v1/models, greedy completions and chat (whole and streamed) equal to
HF greedy, usage, stop strings, 8 concurrent streams against --max-concurrent 4 --queue 2,
a client that disconnects mid-stream (the peers' open-session gauges, scraped from their
`--metrics-port`, drop to zero), bad input as OpenAI error objects, the API key, /metrics, and 503 naming the blocks
a stopped peer leaves uncovered (last: it stops a peer of the shared testnet).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.models import hf_greedy, save_tiny_chat_model
from support.processes import cli_serve, cli_testnet
from transformers import AutoModelForCausalLM

from dsd.node.testnet.processes import PeerProcess, stop_processes, tail
from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
KEY = "sk-dsd-test-key"
PROMPT = "def add(a, b):"
MAX_CONCURRENT, QUEUE = 4, 2


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("service_model"), MODEL)


@pytest.fixture(scope="module")
def swarm(chat_root: Path, tmp_path_factory: pytest.TempPathFactory):
    with cli_testnet(tmp_path_factory.mktemp("service_net"), "--store", str(chat_root / "store"), "--peers", "2",
                     "--metrics") as net:
        yield net


@pytest.fixture(scope="module")
def server(swarm: dict, chat_root: Path, tiny_qwen2_draft_store: Path, tmp_path_factory: pytest.TempPathFactory):
    """`dsd-node serve` on a free port with an API key, a draft model and 5 ms added to every frame it sends; a
    request finding blocks unserved waits 10 s for them (not the default 60: the last test makes such a hole)."""
    state = tmp_path_factory.mktemp("service")
    (state / "key").write_text(KEY + "\n")
    with cli_serve(state, swarm["bootstrap"], chat_root / "store", "--draft", str(tiny_qwen2_draft_store),
                   "--api-key", str(state / "key"), "--max-concurrent", str(MAX_CONCURRENT), "--queue", str(QUEUE),
                   "--wan-latency-ms", "5", "--hole-wait-s", "10") as info:
        yield info


@pytest.fixture(scope="module")
def tokenizer(chat_root: Path):
    return Store(chat_root / "store").load_tokenizer()


@pytest.fixture(scope="module")
def reference(chat_root: Path, tokenizer):
    """greedy(ids, n) -> the HF model's greedy text after `ids` (cut at its EOS, as the service stops there)."""
    model = AutoModelForCausalLM.from_pretrained(str(chat_root / "hf"), dtype=torch.float32).eval()

    def greedy(ids: list[int], n: int) -> tuple[str, int]:
        toks = hf_greedy(model, ids, n)
        if tokenizer.eos_token_id in toks:
            toks = toks[: toks.index(tokenizer.eos_token_id) + 1]
        return tokenizer.decode(toks, skip_special_tokens=True), len(toks)

    return greedy


def client(server: dict, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=key, max_retries=0, timeout=60)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def block_peers(swarm: dict) -> list[dict]:
    return [p for p in swarm["peers"] if p["role"] == "block"]


def open_sessions(peer: dict) -> int:
    """Sessions a block peer holds now: its `dsd_peer_sessions_open` gauge (`testnet up --metrics`)."""
    text = httpx.get(peer["metrics_url"], timeout=10).text
    return int(next(f.samples[0].value for f in text_string_to_metric_families(text) if f.name == "dsd_peer_sessions_open"))


def metric_samples(server: dict) -> dict[str, list]:
    text = httpx.get(server["url"] + "/metrics", timeout=10).text
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def requests_by_status(samples: dict[str, list]) -> dict[str, float]:
    """`dsd_serve_requests_total` summed over endpoints, by HTTP status."""
    out: dict[str, float] = {}
    for s in samples["dsd_serve_requests"]:
        if s.name == "dsd_serve_requests_total":
            out[s.labels["status"]] = out.get(s.labels["status"], 0) + s.value
    return out


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_models_lists_the_model_with_its_peers(server: dict, swarm: dict) -> None:
    models = client(server).models.list().data
    assert [m.id for m in models] == [MODEL]
    dsd = models[0].model_extra["dsd"]
    assert sorted(p["peer_id"] for p in dsd["peers"]) == sorted(p["peer_id"] for p in block_peers(swarm))
    assert sorted(map(tuple, dsd["spans"])) == [(0, 3), (3, 5)]
    assert [(h["start"], h["end"]) for h in dsd["route"]] == [(0, 3), (3, 5)]


def test_greedy_completions_whole_and_streamed_equal_hf(server: dict, tokenizer, reference) -> None:
    ids = tokenizer(PROMPT)["input_ids"]
    want, n_tokens = reference(ids, 40)
    c = client(server)
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text == want
    assert whole.choices[0].finish_reason == ("length" if n_tokens == 40 else "stop")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        len(ids), n_tokens, len(ids) + n_tokens)
    dsd = whole.model_extra["dsd"]
    assert dsd["mode"] == "dsd" and dsd["rounds"] >= 1 and len(dsd["route"]) == 2 and dsd["failovers"] == 0

    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want
    assert all(ch.object == "text_completion" for ch in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert chunks[-1].model_extra["dsd"]["rounds"] == dsd["rounds"]  # the dsd statistics ride on the last chunk

    by_ids = c.completions.create(model=MODEL, prompt=ids, max_tokens=40, temperature=0)  # a prompt of token ids
    assert by_ids.choices[0].text == want


def test_greedy_chat_whole_and_streamed_equal_hf(server: dict, tokenizer, reference) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add two numbers"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want, n_tokens = reference(list(ids), 32)
    c = client(server)
    whole = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, seed=7)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == want
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), n_tokens)

    stream = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=32, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")  # no usage asked: the end chunk is the last
    assert chunks[-1].model_extra["dsd"]["mode"] == "dsd"


def test_stop_strings_end_the_text_before_them(server: dict, tokenizer, reference) -> None:
    full, _ = reference(tokenizer(PROMPT)["input_ids"], 40)
    # a stop string of plain characters that first occurs after a few characters of the greedy text
    at, stop = next((i, full[i:i + 2]) for i in range(4, len(full) - 2)
                    if full[i:i + 2].isascii() and full[i:i + 2].isprintable() and full.find(full[i:i + 2]) == i)
    c = client(server)
    whole = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never§"])
    assert whole.choices[0].text == full[:at] and whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens < 40
    streamed = [ch.choices[0].text for ch in c.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True) if ch.choices]
    assert "".join(streamed) == full[:at] and not any(stop in s for s in streamed)


def test_concurrent_streams_run_four_at_once_queue_two_and_refuse_the_rest(server: dict, tokenizer, reference) -> None:
    want, _ = reference(tokenizer(PROMPT)["input_ids"], 48)
    start = threading.Barrier(8)
    stop_polling = threading.Event()
    peak = {"running": 0, "queued": 0}

    def poll() -> None:
        while not stop_polling.is_set():
            samples = metric_samples(server)
            peak["running"] = max(peak["running"], int(samples["dsd_serve_active_sessions"][0].value))
            peak["queued"] = max(peak["queued"], int(samples["dsd_serve_queued_requests"][0].value))
            time.sleep(0.02)

    def one(_: int) -> tuple[str, object]:
        c = client(server)
        start.wait()
        try:
            chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                               stream=True))
        except openai.RateLimitError as exc:
            return "429", exc.body
        return "".join(ch.choices[0].text for ch in chunks if ch.choices), chunks[-1].model_extra["dsd"]

    before = requests_by_status(metric_samples(server))
    poller = threading.Thread(target=poll)
    poller.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
    finally:
        stop_polling.set()
        poller.join()
    refused = [body for text, body in results if text == "429"]
    served = [(text, dsd) for text, dsd in results if text != "429"]
    assert len(served) == MAX_CONCURRENT + QUEUE and len(refused) == 8 - MAX_CONCURRENT - QUEUE, results
    assert all(body["code"] == "rate_limit_exceeded" for body in refused)
    assert requests_by_status(metric_samples(server)).get("429", 0) - before.get("429", 0) == len(refused)
    assert all(text == want for text, _ in served)
    assert peak == {"running": MAX_CONCURRENT, "queued": QUEUE}
    waited = sorted(dsd["queued_s"] for _, dsd in served)
    assert max(waited[:MAX_CONCURRENT]) < 0.05 < min(waited[MAX_CONCURRENT:]), waited  # four ran at once, two waited


MIXED = [("def add(a, b):", 0.0, None), ("class Stack:\n    def push(self, x):", 0.8, 11),
         ("import os\n\ndef walk(path):\n    for", 0.8, 12), ("x = [", 0.0, None)]


def test_requests_drafting_together_get_what_they_get_alone(server: dict) -> None:
    """Head batching (the default): mixed prompts, greedy and seeded sampling, run one at a time and then four at
    once: every request's text is the same, and went through the joint draft forwards and lm_head calls."""

    def one(prompt: str, temperature: float, seed: int | None) -> str:
        extra = {} if seed is None else {"seed": seed}
        out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=temperature,
                                                **extra)
        return out.choices[0].text

    alone = [one(*req) for req in MIXED]
    before = metric_samples(server)
    start = threading.Barrier(len(MIXED))

    def together(req: tuple) -> str:
        start.wait()
        return one(*req)

    with ThreadPoolExecutor(len(MIXED)) as pool:
        assert list(pool.map(together, MIXED)) == alone
    after = metric_samples(server)

    def grew(name: str, part: str) -> float:
        def value(samples: dict) -> float:
            return next(s.value for s in samples[name] if s.labels["part"] == part)
        return value(after) - value(before)

    for part in ("draft", "lm_head"):  # every request went through the joint calls (whether a call held several
        # depends on timing here: tests/head/test_head_batching.py makes them)
        assert grew("dsd_serve_joint_calls", part) >= grew("dsd_serve_joint_runs", part) > 0, part


def test_disconnect_mid_stream_closes_the_peers_sessions(server: dict, swarm: dict, tokenizer, reference) -> None:
    peers = block_peers(swarm)
    assert wait_until(lambda: not any(open_sessions(p) for p in peers), 5.0)  # earlier requests' sessions are closed
    gone_before = requests_by_status(metric_samples(server)).get("499", 0)
    with httpx.Client(timeout=30, headers=auth()) as http, http.stream(
        "POST", server["url"] + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "count"}], "max_tokens": 400,
              "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held open: leaving a `for` over it would close the connection at once
        events = 0
        while events < 5:
            events += next(lines).startswith("data: {")
        assert [open_sessions(p) for p in peers] == [1, 1]  # the generation is running on both peers
        closed_at = time.monotonic()
    assert wait_until(lambda: not any(open_sessions(p) for p in peers), 2.0 - (time.monotonic() - closed_at)), (
        f"sessions still open 2 s after the client left: {[open_sessions(p) for p in peers]}\n{tail(server['log'])}")
    assert wait_until(lambda: requests_by_status(metric_samples(server)).get("499", 0) == gone_before + 1, 2.0)
    # and the service goes on serving
    want, _ = reference(tokenizer(PROMPT)["input_ids"], 8)
    assert client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text == want


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b"x" * (9 * 2**20), 413, None),
    (b"[1, 2]", 400, None),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": PROMPT, "stop": 5}, 400, "stop"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "max_tokens": 100_000}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": PROMPT, "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "x" * 2000}, 400, "prompt"),
    ({"prompt": PROMPT}, 400, "model"),
    ({"model": "gpt-4", "prompt": PROMPT}, 404, "model"),
])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server: dict, body, status: int, param) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server["url"] + "/v1/completions", content=content, timeout=30,
                   headers={**auth(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"] and error["param"] == param
    if param == "prompt" and status == 400 and "x" * 10 in content.decode():
        assert error["code"] == "context_length_exceeded"
    ok = client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_openai_client_sees_typed_errors_and_needs_the_key(server: dict) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client(server).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    assert bad.value.param == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], stream=True)
    with pytest.raises(openai.AuthenticationError):
        client(server, key="sk-wrong").models.list()
    r = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server["url"] + "/v1/nowhere", headers=auth(), timeout=10).json()["error"]["code"] == "not_found"


def test_metrics_parse_and_count_the_requests(server: dict) -> None:
    before = requests_by_status(metric_samples(server))
    client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 0},
               headers=auth(), timeout=10)
    httpx.post(server["url"] + "/v1/completions", json={"model": "nope", "prompt": PROMPT}, headers=auth(), timeout=10)
    httpx.get(server["url"] + "/v1/models", timeout=10)

    def counted() -> dict[str, float]:  # a generation is counted once its answer is out: a moment after the client has it
        after = requests_by_status(metric_samples(server))
        return {s: after.get(s, 0) - before.get(s, 0) for s in ("200", "400", "401", "404")}

    assert wait_until(lambda: counted() == {"200": 1, "400": 1, "401": 1, "404": 1}, 2.0), counted()
    samples = metric_samples(server)

    def value(family: str, name: str) -> float:
        return sum(s.value for s in samples[family] if s.name == name)

    assert value("dsd_serve_generated_tokens", "dsd_serve_generated_tokens_total") >= 4
    assert value("dsd_serve_time_to_first_token_seconds", "dsd_serve_time_to_first_token_seconds_count") >= 1
    assert value("dsd_serve_time_per_output_token_seconds", "dsd_serve_time_per_output_token_seconds_count") >= 1
    assert value("dsd_serve_accepted_drafts_per_round", "dsd_serve_accepted_drafts_per_round_count") >= 1
    assert value("dsd_serve_round_trip_seconds", "dsd_serve_round_trip_seconds_count") >= 1
    assert value("dsd_serve_ready_window_share", "dsd_serve_ready_window_share_count") >= 1
    assert value("dsd_serve_route_complete", "dsd_serve_route_complete") == 1
    assert len(samples["dsd_serve_peer_rtt_seconds"]) == 2
    assert value("dsd_serve_active_sessions", "dsd_serve_active_sessions") == 0
    assert "dsd_serve_failovers_total" in {s.name for s in samples["dsd_serve_failovers"]}


def test_no_route_answers_503_naming_the_missing_blocks(server: dict, swarm: dict) -> None:
    """Last: stops the peer serving blocks 3:5 of the shared testnet."""
    last = next(p for p in block_peers(swarm) if p["start"] == 3)
    stop_processes([PeerProcess.from_dict(last)])
    with pytest.raises(openai.InternalServerError) as info:
        client(server).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert info.value.status_code == 503 and info.value.code == "no_route"
    assert "3-4" in info.value.message, info.value.message
    assert client(server).models.list().data == []  # nothing servable now
    assert "dsd_serve_route_complete 0.0" in httpx.get(server["url"] + "/metrics", timeout=10).text
