"""The real pair answers a weather question with a `get_weather` call and then uses the tool's answer, through a
real 2-peer testnet and `dsd-node serve`, with the official `openai` client (greedy, so the exchange is the
target's own), in float32 (the exchange docs/usage.md shows). Marked realmodels: skipped where the float32 pair is
not prepared, never run in CI."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from support.processes import cli_serve, cli_testnet
from support.real import needs_fp32_pair, realmodels

from dsd.shard_store.default_models import default_store_paths

pytestmark = [realmodels, needs_fp32_pair, pytest.mark.network, pytest.mark.timeout(1200)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                   "required": ["city"]}}}
SYSTEM = ("You are a helpful assistant. Call a tool when you need data; once a tool has answered, answer the user in "
          "one sentence.")


def test_the_real_pair_calls_get_weather_and_then_uses_its_answer(tmp_path: Path) -> None:
    paths = default_store_paths(weights="fp32")
    (tmp_path / "net").mkdir()
    (tmp_path / "serve").mkdir()
    with cli_testnet(tmp_path / "net", "--store", str(paths["target"]), "--peers", "2") as net, \
            cli_serve(tmp_path / "serve", net["bootstrap"], paths["target"], "--draft", str(paths["draft"])) as info:
        client = openai.OpenAI(base_url=info["url"] + "/v1", api_key="none", max_retries=0, timeout=900)
        messages: list[dict] = [{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": "What is the weather in Paris?"}]
        first = client.chat.completions.create(model=info["model"], messages=messages, tools=[WEATHER], temperature=0,
                                               max_tokens=64)
        print("first:", first.choices[0].model_dump_json())
        (call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "condition": "sunny"})}]
        second = client.chat.completions.create(model=info["model"], messages=messages, tools=[WEATHER], temperature=0,
                                                max_tokens=64)
        print("second:", second.choices[0].model_dump_json())
        answer = second.choices[0].message.content
        assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
        assert "18" in answer and "sunny" in answer.lower()
