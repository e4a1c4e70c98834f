"""The OpenAI wire format, as pure functions: request validation, response and chunk shapes, error objects.

No I/O here: the app parses a body with `parse_request`, gets a `CompletionRequest` (or a
`WireError` naming the field at fault) and shapes what it sends with the `*_body` functions.
Parameters this server does not implement and that change nothing when left at their defaults
(penalties, logit_bias, user, ...) are ignored, as OpenAI-compatible servers commonly do; those
that would change the answer's shape (`n` > 1, `logprobs`, `echo`, `best_of` > 1) are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
DEFAULT_TEMPERATURE = 1.0  # as OpenAI's API: sampling unless the client asks for 0
SSE_DONE = b"data: [DONE]\n\n"


class WireError(Exception):
    """A request answered with an OpenAI error object: `{"error": {message, type, code, param}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def bad_param(param: str, message: str, code: str = "invalid_value") -> WireError:
    """A 400 naming the field at fault."""
    return WireError(400, message, code=code, param=param)


@dataclass(frozen=True)
class CompletionRequest:
    """A validated `/v1/completions` (`chat` False) or `/v1/chat/completions` request."""

    chat: bool
    model: str
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: tuple[dict[str, str], ...] = ()  # chat: {role, content} with text content
    max_tokens: int | None = None  # None: as many as the context leaves (capped by the server's default)
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False

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


def _messages(body: dict) -> tuple[dict[str, str], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_param("messages", "messages must be a non-empty list of {role, content} objects",
                        "invalid_type" if msgs is not None else "missing_required_parameter")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(where, f"{where} must be an object with role and content", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_param(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}")
        content = m.get("content")
        text = "" if content is None and role == "assistant" else _text_content(content, f"{where}.content")
        out.append({"role": role, "content": text})
    return tuple(out)


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
    n = body.get("n")
    if n is not None and (not _is_int(n) or n != 1):
        raise bad_param("n", f"n must be 1 (this server returns one choice per request), got {json.dumps(n)[:40]}")
    best_of = body.get("best_of")
    if best_of is not None and (not _is_int(best_of) or best_of != 1):
        raise bad_param("best_of", "best_of must be 1")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad_param("logprobs", "logprobs are not supported")
    if not chat and body.get("echo") not in (None, False):
        raise bad_param("echo", "echo is not supported")


def parse_request(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a request body; raises `WireError` (400) naming the field at fault."""
    try:
        body = json.loads(raw)
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
                    usage: dict[str, int], dsd: dict[str, Any]) -> dict[str, Any]:
    """A whole (non-streamed) answer with `usage` and the `dsd` statistics."""
    if req.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": req.object, "created": created, "model": model, "choices": [choice],
            "usage": usage, "dsd": dsd}


def chunk_body(req: CompletionRequest, *, rid: str, created: int, model: str, text: str | None = None,
               first: bool = False, finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed chunk: a text delta (chat: the first names the role), or the end with its finish reason."""
    if req.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": req.chunk_object, "created": created, "model": model, "choices": [choice]}


def usage_chunk(req: CompletionRequest, *, rid: str, created: int, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The `stream_options.include_usage` chunk: no choices, the usage."""
    return {"id": rid, "object": req.chunk_object, "created": created, "model": model, "choices": [], "usage": usage}


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def models_body(models: list[dict[str, Any]]) -> dict[str, Any]:
    """`GET /v1/models`: each entry {id, created, owned_by, dsd}."""
    return {"object": "list", "data": [{"object": "model", **m} for m in models]}
