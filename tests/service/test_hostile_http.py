"""Hostile HTTP against a real `dsd-node serve` over a real 2-peer testnet on loopback (tiny random Qwen2 with a chat
template, built here): every case gets its 4xx within a bounded time and little of the server's CPU, the server's
memory stays bounded, and a greedy request made after them all still returns exactly the HF model's text.

The cases: JSON nested 100 000 deep (also inside a tool call's arguments), too many JSON values, 100 000 and
40 000 chat messages, prompts far past the context in characters (40 000 messages rendered and tokenized cost
0.7 s of CPU, a 4M-character prompt tokenized 4 s: the cases assert far less), bodies past --max-body-mb
(declared, chunked, 64 MiB from a client that reads only after sending it all), header floods, the bad inputs
answered before, dribbled and stalled bodies, slow heads, idle connections, streams opened and abandoned, and
one client trying to take every place. Each case's status, time and server CPU go to a table (printed; `-s -n0`
shows it) and to hostile_http.json in pytest's temporary folder — and, with DSD_HOSTILE_REPORT=FILE, to FILE with
the commit and the machine's load (how bench/results/hostile-http-*.json was made, see docs/http_limits.md).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from support.models import hf_greedy, save_tiny_chat_model
from support.processes import cli_serve, cli_testnet
from transformers import AutoModelForCausalLM

from dsd.shard_store import Store

pytestmark = [pytest.mark.network, pytest.mark.timeout(300)]

MODEL = "tiny-qwen2"
KEYS = {"a": "sk-hostile-a", "b": "sk-hostile-b", "c": "sk-hostile-c"}
PROMPT = "def add(a, b):"
MAX_CONCURRENT, QUEUE, PER_CLIENT, BODY_TIMEOUT = 2, 4, 5, 2.0
RESULTS: list[dict] = []


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("hostile_model"), MODEL)


@pytest.fixture(scope="module")
def server(chat_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """A 2-peer testnet and `dsd-node serve` with three keys, 2 running + 4 waiting places, 5 per client, a 2 s body
    timeout and 10 ms added to every frame the head sends (so long generations hold their places a while)."""
    state = tmp_path_factory.mktemp("hostile")
    (state / "keys").write_text("# one client per key\n" + "\n".join(KEYS.values()) + "\n")
    with cli_testnet(tmp_path_factory.mktemp("hostile_net"), "--store", str(chat_root / "store"), "--peers", "2",
                     "--metrics") as net, cli_serve(
        state, net["bootstrap"], chat_root / "store", "--api-key", str(state / "keys"), "--max-concurrent",
        str(MAX_CONCURRENT), "--queue", str(QUEUE), "--max-per-client", str(PER_CLIENT), "--body-timeout",
        str(BODY_TIMEOUT), "--wan-latency-ms", "10",
    ) as info:
        yield {**info, "peers": [p for p in net["peers"] if p["role"] == "block"]}


@pytest.fixture(scope="module")
def reference(chat_root: Path):
    """The HF model's greedy text after PROMPT (cut at its EOS, as the service stops there)."""
    model = AutoModelForCausalLM.from_pretrained(str(chat_root / "hf"), dtype=torch.float32).eval()
    tokenizer = Store(chat_root / "store").load_tokenizer()
    tokens = hf_greedy(model, tokenizer(PROMPT)["input_ids"], 16)
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
    return tokenizer.decode(tokens, skip_special_tokens=True)


@pytest.fixture(scope="module")
def baseline(server: dict, reference: str) -> dict:
    """The server's memory after one greedy request (everything lazy is loaded by then)."""
    assert greedy(server, "a") == reference
    return proc_status(server["pid"])


def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM (MiB) and CPU seconds (user + system) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "hwm_mib": int(fields["VmHWM"].split()[0]) / 1024,
            "cpu_s": cpu}


def greedy(server: dict, key: str, max_tokens: int = 16) -> str:
    r = httpx.post(server["url"] + "/v1/completions", headers=auth(key), timeout=60,
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def auth(key: str = "a") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


def service(server: dict) -> dict:
    return httpx.get(server["url"] + "/api/swarm", timeout=10).json()["service"]


def note(case: str, status: int | str, seconds: float, cpu_s: float | None = None, **more) -> None:
    RESULTS.append({"case": case, "status": status, "seconds": round(seconds, 3),
                    "server_cpu_s": None if cpu_s is None else round(cpu_s, 3), **more})


def raw(server: dict, head: bytes, body: bytes = b"", *, wait_s: float = 30.0) -> tuple[int | None, bytes, float]:
    """Send `head` + `body` on a socket of its own as a plain client does (all of it, then read, ignoring a failed
    send); (status or None when closed without one, the whole answer, seconds until it was in)."""
    host, port = server["url"].removeprefix("http://").rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(wait_s)
        try:
            s.sendall(head + body)
        except OSError:
            pass
        data = b""
        try:
            while not complete(data) and (chunk := s.recv(65536)):
                data += chunk
        except OSError:
            pass
    return status_of(data), data, time.monotonic() - t0


def complete(answer: bytes) -> bool:
    """A whole answer with a content-length is in."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    length = [line.split(b":")[1] for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(sep and length and len(body) >= int(length[0]))


def post_head(path: str = "/v1/completions", length: int | None = None, key: str = "a", extra: bytes = b"") -> bytes:
    size = b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
    return (b"POST %s HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\ncontent-type: application/json\r\n%s%s\r\n"
            % (path.encode(), KEYS[key].encode(), size, extra))


def nested(depth: int) -> bytes:
    return b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * depth + b"1" + b"]" * depth + b"}"


def chat(n: int, content: str = "hi") -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}] * n, "max_tokens": 4}


BIG = 9 * 2**20  # past the default --max-body-mb 8
# (case, path, body, status, code): bodies the server refuses with an OpenAI error object, each within a second
BODIES = [
    ("JSON nested 100 000 deep", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "invalid_json"),
    ("JSON nested 10 000 deep in prompt", "/v1/completions", nested(10_000), 400, "invalid_json"),
    ("300 000 token ids (too many JSON values)", "/v1/completions",
     {"model": MODEL, "prompt": [1] * 300_000}, 400, "invalid_json"),
    ("100 000 chat messages (3.5 MB)", "/v1/chat/completions", chat(100_000), 400, "invalid_json"),
    ("40 000 chat messages", "/v1/chat/completions", chat(40_000), 400, "context_length_exceeded"),
    ("one chat message of 1M characters", "/v1/chat/completions", chat(1, "ab " * 333_334), 400,
     "context_length_exceeded"),
    ("prompt of 4M characters", "/v1/completions", {"model": MODEL, "prompt": "x" * 4_000_000}, 400,
     "context_length_exceeded"),
    ("tool call arguments nested 100 000 deep", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, 400, None),
    ("9 MiB body", "/v1/completions", b"x" * BIG, 413, "request_too_large"),
    ("invalid JSON", "/v1/completions", b"{not json", 400, "invalid_json"),
    ("a JSON array", "/v1/completions", b"[1, 2]", 400, "invalid_json"),
    ("invalid UTF-8", "/v1/completions", b'{"model": "\xff\xfe", "prompt": "x"}', 400, "invalid_json"),
    ("NaN temperature", "/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(),
     400, "invalid_type"),
    ("max_tokens 1e400", "/v1/completions", b'{"model": "%s", "prompt": "x", "max_tokens": 1e400}' % MODEL.encode(),
     400, "invalid_type"),
    ("a seed of 5000 digits", "/v1/completions",
     b'{"model": "%s", "prompt": "x", "seed": %s}' % (MODEL.encode(), b"9" * 5000), 400, "invalid_json"),
    ("max_tokens as a string", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, None),
    ("top_p 5", "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 5}, 400, None),
    ("1000 stop strings", "/v1/completions", {"model": MODEL, "prompt": "x", "stop": ["s"] * 1000}, 400, None),
    ("n 2", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, None),
    ("no model", "/v1/completions", {"prompt": "x"}, 400, None),
    ("an unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model_not_found"),
    ("max_tokens past the context", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 100_000}, 400,
     None),
]


@pytest.mark.parametrize("case, path, body, status, code", BODIES, ids=[c[0] for c in BODIES])
def test_bad_bodies_get_their_4xx_at_once_for_little_cpu(server: dict, baseline: dict, case: str, path: str,
                                                        body, status: int, code: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    before = proc_status(server["pid"])["cpu_s"]
    t0 = time.monotonic()
    r = httpx.post(server["url"] + path, content=content, timeout=30, headers={**auth(), "content-type": "application/json"})
    took = time.monotonic() - t0
    cpu = proc_status(server["pid"])["cpu_s"] - before
    note(case, r.status_code, took, cpu, bytes=len(content))
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "code", "param"} and error["message"]
    assert code is None or error["code"] == code, error
    assert r.headers["x-request-id"].startswith("req-")
    assert took < 1.5 and cpu < 0.3, (took, cpu)  # 40 000 messages rendered: 0.7 s; 1M characters tokenized: 0.8 s


def test_big_bodies_get_413_even_from_clients_that_read_only_after_sending(server: dict, baseline: dict) -> None:
    huge = b"x" * 64 * 2**20
    t0 = time.monotonic()
    r = httpx.post(server["url"] + "/v1/completions", content=huge, headers=auth(), timeout=30)
    note("64 MiB body (httpx)", r.status_code, time.monotonic() - t0)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    t0 = time.monotonic()
    request = urllib.request.Request(server["url"] + "/v1/completions", data=huge, headers=auth(), method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:  # before: BrokenPipeError, the answer never read
        urllib.request.urlopen(request, timeout=30)
    note("64 MiB body (urllib)", info.value.code, time.monotonic() - t0)
    assert info.value.code == 413 and json.loads(info.value.read())["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(BIG // 2**16):
            yield b"x" * 2**16

    t0 = time.monotonic()
    r = httpx.post(server["url"] + "/v1/completions", content=chunks(), headers=auth(), timeout=30)
    note("9 MiB chunked body", r.status_code, time.monotonic() - t0)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    status, answer, took = raw(server, post_head(length=10 * 2**30), wait_s=5)  # 10 GiB declared, nothing sent
    note("10 GiB declared, nothing sent", status, took)
    assert status == 413 and took < 1.0 and b"request_too_large" in answer
    for case, seconds in [(r["case"], r["seconds"]) for r in RESULTS[-4:]]:
        assert seconds < 5.0, case


def test_header_floods_and_broken_framing_get_4xx(server: dict, baseline: dict) -> None:
    many = b"".join(b"x-flood-%d: y\r\n" % i for i in range(300))
    for case, head, status, body_code in [
        ("300 headers", post_head(length=2, extra=many), 431, b"request_header_fields_too_large"),
        ("one 100 KB header", post_head(length=2, extra=b"x-big: " + b"y" * 100_000 + b"\r\n"), 431, None),
        ("a 40 KB cookie and 40 headers", post_head(length=2, extra=b"cookie: " + b"c" * 40_000 + b"\r\n"
                                                    + b"".join(b"x-%d: y\r\n" % i for i in range(40))), 431,
         b"request_header_fields_too_large"),
        ("Content-Length not a number", post_head(length=None).replace(b"transfer-encoding: chunked", b"content-length: x"),
         400, None),
        ("GET on a POST endpoint", b"GET /v1/completions HTTP/1.1\r\nhost: x\r\n" + auth_line() + b"\r\n", 405,
         b"method_not_allowed"),
        ("an unknown path", b"GET /v1/nowhere HTTP/1.1\r\nhost: x\r\n" + auth_line() + b"\r\n", 404, b"not_found"),
        ("no API key", b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n", 401, b"invalid_api_key"),
        ("a wrong API key", b"GET /v1/models HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk-wrong\r\n\r\n", 401,
         b"invalid_api_key"),
    ]:
        status, answer, took = raw(server, head, b"{}" if b"content-length: 2" in head else b"", wait_s=10)
        note(case, status, took)
        assert status == status_of(answer) == status, (case, answer[:300])
        assert body_code is None or body_code in answer, (case, answer[:300])
        assert took < 1.0 or b"connection: close" not in answer.lower(), case


def auth_line(key: str = "a") -> bytes:
    return b"authorization: Bearer %s\r\n" % KEYS[key].encode()


def status_of(answer: bytes) -> int | None:
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None


def test_slow_bodies_get_408_slow_heads_are_closed_and_others_are_served_meanwhile(server: dict, baseline: dict,
                                                                                   reference: str) -> None:
    host, port = server["url"].removeprefix("http://").rsplit(":", 1)

    def dribble(_: int) -> tuple[str, int | None, float]:  # a byte every 0.2 s of a 1000-byte body
        t0 = time.monotonic()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(post_head(length=1000))
            s.settimeout(0.2)
            data = b""
            for _ in range(100):
                try:
                    s.sendall(b" ")
                    data += s.recv(65536)
                    if data.endswith(b"}"):
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
        return "dribbled body", status_of(data), time.monotonic() - t0

    def stall(_: int) -> tuple[str, int | None, float]:
        status, _, took = raw(server, post_head(length=1000), b'{"model": ', wait_s=10)
        return "stalled body", status, took

    def slow_head(_: int) -> tuple[str, int | None, float]:  # a header line every 0.5 s, never the end
        t0 = time.monotonic()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            s.settimeout(0.5)
            for i in range(40):
                try:
                    s.sendall(b"x-slow-%d: y\r\n" % i)
                    if s.recv(65536) == b"":
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
        return "slow head (closed, no answer)", None, time.monotonic() - t0

    def idle(_: int) -> tuple[str, int | None, float]:
        status, _, took = raw(server, b"", wait_s=10)
        return "idle connection (closed, no answer)", status, took

    with ThreadPoolExecutor(40) as pool:
        jobs = [pool.submit(f, i) for f in (dribble, stall) for i in range(10)]
        jobs += [pool.submit(f, i) for f in (slow_head, idle) for i in range(5)]
        time.sleep(0.5)
        t0 = time.monotonic()
        assert greedy(server, "b") == reference  # served while 30 connections hang on
        note("a greedy request meanwhile", 200, time.monotonic() - t0)
        results = [j.result() for j in jobs]
    for case in dict.fromkeys(c for c, _, _ in results):
        mine = [(status, took) for c, status, took in results if c == case]
        note(f"{len(mine)} x {case}", "/".join(sorted({str(s) for s, _ in mine})), max(t for _, t in mine))
        if case.endswith("body"):  # the body timeout plus a second per 64 KiB of the declared 1000 bytes
            assert all(s == 408 and BODY_TIMEOUT <= t < BODY_TIMEOUT + 1.5 for s, t in mine), (case, mine)
        else:  # hypercorn closes a connection without a complete head after its keep-alive timeout (5 s)
            assert all(s is None and t < 7.0 for s, t in mine), (case, mine)


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def open_stream(server: dict, key: str, max_tokens: int = 400) -> socket.socket:
    """A streamed completion request sent on a socket of its own, its answer left unread."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    host, port = server["url"].removeprefix("http://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(post_head(length=len(body), key=key) + body)
    return s


def first_status(s: socket.socket, wait_s: float = 10.0) -> int | None:
    s.settimeout(wait_s)
    try:
        return status_of(s.recv(65536))
    except OSError:
        return None


def idle_server(server: dict) -> bool:
    now = service(server)
    return now["running"] == now["waiting"] == 0


def open_sessions(peer: dict) -> int:
    """Sessions a block peer holds now (its `dsd_peer_sessions_open` gauge)."""
    text = httpx.get(peer["metrics_url"], timeout=10).text
    return int(next(f.samples[0].value for f in text_string_to_metric_families(text) if f.name == "dsd_peer_sessions_open"))


def test_streams_opened_and_abandoned_free_their_places_and_sessions(server: dict, baseline: dict) -> None:
    t0 = time.monotonic()
    sockets = [open_stream(server, "c") for _ in range(30)]
    assert wait_until(lambda: (service(server)["running"], service(server)["waiting"]) == (2, PER_CLIENT - 2), 5.0)
    statuses = [first_status(s, wait_s=0.5) for s in sockets]  # a waiting stream has no status yet
    for s in sockets:
        s.close()
    closed = time.monotonic()
    assert sorted(statuses, key=str) == sorted([200] * MAX_CONCURRENT + [None] * (PER_CLIENT - MAX_CONCURRENT)
                                               + [429] * (30 - PER_CLIENT), key=str), statuses
    assert wait_until(lambda: idle_server(server), 5.0), service(server)
    assert wait_until(lambda: not any(open_sessions(p) for p in server["peers"]), 5.0)
    note("30 streams opened and abandoned (2 running, 3 waiting, 25 x 429), all freed", "200/429",
         time.monotonic() - t0, freed_s=round(time.monotonic() - closed, 3))
    assert time.monotonic() - closed < 2.0


def test_one_client_cannot_take_every_place(server: dict, baseline: dict, reference: str) -> None:
    held = [open_stream(server, "a") for _ in range(PER_CLIENT)]
    try:
        assert wait_until(lambda: (service(server)["running"], service(server)["waiting"]) == (2, 3), 5.0)
        t0 = time.monotonic()
        r = httpx.post(server["url"] + "/v1/completions", headers=auth("a"), timeout=10,
                       json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        note("a client's request past --max-per-client", r.status_code, time.monotonic() - t0)
        assert r.status_code == 429 and "--max-per-client 5" in r.json()["error"]["message"]

        with ThreadPoolExecutor(2) as pool:  # "b" takes the last place, then the newest waiting one of "a"
            t0 = time.monotonic()
            b1 = pool.submit(greedy, server, "b")
            assert wait_until(lambda: service(server)["waiting"] == 4, 5.0)
            b2 = pool.submit(greedy, server, "b")
            evicted = first_status(held[-1])
            note("the newest waiting request of a client over its share", evicted, time.monotonic() - t0)
            assert evicted == 429
            held[0].close()  # a running slot frees: it goes to "b" (running none) before "a"'s older waiting ones
            assert b1.result(timeout=30) == reference and b2.result(timeout=30) == reference
            note("another client's two greedy requests, while the first holds its places", 200,
                 time.monotonic() - t0)
        assert service(server)["waiting"] >= 1  # "a"'s older waiting requests were passed over
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: idle_server(server), 5.0)


def cpu(seconds: float | None) -> str:
    return "" if seconds is None else f"cpu {seconds:.2f} s"


def test_after_it_all_memory_is_bounded_no_5xx_and_greedy_is_exact(server: dict, baseline: dict, reference: str,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    assert greedy(server, "c") == reference
    after = proc_status(server["pid"])
    statuses = [str(r["status"]) for r in RESULTS]
    log = Path(server["log"]).read_text(errors="replace")
    table = "\n".join(f"{r['status']!s:>8}  {r['seconds']:7.3f} s  {cpu(r['server_cpu_s']):>12}  {r['case']}"
                      for r in RESULTS)
    memory = (f"server VmRSS {baseline['rss_mib']:.0f} MiB before, {after['rss_mib']:.0f} MiB after "
              f"(peak {after['hwm_mib']:.0f} MiB)")
    report = tmp_path_factory.getbasetemp() / "hostile_http.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    data = {"command": "DSD_HOSTILE_REPORT=FILE python -m pytest tests/service/test_hostile_http.py -n0",
            "commit": commit, "load_after": os.getloadavg(), "cpus": os.cpu_count(), "cases": RESULTS,
            "before": baseline, "after": after}
    report.write_text(json.dumps(data, indent=2))
    if os.environ.get("DSD_HOSTILE_REPORT"):
        Path(os.environ["DSD_HOSTILE_REPORT"]).write_text(json.dumps(data, indent=2) + "\n")
    print(f"\n{table}\n{memory}\nwritten to {report}")
    assert not any(s.startswith("5") for s in statuses), table
    assert "unexpected error" not in log and "Traceback" not in log
    assert after["rss_mib"] - baseline["rss_mib"] < 64 and after["hwm_mib"] - baseline["rss_mib"] < 128, memory
