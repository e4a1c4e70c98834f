"""What one HTTP request may cost, checked before any expensive work, cheapest first (docs/http_limits.md).

The limits are plain functions over bytes, headers and texts, each refusing with a named
`GuardError` that carries its HTTP status and OpenAI error code: headers (431), the body's size
(413) and arrival rate (408), the JSON's depth and element count (400, counted by a linear scan
that never recurses, before `json.loads`), the prompt's characters and messages against the
context (400, before the chat template and the tokenizer run). `HttpGuard` is the one piece of
I/O: ASGI middleware that applies the header and body limits to every request, answers what
it refuses so the client can read it, and turns any unexpected error into an OpenAI error
object logged with a request id.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import trio
from starlette.requests import ClientDisconnect

from .defaults import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_MB
from .wire_errors import WireError, retry_headers

log = logging.getLogger(__name__)

MAX_JSON_DEPTH = 64  # OpenAI bodies nest 4-5 levels; tool schemas a dozen; json.loads recurses ~1000 deep
MAX_JSON_ELEMENTS = 2**18  # values in one body: a 131072-token prompt of ids is half of it
MAX_HEADERS = 128  # clients send about ten
MAX_HEADER_BYTES = 32 * 2**10  # hypercorn refuses a head over 16 KiB only while it is incomplete
BODY_MIN_RATE = 64 * 2**10  # bytes/s a body may take beyond the timeout: a slow link is not a dribble
DRAIN_BYTES = 64 * 2**20  # a refused body read and dropped so the client reads the 413 after sending it
DRAIN_S = 10.0
UNICODE_FOLD = 4  # the most characters canonical composition (NFC/NFKC) folds into one (U+1F82: 4)


class GuardError(ValueError):
    """A request refused by a limit: its HTTP status, OpenAI error code and the field at fault."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        return WireError(self.status, self.message, type=kind, code=self.code, param=self.param).body()


class HeadersTooLarge(GuardError):
    status, code = 431, "request_header_fields_too_large"


class BodyTooLarge(GuardError):
    status, code = 413, "request_too_large"


class BodyTooSlow(GuardError):
    status, code = 408, "request_timeout"


class JsonTooDeep(GuardError):
    code = "json_too_deep"


class JsonTooLarge(GuardError):
    code = "json_too_many_elements"


class InternalError(GuardError):
    """An unexpected failure in the server (a bug): the client can do nothing about it but report its id."""

    status, code = 500, "internal_error"


@dataclass(frozen=True)
class HttpLimits:
    """The limits of one request that do not depend on the model."""

    max_body_bytes: int = int(DEFAULT_MAX_BODY_MB * 2**20)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    body_min_rate: int = BODY_MIN_RATE
    max_headers: int = MAX_HEADERS
    max_header_bytes: int = MAX_HEADER_BYTES
    drain_bytes: int = DRAIN_BYTES
    drain_s: float = DRAIN_S

    def check_headers(self, headers: Sequence[tuple[bytes, bytes]]) -> int | None:
        """The declared body length (None: chunked or no body); `HeadersTooLarge`, or `BodyTooLarge` at once
        when the length says so (the body is then never read)."""
        size = sum(len(k) + len(v) for k, v in headers)
        if len(headers) > self.max_headers or size > self.max_header_bytes:
            raise HeadersTooLarge(f"{len(headers)} headers of {size} bytes; at most {self.max_headers} headers "
                                  f"of {self.max_header_bytes} bytes are accepted")
        length = next((v for k, v in headers if k.lower() == b"content-length"), None)
        declared = int(length) if length is not None and length.strip().isdigit() else None
        if declared is not None and declared > self.max_body_bytes:
            raise self.too_large(declared)
        return declared

    def too_large(self, size: int) -> BodyTooLarge:
        return BodyTooLarge(f"the request body has {size} bytes or more; this server accepts at most "
                            f"{self.max_body_bytes} (--max-body-mb)")

    def body_deadline(self, received: int, declared: int | None) -> float:
        """Seconds after the headers by which the body must be in: the timeout plus its size at the minimum rate."""
        return self.body_timeout_s + max(received, declared or 0) / self.body_min_rate


_SCAN_CHUNK = 2**20


def json_shape(raw: bytes) -> tuple[int, int]:
    """(deepest nesting, number of values) of a JSON text by a linear, vectorised scan that tells string contents
    from structure (a quote after an odd run of backslashes is escaped) and never recurses; both are upper counts
    (values: commas plus containers plus one; a text with few brackets and commas is not scanned at all, its
    counts include those in strings). Cost: at most about 15 ms per MiB whatever the bytes."""
    opens = raw.count(b"[") + raw.count(b"{")
    upper = raw.count(b",") + opens + 1
    if opens <= MAX_JSON_DEPTH and upper <= MAX_JSON_ELEMENTS:  # small whatever the strings hold: no need to look
        return opens, upper
    in_string, run, depth, deepest, values = 0, 0, 0, 0, 1
    for at in range(0, len(raw), _SCAN_CHUNK):
        a = np.frombuffer(raw, np.uint8, min(_SCAN_CHUNK, len(raw) - at), at)
        quote = a == 34
        if run or np.any(a == 92):  # drop the escaped quotes
            i = np.arange(len(a), dtype=np.int32)
            last_plain = np.maximum.accumulate(np.where(a != 92, i, np.int32(-1 - run)))  # last non-backslash <= i
            escapes = np.empty(len(a), np.int32)  # backslashes right before each byte
            escapes[0], escapes[1:] = run, i[:-1] - last_plain[:-1]
            quote &= escapes % 2 == 0
            run = int(i[-1] - last_plain[-1])
        quotes = np.cumsum(quote, dtype=np.int32)
        outside = (quotes + in_string) % 2 == 0
        open_ = outside & ((a == 91) | (a == 123))
        steps = np.cumsum(open_.astype(np.int32) - (outside & ((a == 93) | (a == 125))), dtype=np.int32)
        deepest = max(deepest, depth + int(steps.max()))
        depth += int(steps[-1])
        values += int(np.count_nonzero(open_) + np.count_nonzero(outside & (a == 44)))
        in_string = (in_string + int(quotes[-1])) % 2
    return deepest, values


def loads(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH, max_elements: int = MAX_JSON_ELEMENTS) -> Any:
    """`json.loads` after checking depth and size linearly: `JsonTooDeep` / `JsonTooLarge` (ValueErrors) instead
    of the parser's recursion error or a memory spike."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth, elements = json_shape(data)
    if depth > max_depth:
        raise JsonTooDeep(f"the JSON nests {depth} levels deep; at most {max_depth} are accepted")
    if elements > max_elements:
        raise JsonTooLarge(f"the JSON holds about {elements} values; at most {max_elements} are accepted")
    return json.loads(raw)


_LOSSLESS_NORMALIZERS = {"NFC": UNICODE_FOLD, "NFKC": UNICODE_FOLD, "NFD": 1, "NFKD": 1, "Prepend": 1, "Lowercase": 1}
_LOSSLESS_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts"}


def _parts(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    if node is None:
        return []
    return [p for sub in node[key] for p in _parts(sub, key)] if node.get("type") == "Sequence" else [node]


def text_fold(spec: dict[str, Any]) -> int | None:
    """How many input characters one character of the tokenizer's normalized text can stand for, or None when its
    normalizer, pre-tokenizer, model or added tokens may drop characters (then no character bound holds)."""
    fold = 1
    for part in _parts(spec.get("normalizer"), "normalizers"):
        kind = part.get("type")
        if kind == "Replace" and part.get("content"):
            continue  # Llama's " " -> "▁": one for one
        if kind not in _LOSSLESS_NORMALIZERS:
            return None
        fold = max(fold, _LOSSLESS_NORMALIZERS[kind])
    pre = _parts(spec.get("pre_tokenizer"), "pretokenizers")
    if any(p.get("type") not in _LOSSLESS_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return None
    model = spec.get("model") or {}
    covers_bytes = model.get("byte_fallback") or any(p.get("type") == "ByteLevel" for p in pre)
    if model.get("type") != "BPE" or not covers_bytes:
        return None  # an unknown character could vanish into one <unk>
    if any(a.get("lstrip") or a.get("rstrip") for a in spec.get("added_tokens") or []):
        return None  # such a token swallows any run of spaces beside it
    return fold


def tokenizer_spec(tokenizer: Any) -> dict[str, Any]:
    """The parts of a fast tokenizer's JSON that `text_fold` reads, without serializing its vocabulary."""
    backend = tokenizer.backend_tokenizer
    model = backend.model
    return {
        "normalizer": json.loads(backend.normalizer.__getstate__()) if backend.normalizer is not None else None,
        "pre_tokenizer": json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer is not None else None,
        "model": {"type": type(model).__name__, "byte_fallback": bool(getattr(model, "byte_fallback", False))},
        "added_tokens": [{"lstrip": a.lstrip, "rstrip": a.rstrip} for a in tokenizer.added_tokens_decoder.values()],
    }


@dataclass(frozen=True)
class PromptBudget:
    """A lower bound on a prompt's tokens from its characters and messages, so a prompt that cannot fit the context
    is refused before the chat template and the tokenizer run (`ServedModel.plan` checks the exact count)."""

    context: int
    chars_per_token: int | None  # None: the tokenizer may drop characters; only messages are counted
    tokens_per_message: int = 1

    @classmethod
    def of(cls, tokenizer: Any, context: int, chat_tokens: Callable[[list[dict[str, str]]], list[int]]) -> PromptBudget:
        """The served tokenizer's bound: a token stands for at most its vocabulary's longest entry (times the
        normalizer's fold); a chat message costs at least one token when the template shows an empty turn."""
        try:
            fold = text_fold(tokenizer_spec(tokenizer))
            longest = max(len(t) for t in tokenizer.get_vocab())
        except (AttributeError, TypeError, ValueError):  # no fast tokenizer (or none at all): no character bound
            fold, longest = None, 0
        turn = {"role": "user", "content": ""}
        try:
            per_message = int(len(chat_tokens([turn, {"role": "assistant", "content": ""}, turn]))
                              >= len(chat_tokens([turn])) + 2)
        except Exception:  # no chat template, or one that refuses the probe: count no tokens per message
            per_message = 0
        return cls(context, None if fold is None else fold * longest, per_message)

    def min_tokens(self, chars: int, messages: int = 0) -> int:
        per_char = 0 if self.chars_per_token is None else math.ceil(chars / self.chars_per_token)
        return max(per_char, messages * self.tokens_per_message)

    def excess(self, texts: Sequence[str], chat: bool,
               rendered: Callable[[], str] | None = None) -> tuple[str, str] | None:
        """(param, message) when the texts (a chat's message contents, or one prompt) need more tokens than the
        context holds with one completion token; None when they may fit. A chat refused for its characters is
        rendered first (`rendered`: the template as text, untokenized), as a template may trim or drop content."""
        where = "messages" if chat else "prompt"
        need = self.min_tokens(0, len(texts) if chat else 0)
        if need >= self.context:
            return where, (f"this model's maximum context length is {self.context} tokens; these {len(texts)} "
                           f"messages need at least {need} tokens (one a message) before the completion")
        if self.chars_per_token is None:
            return None
        longest = max(range(len(texts)), key=lambda i: len(texts[i]), default=0)
        chars = sum(map(len, texts))
        need = self.min_tokens(chars)
        if need < self.context:
            return None
        if chat and rendered is not None:
            try:
                shown = len(rendered())
            except Exception:  # the template refuses these messages: `plan` says so, before tokenizing
                return None
            if self.min_tokens(shown) < self.context:
                return None  # the template drops or trims enough of them
        name, size = where, chars
        if chat and self.min_tokens(len(texts[longest])) >= self.context:  # one message is too long by itself
            name, size, need = f"messages[{longest}].content", len(texts[longest]), self.min_tokens(len(texts[longest]))
        return name, (f"{name}: {size} characters, at least {need} tokens (a token covers at most "
                      f"{self.chars_per_token}); this model's maximum context length is {self.context} tokens")


def client_of(key_index: int | None, address: str | None) -> str:
    """Whom a request counts against: its API key when the service has several, else its address (an IPv6 /64:
    one host is given a whole prefix)."""
    if key_index is not None:
        return f"key#{key_index}"
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return f"addr:{address}"
    return f"addr:{ipaddress.ip_network(f'{ip}/64', strict=False)}" if ip.version == 6 else f"addr:{ip}"


Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
OnRefused = Callable[[dict[str, Any], int], None]


class _Exchange:
    """One request's receive and send as the app sees them: the body limits on receive, the request id on send."""

    def __init__(self, receive: Receive, send: Send, rid: str, limits: HttpLimits, declared: int | None) -> None:
        self._receive, self._send, self.rid, self.limits, self.declared = receive, send, rid, limits, declared
        self.t0 = trio.current_time()
        self.received = 0
        self.body_done = False
        self.started = self.finished = False

    async def receive(self) -> Message:
        if self.body_done:
            return await self._receive()
        left = self.t0 + self.limits.body_deadline(self.received, self.declared) - trio.current_time()
        with trio.move_on_after(max(left, 0.0)):
            message = await self._receive()
            if message["type"] != "http.request":
                self.body_done = True  # the client is gone
                return message
            self.received += len(message.get("body", b""))
            self.body_done = not message.get("more_body", False)
            if self.received > self.limits.max_body_bytes:
                raise self.limits.too_large(self.received)
            return message
        raise BodyTooSlow(f"the request body did not arrive in time: {self.received} bytes in "
                          f"{trio.current_time() - self.t0:.1f} s (a body may take --body-timeout "
                          f"{self.limits.body_timeout_s:g} s plus a second per {self.limits.body_min_rate} bytes)")

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", self.rid.encode())]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.finished = True
        await self._send(message)

    async def refuse(self, exc: GuardError) -> None:
        """Answer `exc` as an OpenAI error object; a refused body is read and dropped (bounded) before the answer
        ends, so a client that reads only after sending everything still sees it."""
        if self.started:
            if not self.finished:
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        body = json.dumps(exc.body()).encode()
        # draining a body it would not finish anyway helps no client: then the connection just closes
        drain = isinstance(exc, BodyTooLarge) and not self.body_done and (self.declared or 0) <= self.limits.drain_bytes
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.encode(), v.encode()) for k, v in retry_headers(exc.status).items()]
        if not self.body_done:
            headers.append((b"connection", b"close"))
        try:
            await self.send({"type": "http.response.start", "status": exc.status, "headers": headers})
            await self.send({"type": "http.response.body", "body": body, "more_body": drain})
            if drain:
                with trio.move_on_after(self.limits.drain_s):
                    dropped = 0
                    while dropped <= self.limits.drain_bytes:
                        message = await self._receive()
                        dropped += len(message.get("body", b""))
                        if message["type"] != "http.request" or not message.get("more_body", False):
                            break
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception as gone:  # the connection is gone (hypercorn may say so with trio's BusyResourceError)
            log.info("request %s: the client left before its %d was sent (%r)", self.rid, exc.status, gone)


class HttpGuard:
    """ASGI middleware: the header and body limits on every request, the refusal answered readably, a request id
    (`x-request-id`) on every answer, and any unexpected error as an OpenAI error object logged with that id."""

    def __init__(self, app: Any, limits: HttpLimits | None = None, on_refused: OnRefused | None = None) -> None:
        self.app = app
        self.limits = limits or HttpLimits()
        self.on_refused = on_refused

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = rid
        refused: GuardError | None = None
        try:
            declared = self.limits.check_headers(scope.get("headers") or [])
        except GuardError as exc:
            declared, refused = None, exc
        exchange = _Exchange(receive, send, rid, self.limits, declared)
        if refused is None:
            refused = await self._run(scope, exchange)
            if refused is None:
                return
        log.log(logging.WARNING if refused.status >= 500 else logging.INFO, "%s %s (%s) %d: %s", scope["method"],
                scope["path"], rid, refused.status, refused.message)
        if self.on_refused is not None:
            self.on_refused(scope, refused.status)
        await exchange.refuse(refused)

    async def _run(self, scope: dict[str, Any], exchange: _Exchange) -> GuardError | None:
        """Run the app; what it failed with, as the error to answer (None: it answered, or the client left)."""
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except GuardError as exc:
            return exc
        except ClientDisconnect:
            log.info("%s %s (%s): the client went away while sending its body", scope["method"], scope["path"],
                     exchange.rid)
        except Exception:
            log.exception("%s %s (%s): unexpected error", scope["method"], scope["path"], exchange.rid)
            return InternalError(f"internal error (request id {exchange.rid}): the server logged it; please report it")
        return None
