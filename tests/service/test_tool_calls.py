"""Tool calls as the model really writes them: tagged, fenced and bare JSON calls parsed into OpenAI's
`tool_calls`; malformed or unknown-tool output left as text; the streaming filter never shows call markup as
content and never holds back ordinary text or code for good; requests' tools, tool_choice and strict fields."""

from __future__ import annotations

import json

import pytest

from dsd.node.service.openai_wire import call_deltas, parse_request
from dsd.node.service.tool_calls import ToolCallFilter, Tools, parse_output, parse_tools
from dsd.node.service.wire_errors import WireError

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = parse_tools({"tools": [WEATHER, TIME]})
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

CALLS = {
    "tagged": f"<tool_call>\n{CALL}\n</tool_call>",
    "tagged, unclosed at the end": f"<tool_call>\n{CALL}\n",
    "tagged, doubled braces": f"<tool_call>\n{{{CALL}}}\n</tool_call>",
    "fenced json (what Qwen2.5-Coder-1.5B writes)": f"```json\n{CALL}\n```",
    "fenced on one line": f"```json {CALL} ```",
    "fenced, no language": f"```\n{CALL}\n```",
    "bare": f"  {CALL}\n",
    "arguments as a JSON string": '{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
    "parameters instead of arguments": '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>',
}
# What the real 1.5B target wrote, sampling at temperature 1 for the OpenAI Agents SDK's example: a call on its own
# line(s) after other markup.
CALLS_AMID_TEXT = {
    "after an empty tools element": ('<tools></tools>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
                                     "<tools></tools>"),
    "doubled braces, as Qwen2.5's template shows the format": ('<tools></tools>\n\n{{"name": "get_weather", '
                                                              '"arguments": {"city": "Paris"}}}}', "<tools></tools>"),
    "indented inside an element": ('<response>\n    {\n        "name": "get_weather",\n        "arguments": '
                                   '{"city": "Paris"}\n    }\n</response>', "<response>\n    \n</response>"),
}


def streamed(text: str, tools: Tools = TOOLS, prefill: str = "", step: int = 1) -> str:
    f = ToolCallFilter(tools, prefill)
    return "".join(f.push(text[i : i + step]) for i in range(0, len(text), step))


@pytest.mark.parametrize("text", CALLS.values(), ids=CALLS.keys())
def test_each_form_is_one_call_and_no_content(text: str) -> None:
    out = parse_output(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"})]
    assert out.content.strip() == ""
    assert out.calls[0].id.startswith("call_") and out.calls[0].as_dict()["type"] == "function"
    assert streamed(text) == ""  # nothing of the markup is shown as content while streaming


@pytest.mark.parametrize(("text", "content"), CALLS_AMID_TEXT.values(), ids=CALLS_AMID_TEXT.keys())
def test_a_call_on_its_own_lines_amid_other_text(text: str, content: str) -> None:
    out = parse_output(text, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_weather", {"city": "Paris"})]
    assert out.content.strip() == content
    shown = streamed(text)
    assert out.content.startswith(shown) and "get_weather" not in shown


def test_text_before_calls_streams_and_parallel_calls_are_all_kept() -> None:
    text = f"Let me look.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" \
           '{"name": "get_time", "arguments": {}}\n</tool_call>'
    out = parse_output(text, TOOLS)
    assert [c.name for c in out.calls] == ["get_weather", "get_time"] and out.content.strip() == "Let me look."
    assert len({c.id for c in out.calls}) == 2
    assert streamed(text, step=3) == "Let me look.\n"
    single = parse_tools({"tools": [WEATHER, TIME], "parallel_tool_calls": False})
    assert [c.name for c in parse_output(text, single).calls] == ["get_weather"]


MALFORMED = {
    "cut mid-arguments": '<tool_call>\n{"name": "get_weather", "arguments": {"city": ',
    "unknown tool": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    "arguments not an object": '```json\n{"name": "get_weather", "arguments": [1, 2]}\n```',
    "extra keys": '{"name": "get_weather", "arguments": {}, "why": "because"}',
    "not JSON": "<tool_call>get_weather(city='Paris')</tool_call>",
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_calls_stay_text(text: str) -> None:
    out = parse_output(text, TOOLS)
    assert out.calls == () and out.content == text


ORDINARY = ["def f(x):\n    return x < 3  # a < b\n", "Use `json.loads` here.", "x = {\n  'a': 1\n}\nprint(x)\n",
            '{"a": 1} is a dict', 'Call it so:\n{"name": "get_weather", "arguments": {}} and then wait.\n',
            '{:line=>1, :meta=>{:id=>"get_weather"}}\nThat is Ruby.',
            "```python\nprint({'name': 1})\n```\nDone.", "```js\n{a: 1}\n```", "```json\n[1, 2, 3]\n```"]


@pytest.mark.parametrize("text", ORDINARY)
def test_ordinary_text_and_code_are_content(text: str) -> None:
    assert parse_output(text, TOOLS).calls == ()
    shown = streamed(text)
    assert text.startswith(shown)
    if "```json" not in text:  # code that cannot be a call is shown as it comes (a json block is held to the end)
        assert shown == text.rstrip("`") or shown == text


def test_without_tools_or_with_choice_none_nothing_is_parsed_or_held() -> None:
    for tools in (Tools(), parse_tools({"tools": [WEATHER], "tool_choice": "none"})):
        assert parse_output(CALLS["tagged"], tools).calls == ()
        assert streamed(CALLS["tagged"], tools) == CALLS["tagged"]


def test_a_required_call_is_prefilled_and_held_from_the_start() -> None:
    named = parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.forced and named.prefill() == '<tool_call>\n{"name": "get_time", "arguments": '
    required = parse_tools({"tools": [WEATHER], "tool_choice": "required"})
    assert required.prefill() == '<tool_call>\n{"name": "'
    rest = '{"zone": "UTC"}}\n</tool_call>'
    assert streamed(rest, named, named.prefill()) == ""
    out = parse_output(named.prefill() + rest, named)
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [("get_time", {"zone": "UTC"})]


STRICT = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string"}, "unit": {"anyOf": [{"enum": ["C", "F"]}, {"type": "null"}]}},
}}}


@pytest.mark.parametrize(("arguments", "is_call"), [
    ({"city": "Paris", "unit": "C"}, True),
    ({"city": "Paris", "unit": None}, True),
    ({"city": "Paris"}, False),  # a required key missing
    ({"city": "Paris", "unit": "K"}, False),  # outside the enum
    ({"city": 75001, "unit": "C"}, False),  # a wrong type
    ({"city": "Paris", "unit": "C", "zip": "75001"}, False),  # additionalProperties false
])
def test_a_strict_tools_calls_conform_to_its_schema_or_stay_text(arguments: dict, is_call: bool) -> None:
    """Strict mode's promise kept by checking (decoding is not constrained): a call that breaks the schema is text."""
    tools = parse_tools({"tools": [STRICT]})
    text = "<tool_call>" + json.dumps({"name": "get_weather", "arguments": arguments}) + "</tool_call>"
    out = parse_output(text, tools)
    assert bool(out.calls) == is_call and (out.content == text) != is_call
    assert "strict" not in json.dumps(tools.shown)  # the template shows the function, not our mark
    assert bool(parse_output(text, parse_tools({"tools": [WEATHER]})).calls)  # not strict: any object is a call


def test_call_deltas_are_openai_chunks() -> None:
    (call,) = parse_output(CALLS["tagged"], TOOLS).calls
    assert call_deltas([call]) == [
        [{"index": 0, "id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}],
    ]


def chat(**fields) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


REFUSED = {
    "unknown field": ({"temprature": 0.5}, "temprature"),
    "presence_penalty": ({"presence_penalty": 0.5}, "presence_penalty"),
    "frequency_penalty": ({"frequency_penalty": -1}, "frequency_penalty"),
    "n > 1": ({"n": 2}, "n"),
    "logit_bias": ({"logit_bias": {"5": 10}}, "logit_bias"),
    "json mode": ({"response_format": {"type": "json_object"}}, "response_format"),
    "store": ({"store": True}, "store"),
    "top_logprobs without logprobs": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs > 20": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "stream_options without stream": ({"stream_options": {"include_usage": True}}, "stream_options"),
    "unknown stream option": ({"stream": True, "stream_options": {"everything": True}}, "stream_options"),
    "tool_choice without tools": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice naming no tool": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                                   "tool_choice"),
    "a tool that is not a function": ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    "a bad function name": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
                            "tools[0].function.name"),
    "strict not a flag": ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
                          "tools[0].function.strict"),
    "duplicate tools": ({"tools": [WEATHER, WEATHER]}, "tools"),
}


@pytest.mark.parametrize(("fields", "param"), REFUSED.values(), ids=REFUSED.keys())
def test_unsupported_or_unknown_fields_get_a_400_naming_them(fields: dict, param: str) -> None:
    with pytest.raises(WireError) as err:
        parse_request(chat(**fields), chat=True)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_completions_refuse_chat_only_fields_and_bound_logprobs() -> None:
    for fields, param in (({"tools": [WEATHER]}, "tools"), ({"logprobs": 6}, "logprobs"), ({"suffix": "x"}, "suffix")):
        with pytest.raises(WireError) as err:
            parse_request(json.dumps({"model": "m", "prompt": "x", **fields}).encode(), chat=False)
        assert err.value.param == param


def test_accepted_no_op_values_and_the_conversation_of_a_tool_call() -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
    ]
    req = parse_request(json.dumps({
        "model": "m", "messages": messages, "tools": [WEATHER], "presence_penalty": 0, "frequency_penalty": 0.0,
        "logit_bias": {}, "n": 1, "store": False, "user": "alice", "response_format": {"type": "text"},
        "logprobs": True, "top_logprobs": 2, "max_completion_tokens": 9, "seed": 5,
    }).encode(), chat=True)
    assert req.tools.choice == "auto" and req.tools.names == ("get_weather",)
    assert req.logprobs == 2 and req.max_tokens == 9 and req.seed == 5
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as templates take it
    assert req.messages[2] == {"role": "tool", "content": '{"temp_c": 18}', "tool_call_id": "call_1"}
    bad = [*messages[:2], {"role": "tool", "content": "18"}]
    with pytest.raises(WireError) as err:
        parse_request(json.dumps({"model": "m", "messages": bad}).encode(), chat=True)
    assert err.value.param == "messages[2].tool_call_id"
