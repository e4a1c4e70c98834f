"""The OpenAI wire format, as pure functions: request validation, response and chunk shapes, error objects.

No I/O here: the app parses a body with `parse_request`, gets a `CompletionRequest` (or a
`WireError` naming the field at fault) and shapes what it sends with the `*_body` functions.
Nothing is silently ignored: a field this server does not know is refused by name; a known one
it does not implement is accepted only at the value that changes nothing (penalties 0, an empty
`logit_bias`, `n` 1, `store` false, `response_format` text) and refused otherwise. `user` is
accepted as it is: it names the end user for the operator's logs and never changes the answer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from . import guards
from .tool_calls import ToolCall, Tools, parse_tools
from .wire_errors import WireError, bad_param

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
DEFAULT_TEMPERATURE = 1.0  # as OpenAI's API: sampling unless the client asks for 0
SSE_DONE = b"data: [DONE]\n\n"
MAX_COMPLETION_LOGPROBS = 5  # as OpenAI's legacy completions API
MAX_CHAT_TOP_LOGPROBS = 20
COMMON_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
                           "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "user"})
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "response_format", "store", "metadata"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"}
MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})
STREAM_OPTIONS = frozenset({"include_usage"})


class TokenLogprobLike(Protocol):
    """What a logprob entry carries (`dsd.node.head.logprobs.TokenLogprob`)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` (`chat` False) or `/v1/chat/completions` request."""

    chat: bool
    model: str
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: tuple[dict[str, Any], ...] = ()  # chat: as the chat template takes them (text content, calls' arguments as objects)
    max_tokens: int | None = None  # None: as many as the context leaves (capped by the server's default)
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tools: Tools = field(default_factory=Tools)
    logprobs: int | None = None  # None: none; N: each token's logprob and its N likeliest alternatives

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(body: dict, name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_param(name, f"{name} must be a number, got {json.dumps(value)[:40]}", "invalid_type")
    if value < lo or value > hi or (lo_open and value == lo):
        bound = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad_param(name, f"{name} must be in {bound}, got {value:g}")
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_param(name, f"{name} must be true or false, got {json.dumps(value)[:40]}", "invalid_type")
    return value


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_param(where, f"{where}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                                "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_param(where, f"{where} must be a string or a list of text parts", "invalid_type")


def _messages(body: dict) -> tuple[dict[str, Any], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects",
                        "invalid_type" if msgs is not None else "missing_required_parameter")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(msgs))


def _message(m: Any, where: str) -> dict[str, Any]:
    """One chat message as the chat template takes it: text content; an assistant's earlier tool calls with their
    arguments as objects; a tool's answer with the id of the call it answers."""
    if not isinstance(m, dict):
        raise bad_param(where, f"{where} must be an object with role and content", "invalid_type")
    unknown = sorted(set(m) - MESSAGE_FIELDS)
    if unknown:
        raise bad_param(f"{where}.{unknown[0]}", f"{where}: unknown field {unknown[0]!r}", "unknown_parameter")
    role = m.get("role")
    if role not in CHAT_ROLES:
        raise bad_param(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}")
    calls = m.get("tool_calls")
    if calls is not None and role != "assistant":
        raise bad_param(f"{where}.tool_calls", f"{where}: only assistant messages carry tool_calls")
    content = m.get("content")
    text = "" if content is None and role == "assistant" else _text_content(content, f"{where}.content")
    out: dict[str, Any] = {"role": role, "content": text}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_param(f"{where}.tool_calls", f"{where}.tool_calls must be a list", "invalid_type")
        out["tool_calls"] = [_earlier_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_param(f"{where}.tool_call_id", f"{where}: a tool message needs the tool_call_id it answers",
                            "missing_required_parameter")
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _earlier_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
        raise bad_param(where, f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                        "invalid_type")
    try:
        args = guards.loads(fn["arguments"])
    except ValueError:
        raise bad_param(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object") from None
    if not isinstance(args, dict):
        raise bad_param(f"{where}.function.arguments", f"{where}.function.arguments must be a JSON object")
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


def _prompt(body: dict) -> str | list[int]:
    """One prompt: a string, a list of one string, token ids, or a list of one list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise bad_param("prompt", "only one prompt per request is supported")
    if prompt is None:
        raise bad_param("prompt", "prompt is required", "missing_required_parameter")
    raise bad_param("prompt", "prompt must be a string or a list of token ids", "invalid_type")


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_param("stop", "stop must be a non-empty string or a list of non-empty strings", "invalid_type")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_param("stop", f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters")
    return tuple(dict.fromkeys(stops))


def _max_tokens(body: dict, chat: bool) -> int | None:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise bad_param(name, f"{name} must be an integer, got {json.dumps(value)[:40]}", "invalid_type")
    if value < 1:
        raise bad_param(name, f"{name} must be at least 1, got {value}")
    return value


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Unknown fields, and known ones at a value that would change the answer in a way this server does not do."""
    unknown = sorted(set(body) - (CHAT_FIELDS if chat else COMPLETION_FIELDS))
    if unknown:
        raise bad_param(unknown[0], f"unknown parameter {unknown[0]!r} (this server implements: "
                        f"{', '.join(sorted(CHAT_FIELDS if chat else COMPLETION_FIELDS))})", "unknown_parameter")
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_param("n", f"n must be 1 (this server returns one choice per request), got {json.dumps(n)[:40]}")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise bad_param("best_of", "best_of must be 1")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value != 0):
            raise bad_param(name, f"{name} is not supported (only 0): the drafts are verified against the "
                            "target's own distribution")
    if body.get("logit_bias") not in (None, {}):
        raise bad_param("logit_bias", "logit_bias is not supported (only {})")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_param("user", "user must be a string", "invalid_type")
    if not chat and body.get("echo") not in (None, False):
        raise bad_param("echo", "echo is not supported")
    if not chat and body.get("suffix") not in (None, ""):
        raise bad_param("suffix", "suffix (fill in the middle) is not supported")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_param("response_format", 'response_format: only {"type": "text"} is supported (no JSON mode)')
    if body.get("store") not in (None, False):
        raise bad_param("store", "store must be false: this server keeps no completions")
    if body.get("metadata") not in (None, {}):
        raise bad_param("metadata", "metadata is for stored completions, and this server keeps none")


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives to report with each token's logprob (None: no logprobs)."""
    value = body.get("logprobs")
    if chat:
        if value is not None and not isinstance(value, bool):
            raise bad_param("logprobs", "logprobs must be true or false", "invalid_type")
        top = body.get("top_logprobs")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_CHAT_TOP_LOGPROBS):
            raise bad_param("top_logprobs", f"top_logprobs must be an integer in [0, {MAX_CHAT_TOP_LOGPROBS}]")
        if top is not None and not value:
            raise bad_param("top_logprobs", "top_logprobs needs logprobs: true")
        return (top or 0) if value else None
    if value is None:
        return None
    if not _is_int(value) or not 0 <= value <= MAX_COMPLETION_LOGPROBS:
        raise bad_param("logprobs", f"logprobs must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]")
    return value


def parse_request(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a request body; raises `WireError` (400) naming the field at fault."""
    try:
        body = guards.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(400, f"could not parse the request body as JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise WireError(400, "the request body must be a JSON object", code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("model", "model must be a non-empty string (GET /v1/models lists them)",
                        "missing_required_parameter" if model is None else "invalid_type")
    _refuse_unsupported(body, chat)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_param("stream_options", "stream_options must be an object", "invalid_type")
    if options and (set(options) - STREAM_OPTIONS or not stream):
        what = f"unknown field {sorted(set(options) - STREAM_OPTIONS)[0]!r}" if set(options) - STREAM_OPTIONS else \
            "needs stream: true"
        raise bad_param("stream_options", f"stream_options: {what}", "unknown_parameter")
    include_usage = _flag(options or {}, "include_usage") if stream else False
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise bad_param("seed", f"seed must be an integer, got {json.dumps(seed)[:40]}", "invalid_type")
    return CompletionRequest(
        chat=chat, model=model,
        prompt=None if chat else _prompt(body),
        messages=_messages(body) if chat else (),
        max_tokens=_max_tokens(body, chat),
        temperature=_number(body, "temperature", DEFAULT_TEMPERATURE, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=None if seed is None else seed % 2**63,
        stop=_stop(body), stream=stream, include_usage=include_usage,
        tools=parse_tools(body) if chat else Tools(), logprobs=_logprobs(body, chat),
    )


def context_error(req: CompletionRequest, prompt_tokens: int, max_tokens: int, limit: int, reserved: int) -> WireError:
    """The prompt and the completion do not fit in the context the model and the peers accept (`reserved`
    positions of it are kept for the draft window in flight)."""
    return bad_param(
        "messages" if req.chat else "prompt",
        f"this model's maximum context length is {limit} tokens, {reserved} of them reserved for draft windows; "
        f"the request needs {prompt_tokens + max_tokens + reserved} ({prompt_tokens} in the prompt, {max_tokens} "
        f"for the completion)",
        "context_length_exceeded",
    )


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req: CompletionRequest, *, rid: str, created: int, model: str, text: str, finish_reason: str,
                    usage: dict[str, int], dsd: dict[str, Any], calls: Sequence[ToolCall] = (),
                    logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A whole (non-streamed) answer with `usage` and the `dsd` statistics (chat: with the model's tool calls)."""
    if req.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [c.as_dict() for c in calls]
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": req.object, "created": created, "model": model, "choices": [choice],
            "usage": usage, "dsd": dsd}


def chunk_body(req: CompletionRequest, *, rid: str, created: int, model: str, text: str | None = None,
               first: bool = False, finish_reason: str | None = None, calls: list[dict[str, Any]] | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta (chat: the first names the role), tool-call deltas, or the end with its
    finish reason."""
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        if calls is not None:
            delta["tool_calls"] = calls
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": req.chunk_object, "created": created, "model": model, "choices": [choice]}


def call_deltas(calls: Sequence[ToolCall]) -> list[list[dict[str, Any]]]:
    """The `delta.tool_calls` of the chunks that stream `calls`: per call its id and name, then its arguments."""
    out = []
    for k, call in enumerate(calls):
        out.append([{"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}])
        out.append([{"index": k, "function": {"arguments": call.arguments}}])
    return out


def logprobs_body(req: CompletionRequest, entries: Sequence[TokenLogprobLike], token_text: Callable[[int], str],
                  text_offset: int = 0) -> dict[str, Any] | None:
    """`logprobs` of a choice: chat's `{"content": [{token, logprob, bytes, top_logprobs}]}` or the completions
    API's `{tokens, token_logprobs, top_logprobs, text_offset}`. None when the request asked for none."""
    if req.logprobs is None:
        return None
    if req.chat:
        def item(token: int, logprob: float) -> dict[str, Any]:
            text = token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}
    texts = [token_text(e.token) for e in entries]
    offsets, at = [], text_offset
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def usage_chunk(req: CompletionRequest, *, rid: str, created: int, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The `stream_options.include_usage` chunk: no choices, the usage."""
    return {"id": rid, "object": req.chunk_object, "created": created, "model": model, "choices": [], "usage": usage}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def models_body(models: list[dict[str, Any]]) -> dict[str, Any]:
    """`GET /v1/models`: each entry {id, created, owned_by, dsd}."""
    return {"object": "list", "data": [{"object": "model", **m} for m in models]}
