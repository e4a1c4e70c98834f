"""The request limits (`dsd.node.service.guards`): the JSON scan against a recursive reference, the prompt's
character bound per tokenizer kind, the header and body limits; and `HttpGuard` over real HTTP (hypercorn on
loopback, in this process) answering a crash in a route as an OpenAI error object with its request id."""

from __future__ import annotations

import functools
import json
import logging
import socket
import time

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support.models import tiny_tokenizer

from dsd.node.peer.http import serve_http
from dsd.node.service import guards
from dsd.node.service.guards import (
    BodyTooLarge,
    HeadersTooLarge,
    HttpGuard,
    HttpLimits,
    JsonTooDeep,
    JsonTooLarge,
    PromptBudget,
    client_of,
    json_shape,
    text_fold,
    tokenizer_spec,
)

TRICKY = st.sampled_from(['a"b\\\\', "\\", '"', "[{", '\\"]', "}}", 'x\\\\\\"[', ",", ""])
JSON = st.recursive(st.none() | st.integers() | TRICKY,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                    max_leaves=40)


def depth(v: object, d: int = 1) -> int:
    if isinstance(v, list):
        return max([d, *(depth(x, d + 1) for x in v)])
    if isinstance(v, dict):
        return max([d, *(depth(x, d + 1) for x in v.values())])
    return d - 1


@settings(max_examples=100, deadline=None)
@given(JSON, st.integers(min_value=60, max_value=80), st.sampled_from([3, 64, 2**20]))
def test_json_shape_tells_strings_from_structure_at_any_chunking(value, extra: int, chunk: int) -> None:
    deep = value
    for _ in range(extra):  # deep enough to be scanned, not just counted
        deep = [deep, "]\\\"["]
    old, guards._SCAN_CHUNK = guards._SCAN_CHUNK, chunk
    try:
        raw = json.dumps(deep).encode()
        got, values = json_shape(raw)
    finally:
        guards._SCAN_CHUNK = old
    assert got == depth(deep)
    assert values >= 1 + extra * 2


def test_loads_refuses_deep_and_huge_json_before_parsing_it() -> None:
    t0 = time.perf_counter()
    with pytest.raises(JsonTooDeep, match="100000 levels"):
        guards.loads(b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(JsonTooLarge):
        guards.loads(json.dumps([0] * 300_000))
    with pytest.raises(ValueError):  # an unterminated string hides nothing from the parser after it
        guards.loads(b'"' + b'\\"[' * 100_000)
    assert time.perf_counter() - t0 < 1.0
    assert guards.loads('{"a": [1, {"b": "[[[["}]}') == {"a": [1, {"b": "[[[["}]}
    assert json_shape(b"[" * 8 * 2**20)[0] == 8 * 2**20  # 8 MiB of brackets, no recursion


def spec(normalizer=None, pre=None, model=None, added=()) -> dict:
    return {"normalizer": normalizer, "pre_tokenizer": pre or {"type": "ByteLevel"},
            "model": model or {"type": "BPE", "byte_fallback": False}, "added_tokens": list(added)}


def test_text_fold_holds_only_for_tokenizers_that_keep_every_character() -> None:
    assert text_fold(spec()) == 1
    assert text_fold(spec({"type": "NFC"})) == 4  # U+1F82 is 4 characters before composition
    assert text_fold(spec({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                               {"type": "Replace", "content": "▁"}]},
                          {"type": "Metaspace"}, {"type": "BPE", "byte_fallback": True})) == 1  # Llama 2
    assert text_fold(spec({"type": "BertNormalizer"})) is None  # drops control characters
    assert text_fold(spec(pre={"type": "Whitespace"})) is None  # drops spaces
    assert text_fold(spec(pre={"type": "Metaspace"})) is None  # no byte fallback: <unk> may cover anything
    assert text_fold(spec(model={"type": "WordPiece"})) is None
    assert text_fold(spec(added=[{"content": "<mask>", "lstrip": True, "rstrip": False}])) is None


def test_prompt_budget_of_the_tiny_tokenizer_counts_messages_and_characters() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    budget = PromptBudget.of(tok, 512, lambda m: tok.apply_chat_template(m, tokenize=True, return_dict=False))
    longest = max(len(t) for t in tok.get_vocab())
    assert budget == PromptBudget(512, longest, 1)
    assert text_fold(tokenizer_spec(tok)) == text_fold(json.loads(tok.backend_tokenizer.to_str())) == 1
    text = "hello world " * 40
    assert len(tok(text)["input_ids"]) >= budget.min_tokens(len(text))  # a lower bound indeed
    assert budget.excess(["hi"] * 511, chat=True) is None
    assert budget.excess(["hi"] * 512, chat=True)[0] == "messages"
    assert budget.excess(["hi", "x" * 512 * longest], chat=True)[0] == "messages[1].content"
    assert budget.excess(["x" * 256 * longest] * 2, chat=True)[0] == "messages"
    assert budget.excess(["x" * 512 * longest], chat=False)[0] == "prompt"
    # a template that trims or drops content is asked first: what it shows is what counts
    assert budget.excess([" " * 512 * longest], chat=True, rendered=lambda: "user: \n") is None
    assert budget.excess([" " * 512 * longest], chat=True, rendered=lambda: " " * 512 * longest) is not None
    assert PromptBudget.of(None, 512, lambda m: []) == PromptBudget(512, None, 0)  # no tokenizer: no bound


def test_header_and_body_limits() -> None:
    limits = HttpLimits(max_body_bytes=1000, body_timeout_s=2.0, body_min_rate=100)
    assert limits.check_headers([(b"content-length", b"1000")]) == 1000
    assert limits.check_headers([(b"transfer-encoding", b"chunked")]) is None
    with pytest.raises(BodyTooLarge):
        limits.check_headers([(b"content-length", b"1001")])
    with pytest.raises(HeadersTooLarge):
        limits.check_headers([(b"x-%d" % i, b"y") for i in range(200)])
    with pytest.raises(HeadersTooLarge):
        limits.check_headers([(b"x", b"y" * 40_000)])
    assert limits.body_deadline(0, 1000) == 12.0 and limits.body_deadline(500, None) == 7.0


def test_clients_are_keys_or_addresses_with_ipv6_by_prefix() -> None:
    assert client_of(2, "10.0.0.1") == "key#2"
    assert client_of(None, "10.0.0.1") == "addr:10.0.0.1"
    assert client_of(None, "2001:db8::1") == client_of(None, "2001:db8::ffff") == "addr:2001:db8::/64"
    assert client_of(None, None) == "addr:None"


def served(routes: list[Route], limits: HttpLimits, client) -> object:
    """Run `client(url)` in a thread while hypercorn serves `routes` behind `HttpGuard`, as the service does; its
    result."""
    app = Starlette(routes=routes, middleware=[Middleware(HttpGuard, limits=limits)])

    async def main():
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(serve_http, app, "127.0.0.1", 0))
            result = await trio.to_thread.run_sync(client, url)
            nursery.cancel_scope.cancel()
        return result

    return trio.run(main)


async def boom(request: Request) -> JSONResponse:
    raise RuntimeError("a bug")


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"size": len(await request.body())})


def test_a_crash_is_an_openai_error_with_the_request_id_in_the_log_and_the_header(caplog) -> None:
    routes = [Route("/boom", boom), Route("/echo", echo, methods=["POST"])]

    def client(url: str) -> list[httpx.Response]:
        with httpx.Client(base_url=url, timeout=10) as http:
            return [http.get("/boom"), http.post("/echo", content=b"x" * 50),
                    http.post("/echo", content=(b"x" * 100 for _ in range(20)))]

    with caplog.at_level(logging.INFO, logger="dsd.node.service.guards"):
        crash, ok, chunked = served(routes, HttpLimits(max_body_bytes=1000), client)
    rid = crash.headers["x-request-id"]
    error = crash.json()["error"]
    assert crash.status_code == 500 and error["type"] == "server_error" and error["code"] == "internal_error"
    assert rid in error["message"]
    assert any(rid in r.getMessage() and r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)
    assert ok.status_code == 200 and ok.json() == {"size": 50} and ok.headers["x-request-id"] != rid
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_dribbled_body_gets_408_and_a_refused_one_is_read_so_the_client_sees_413() -> None:

    def answer(s: socket.socket) -> bytes:
        s.settimeout(10)
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        return data

    def client(url: str) -> tuple[bytes, float, bytes]:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        t0 = time.monotonic()
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nab")
            slow = answer(s)
        took = time.monotonic() - t0
        with socket.create_connection((host, int(port))) as s:  # sends all 4 MiB before reading, as urllib does
            s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % (4 * 2**20) + b"x" * 4 * 2**20)
            big = answer(s)
        return slow, took, big

    slow, took, big = served([Route("/echo", echo, methods=["POST"])], HttpLimits(max_body_bytes=2**20, body_timeout_s=0.5), client)
    assert slow.startswith(b"HTTP/1.1 408") and b"request_timeout" in slow and 0.5 <= took < 2.0
    assert b"x-should-retry" not in slow  # a slow link may do better next time
    assert big.startswith(b"HTTP/1.1 413") and b"request_too_large" in big
