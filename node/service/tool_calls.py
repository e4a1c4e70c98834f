"""Tool calling, sans-IO: the request's `tools` and `tool_choice`, and the model's tool calls found in its text.

The model is shown the tools by its own chat template (Qwen2.5's has a tools section asking for
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`). What models really emit varies: the tagged block the
template asks for, a fenced JSON block (```` ```json {"name": ..., "arguments": ...} ``` ````, what
Qwen2.5-Coder-1.5B answers greedily), or the bare JSON object. All three are taken when the name is one of the
offered tools and the arguments are a JSON object; anything else stays text. `ToolCallFilter` streams the text
around calls and holds back from where a call may begin, so no markup reaches a streaming client as content.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from .schema_check import schema_errors
from .wire_errors import bad_param

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
FENCE = "```"
FENCE_LANGS = ("", "json", "tool_call")  # fenced blocks with another language are code, never calls
MAX_TOOLS = 128  # as OpenAI's API
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # as OpenAI's API
_TAGGED = re.compile(re.escape(TAG_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(TAG_CLOSE) + r"|\Z)", re.S)
_FENCED = re.compile(r"```([A-Za-z_]*)[ \t]*\n?(.*?)(?:```|\Z)", re.S)
_LINE_OBJECT = re.compile(r"^[ \t]*\{", re.M)  # a JSON object opening a line: small models write calls so, amid other text
_DECODER = json.JSONDecoder()


@dataclass(frozen=True)
class Tools:
    """A request's tools: their definitions as the chat template takes them, and how the model may use them.
    `choice` is "none", "auto", "required" or the one function's name the model must call."""

    definitions: tuple[dict[str, Any], ...] = ()
    choice: str = "none"
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d["function"]["name"] for d in self.definitions)

    @property
    def shown(self) -> tuple[dict[str, Any], ...]:
        """The definitions as the chat template shows them (OpenAI's function objects, without our `strict` mark)."""
        return tuple({"type": "function", "function": d["function"]} for d in self.definitions)

    def schema_of(self, name: str) -> dict[str, Any] | None:
        """The parameters schema a call of `name` must satisfy: a strict tool's (None: not checked)."""
        d = next(d for d in self.definitions if d["function"]["name"] == name)
        return d["function"].get("parameters", {}) if d.get("strict") else None

    @property
    def active(self) -> bool:
        """The model is shown the tools and its calls are parsed (not with tool_choice "none")."""
        return bool(self.definitions) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"

    def prefill(self) -> str:
        """The start of the answer the server writes for the model when a call is required: the tagged markup,
        and the name too when one function is named."""
        if self.choice == "required":
            return f'{TAG_OPEN}\n{{"name": "'
        return f'{TAG_OPEN}\n{{"name": "{self.choice}", "arguments": '


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's `tool_calls[]` entry."""

    id: str
    name: str
    arguments: str  # a JSON object, serialised

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tools(body: dict[str, Any]) -> Tools:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request; 400 naming the field at fault."""
    raw, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_param("parallel_tool_calls", "parallel_tool_calls must be true or false", "invalid_type")
    if raw is None:
        if choice not in (None, "none"):
            raise bad_param("tool_choice", "tool_choice needs tools")
        return Tools()
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOLS:
        raise bad_param("tools", f"tools must be a list of 1 to {MAX_TOOLS} function definitions", "invalid_type")
    definitions = tuple(_definition(t, f"tools[{i}]") for i, t in enumerate(raw))
    names = [d["function"]["name"] for d in definitions]
    if len(set(names)) != len(names):
        raise bad_param("tools", "tools must have distinct function names")
    return Tools(definitions, _choice(choice, names), True if parallel is None else parallel)


def _definition(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_param(where, f'{where} must be {{"type": "function", "function": {{"name": ..., ...}}}}',
                        "invalid_type")
    fn = tool["function"]
    unknown = sorted(set(tool) - {"type", "function"}) + sorted(set(fn) - {"name", "description", "parameters",
                                                                           "strict"})
    if unknown:
        raise bad_param(where, f"{where}: unknown field {unknown[0]!r}", "unknown_parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise bad_param(f"{where}.function.name", "a function name must be 1 to 64 letters, digits, _ or -")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad_param(f"{where}.function.description", "description must be a string", "invalid_type")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise bad_param(f"{where}.function.parameters", "parameters must be a JSON Schema object", "invalid_type")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad_param(f"{where}.function.strict", "strict must be true or false", "invalid_type")
    kept = {k: fn[k] for k in ("name", "description", "parameters") if fn.get(k) is not None}
    return {"type": "function", "function": kept, **({"strict": True} if fn.get("strict") else {})}


def _choice(choice: Any, names: list[str]) -> str:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise bad_param("tool_choice", f"tool_choice names {name!r}, which is not among the tools")
        return name
    raise bad_param("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                    '"function": {"name": ...}}', "invalid_type")


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _as_call(obj: Any, tools: Tools) -> ToolCall | None:
    """A JSON value that is a call of an offered tool: {"name", "arguments" (or "parameters"): object}, conforming
    to the tool's schema when the tool is strict."""
    if not isinstance(obj, dict) or obj.get("name") not in tools.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict) or set(obj) - {"name", "arguments", "parameters"}:
        return None
    schema = tools.schema_of(obj["name"])
    if schema is not None and schema_errors(args, schema):
        return None
    return ToolCall(call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _calls_in(payload: str, tools: Tools) -> list[ToolCall] | None:
    """The calls one block holds (an object, or a list of them), or None when it is not wholly calls."""
    try:
        value = json.loads(payload)
    except (ValueError, RecursionError):  # the model's text: anything, nested arbitrarily deep too
        value = _undoubled(payload.strip())
        if value is None:
            return None
    items = value if isinstance(value, list) and value else [value]
    calls = [_as_call(v, tools) for v in items]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


@dataclass(frozen=True)
class ParsedOutput:
    """The model's answer split into its text (the calls' blocks taken out, spacing as it was) and its tool calls."""

    content: str
    calls: tuple[ToolCall, ...]


def parse_output(text: str, tools: Tools) -> ParsedOutput:
    """Find the calls in a whole answer (see the module doc); with `parallel` off only the first is kept. Malformed
    or unknown-tool blocks stay in the text as they were."""
    if not tools.active:
        return ParsedOutput(text, ())
    calls: list[ToolCall] = []
    spans: list[tuple[int, int]] = []
    for match in _TAGGED.finditer(text):
        found = _calls_in(match.group(1), tools)
        if found is not None:
            calls += found
            spans.append(match.span())
    if not calls:
        for match in _FENCED.finditer(text):
            found = _calls_in(match.group(2), tools) if match.group(1).lower() in FENCE_LANGS else None
            if found is not None:
                calls += found
                spans.append(match.span())
    if not calls:
        found = _calls_in(text.strip(), tools) if text.strip()[:1] in ("{", "[") else None
        if found is not None:
            calls, spans = found, [(0, len(text))]
    if not calls:
        for match in _LINE_OBJECT.finditer(text):
            verdict, end, call = _line_object(text, match.end() - 1, tools)
            if call is not None:
                calls.append(call)
                spans.append((match.end() - 1, end))
    content = text
    for start, end in reversed(spans):
        content = content[:start] + content[end:]
    return ParsedOutput(content, tuple(calls if tools.parallel else calls[:1]))


class ToolCallFilter:
    """Streams an answer's text while holding back from where a tool call may begin: the tagged markup (or a
    prefix of it at the end), a fenced block in JSON or no language, a bare JSON value opening the answer."""

    def __init__(self, tools: Tools, prefill: str = "") -> None:
        self.tools = tools
        self.text = prefill
        self.released = 0  # characters of `text` handed out as content

    def push(self, piece: str) -> str:
        """Add the next piece of the answer; returns the content that is safe to show now."""
        self.text += piece
        if not self.tools.active:
            safe = len(self.text)
        else:
            safe = max(self.released, _safe_length(self.text, self.released, self.tools))
        out, self.released = self.text[self.released : safe], safe
        return out


def _safe_length(text: str, released: int, tools: Tools) -> int:
    """How much of `text` can be shown: up to the first place a call may start (fences are read from the start,
    so a code block's closing fence is never taken for an opening one)."""
    if released == 0 and text.lstrip()[:1] in ("", "["):  # blank so far, or a bare JSON list opening it
        return 0
    pos = 0
    while True:
        tag, fence = text.find(TAG_OPEN, pos), text.find(FENCE, pos)
        line = _LINE_OBJECT.search(text, pos)
        starts = [i for i in (tag, fence, line.end() - 1 if line else -1) if i >= 0]
        if not starts:
            return len(text) - _partial_marker(text[pos:])
        first = min(starts)
        if first == tag:
            return first
        if first == fence:
            verdict, end = _fence_verdict(text, fence)
        else:
            verdict, end, _ = _line_object(text, first, tools)
        if verdict != "code":
            return 0 if not text[:first].strip() else first  # a call opening the answer: its indent is held too
        pos = max(end, first + 1)


def _undoubled(text: str) -> Any:
    """A JSON object in doubled braces, `{{"name": ...}}` (Qwen2.5's template shows its call format so, and models
    copy it), or None."""
    if not text.startswith("{{"):
        return None
    try:
        value, end = _DECODER.raw_decode(text, 1)
    except (ValueError, RecursionError):
        return None
    return value if text[end:].strip().strip("}") == "" else None


def _line_object(text: str, at: int, tools: Tools) -> tuple[str, int, ToolCall | None]:
    """The JSON object opening a line at `at` (also in doubled braces, see `_undoubled`): a call ("call", its end,
    the call), one still being written ("maybe"), or anything else ("code", where to go on from)."""
    doubled = text.startswith("{{", at)
    try:
        value, end = _DECODER.raw_decode(text, at + 1 if doubled else at)
        while doubled and text.startswith("}", end):
            end += 1
    except RecursionError:
        return "code", len(text), None
    except json.JSONDecodeError as exc:
        if exc.pos >= len(text) or exc.msg.startswith("Unterminated string") or text[at:] in ("{", "{{"):
            return "maybe", len(text), None
        newline = text.find("\n", at)
        return "code", len(text) if newline < 0 else newline, None
    rest = text[end:]
    newline = rest.find("\n")
    if (rest if newline < 0 else rest[:newline]).strip():
        return "code", end, None  # more follows on its line: prose or code, not a call
    call = _as_call(value, tools)
    if call is None:
        return "code", end, None
    return ("call" if newline >= 0 else "maybe"), end, call


def _partial_marker(tail: str) -> int:
    """Characters at the end of `tail` that may be the start of a marker still being written."""
    for n in range(min(len(tail), len(TAG_OPEN) - 1), 0, -1):
        if TAG_OPEN.startswith(tail[-n:]) or FENCE.startswith(tail[-n:]):
            return n
    return 0


def _fence_verdict(text: str, at: int) -> tuple[str, int]:
    """Whether the fenced block opening at `at` may hold a call ("maybe") or is code ("code", with where the block
    ends: after its closing fence, or the end of the text)."""
    rest = text[at + len(FENCE):]
    closes = rest.find(FENCE)
    end = len(text) if closes < 0 else at + len(FENCE) + closes + len(FENCE)
    newline = rest.find("\n")
    line = rest if newline < 0 else rest[:newline]
    head = re.match(r"([A-Za-z_]*)[ \t]*(.*)", line)
    assert head is not None  # the pattern matches any line
    lang, after = head.group(1).lower(), head.group(2)
    if newline < 0 and not after:  # the language may still be being written
        return ("maybe", end) if any(x.startswith(lang) for x in FENCE_LANGS) else ("code", end)
    if lang not in FENCE_LANGS:
        return "code", end
    body = (after + ("" if newline < 0 else rest[newline + 1 :])).lstrip()
    return ("maybe", end) if not body or body[0] in "{[" else ("code", end)
