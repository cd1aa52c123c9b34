"""Tool calls frameworks can use, on a real lane with the default model: tool schemas as LangChain
writes them (no ``additionalProperties``), every ``tool_choice`` form, and forced calls that always
come back as ``tool_calls``, also when ``max_tokens`` cuts them (partial arguments, ``finish_reason:
"length"``), streamed and not; the call's envelope never appears in ``content``."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from tests.gateway.test_openai_schema import check
from tests.http_helpers import sse
from tests.lanes.conftest import Lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

# LangChain's convert_to_openai_tool output for `def get_weather(city: str, unit: str = "celsius")`
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"default": "celsius", "type": "string", "maxLength": 12}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FORCED = ["required", "any", {"type": "function", "function": {"name": "get_weather"}},
          {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
              {"type": "function", "function": {"name": "get_weather"}}]}}]


async def chat(http: aiohttp.ClientSession, lane: Lane, body: dict[str, Any]) -> dict[str, Any]:
    """The answer as one message: streamed answers are joined from their deltas (checked on the way)."""
    async with http.post(lane.url + "/v1/chat/completions", json={"temperature": 0, **body}) as r:
        if not body.get("stream"):
            out = await r.json()
            assert r.status == 200, out
            check("CreateChatCompletionResponse", out)
            ch = out["choices"][0]
            return {**ch["message"], "finish_reason": ch["finish_reason"]}
        assert r.status == 200
        lines = await sse(r)
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    content, calls, reason = None, {}, None
    for e in events:
        check("CreateChatCompletionStreamResponse", e)
        for ch in e["choices"]:
            d = ch["delta"]
            if d.get("content"):
                content = (content or "") + d["content"]
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    calls[tc["index"]] = {"id": tc["id"], "type": "function",
                                          "function": {"name": tc["function"]["name"], "arguments": ""}}
                calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            reason = ch["finish_reason"] or reason
    msg: dict[str, Any] = {"content": content, "finish_reason": reason}
    if calls:
        msg["tool_calls"] = [calls[k] for k in sorted(calls)]
    return msg


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_calls_on_open_schemas_complete(lane: Lane, http: aiohttp.ClientSession, stream: bool) -> None:
    """Each forced form gives whole calls on LangChain-shaped schemas: closed objects by default, so
    the model cannot wander into invented keys until max_tokens."""
    for choice in FORCED:
        msg = await chat(http, lane, {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 64,
                                      "stream": stream, "parallel_tool_calls": False})
        assert msg["finish_reason"] == "tool_calls" and not msg["content"], (choice, msg)
        (call,) = msg["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        assert set(args) <= set(tool["function"]["parameters"]["properties"]), (choice, args)
        if choice not in ("required", "any"):
            assert call["function"]["name"] == "get_weather"


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_call_cut_by_length_is_still_a_call(lane: Lane, http: aiohttp.ClientSession,
                                                         stream: bool) -> None:
    """max_tokens cuts the call: partial arguments in tool_calls, finish_reason "length", no content;
    a cut before the name is written still names the one function a named choice allows."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = await chat(http, lane, {"messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": 64})
    full_args = whole["tool_calls"][0]["function"]["arguments"]
    for max_tokens in (1, 3, 9):
        msg = await chat(http, lane, {"messages": ASK, "tools": TOOLS, "tool_choice": named, "max_tokens": max_tokens,
                                      "stream": stream})
        assert msg["finish_reason"] == "length" and not msg["content"], (max_tokens, msg)
        (call,) = msg["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        assert full_args.startswith(call["function"]["arguments"]) and call["function"]["arguments"] != full_args
    # "required" over two tools: the cut call is returned once its name is known, never as content
    msg = await chat(http, lane, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 9,
                                  "stream": stream, "parallel_tool_calls": False})
    assert msg["finish_reason"] == "length" and not msg["content"], msg
    assert [c["function"]["name"] for c in msg.get("tool_calls") or []] in ([], ["get_weather"], ["add"])


async def test_allowed_tools_auto_and_open_objects(lane: Lane, http: aiohttp.ClientSession) -> None:
    """allowed_tools in mode auto limits the calls to the listed tools; a request may open its
    objects again (additional_properties_default: true) and the lane still answers well formed."""
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "add"}}]}}
    msg = await chat(http, lane, {"messages": [{"role": "user", "content": "Add 2 and 3."}], "tools": TOOLS,
                                  "tool_choice": choice, "max_tokens": 48})
    for call in msg.get("tool_calls") or []:
        assert call["function"]["name"] == "add"
    msg = await chat(http, lane, {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24,
                                  "additional_properties_default": True})
    assert msg["tool_calls"] and not msg["content"] and msg["finish_reason"] in ("tool_calls", "length")
    async with http.post(lane.url + "/v1/chat/completions", json={
            "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "add"}}}) as r:
        err = await r.json()
        assert r.status == 400 and err["error"]["param"] == "tool_choice", err
