"""Structured outputs and tools on a real lane (and through a real gateway), default model.

response_format json_object / json_schema, the openai client's parse helper with a pydantic
model, tool_choice required / named / auto with a full tool round trip (stream and not),
logit_bias over HTTP, and the strict-input 400s. Every response is also checked against the
vendored OpenAI schema subset.
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from lanes.server import EngineFactory
from tests.gateway.conftest import ADMIN_KEY, gateway_config, running_gateway
from tests.gateway.test_openai_schema import check
from tests.http_helpers import sse
from tests.lanes.conftest import Lane, lane_config, running_lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                                                    "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object schema with nested objects, arrays, enums, bounded numbers, required/optional fields;
    strings and arrays are bounded so a short max_tokens can finish them."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "number", "enum", "bool", "array"] + (["object"] if depth < 1 else []))
        if kind == "string":
            s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(3, 10)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            s = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        elif kind == "number":  # a free "number" can run on in digits until max_tokens (see docs)
            s = {"type": "number", "enum": [0.5, 1.25, rng.randint(2, 9)]}
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", "black"], rng.randint(1, 3))}
        elif kind == "bool":
            s = {"type": "boolean"}
        elif kind == "array":
            s = {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": rng.randint(1, 3)}
        else:
            s = random_schema(rng, depth + 1)
        props[f"f{i}_{kind}"] = s
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def lane(engine_factory: EngineFactory) -> AsyncIterator[Lane]:
    async with running_lane(lane_config(), engine_factory) as lane:
        yield lane


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw_url(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    async with running_gateway(gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}])) as g:
        yield g.url


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


async def chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if body.get("stream") and r.status == 200:
            lines = await sse(r)
            assert lines[-1] == "data: [DONE]"
            events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1] if ln.startswith("data: ")]
            for e in events:
                check("CreateChatCompletionStreamResponse", e)
            return r.status, events
        out = await r.json()
        check("CreateChatCompletionResponse" if r.status == 200 else "ErrorResponse", out)
        return r.status, out


def streamed_text(events: list[dict[str, Any]]) -> tuple[str, str | None]:
    text, reason = [], None
    for e in events:
        for c in e["choices"]:
            text.append(c["delta"].get("content") or "")
            reason = c["finish_reason"] or reason
    return "".join(text), reason


async def test_generated_schemas_always_validate(lane: Lane, http: aiohttp.ClientSession) -> None:
    rng = random.Random(15)
    prompts = ["Describe a fruit.", "Tell me about a planet.", "Make up a user profile.", "Hi"]
    for i in range(12):
        schema = random_schema(rng)
        body = {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "max_tokens": 96,
                "temperature": rng.choice([0, 0.8]), "seed": i,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                           "strict": True}}}
        if i % 2:
            status, events = await chat(http, lane.url, {**body, "stream": True})
            assert status == 200
            text, reason = streamed_text(events)
        else:
            status, out = await chat(http, lane.url, body)
            assert status == 200, out
            text, reason = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


async def test_json_object(lane: Lane, http: aiohttp.ClientSession) -> None:
    status, out = await chat(http, lane.url, {"messages": ASK, "max_tokens": 64, "temperature": 0,
                                              "response_format": {"type": "json_object"}})
    assert status == 200
    msg = out["choices"][0]
    if msg["finish_reason"] == "stop":
        assert isinstance(json.loads(msg["message"]["content"]), dict)
    else:
        assert msg["message"]["content"].startswith("{")


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=100)


async def test_openai_parse_helper_through_gateway(gw_url: str) -> None:
    async with client(gw_url, ADMIN_KEY) as c:
        done = await c.chat.completions.parse(
            model="strata-default", messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
            response_format=City, max_tokens=80, temperature=0)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, City), done.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_calls_round_trip(lane: Lane, stream: bool) -> None:
    async with client(lane.url) as c:
        for choice, name in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add")):
            kw: dict[str, Any] = {"model": "strata-default", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                  "max_tokens": 64, "temperature": 0}
            if stream:
                calls: dict[int, dict[str, Any]] = {}
                reason = None
                async for ev in await c.chat.completions.create(stream=True, **kw):
                    for ch in ev.choices:
                        reason = ch.finish_reason or reason
                        for d in ch.delta.tool_calls or []:
                            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                            slot["id"] = d.id or slot["id"]
                            if d.function is not None:
                                slot["name"] += d.function.name or ""
                                slot["arguments"] += d.function.arguments or ""
                assert reason == "tool_calls" and len(calls) == 1
                call_id, fn_name, fn_args = calls[0]["id"], calls[0]["name"], calls[0]["arguments"]
            else:
                out = await c.chat.completions.create(**kw)
                ch = out.choices[0]
                assert ch.finish_reason == "tool_calls" and ch.message.content is None
                assert ch.message.tool_calls and len(ch.message.tool_calls) == 1
                tc = ch.message.tool_calls[0]
                assert tc.type == "function"
                call_id, fn_name, fn_args = tc.id, tc.function.name, tc.function.arguments
            assert call_id and call_id.startswith("call_")
            if name is not None:
                assert fn_name == name
            tool = next(t for t in TOOLS if t["function"]["name"] == fn_name)
            jsonschema.validate(json.loads(fn_args), tool["function"]["parameters"])
            # the round trip: the call and its result in the history, then a plain answer
            history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": fn_name, "arguments": fn_args}}]},
                {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"result": "sunny, 21 C"})}]
            final = await c.chat.completions.create(model="strata-default", messages=history, tools=TOOLS,
                                                    tool_choice="none", max_tokens=16, temperature=0)
            assert final.choices[0].finish_reason in ("stop", "length")
            assert final.choices[0].message.content


async def test_auto_tool_choice_answers(lane: Lane, http: aiohttp.ClientSession) -> None:
    """auto: the model may call or answer; either way the response is well formed."""
    for stream in (False, True):
        status, out = await chat(http, lane.url, {"messages": ASK, "tools": TOOLS, "max_tokens": 48,
                                                  "temperature": 0, "stream": stream})
        assert status == 200
        if not stream:
            ch = out["choices"][0]
            if ch["finish_reason"] == "tool_calls":
                json.loads(ch["message"]["tool_calls"][0]["function"]["arguments"])
            else:
                assert isinstance(ch["message"]["content"], str)


async def test_logit_bias_over_http(lane: Lane, http: aiohttp.ClientSession) -> None:
    tok = lane.state.engine.tokenizer
    base = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 10,
            "temperature": 0}
    _, out = await chat(http, lane.url, {**base, "logprobs": True})
    first = out["choices"][0]["logprobs"]["content"][0]["token"]
    banned = tok.encode(first, add_special=False)
    assert len(banned) == 1
    _, out = await chat(http, lane.url, {**base, "logprobs": True, "logit_bias": {str(banned[0]): -100}})
    assert all(t["token"] != first for t in out["choices"][0]["logprobs"]["content"])
    forced = tok.encode(" zebra", add_special=False)[-1]
    _, out = await chat(http, lane.url, {**base, "max_tokens": 4, "logit_bias": {str(forced): 100}})
    assert out["choices"][0]["message"]["content"] == tok.decode([forced] * 4)
    for bad in ({"x": 1}, {"5": 101}, {str(10**7): 1}):
        status, err = await chat(http, lane.url, {**base, "logit_bias": bad})
        assert status == 400 and err["error"]["param"] == "logit_bias", err


async def test_bad_requests_are_typed_400s(lane: Lane, http: aiohttp.ClientSession, gw_url: str) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "wizard"),
        ({"messages": [{"role": "tool", "content": "hi"}]}, "messages", "tool_call_id"),
        ({"messages": ASK, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice", "nope"),
        ({"messages": ASK, "tools": [{"type": "function"}]}, "tools", "tools[0]"),
        ({"messages": ASK, "response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}},
         "response_format", "schema"),
    ]
    for body, param, needle in cases:
        status, err = await chat(http, lane.url, {**body, "max_tokens": 4})
        assert status == 400 and err["error"]["param"] == param and needle in err["error"]["message"], err
    # a lone surrogate, escaped in the JSON text (the client cannot encode it itself)
    raw = b'{"messages": [{"role": "user", "content": "bad \\ud800 text"}], "max_tokens": 4}'
    for url, headers in ((lane.url, {}), (gw_url, {"Authorization": f"Bearer {ADMIN_KEY}"})):
        async with http.post(url + "/v1/chat/completions", data=raw,
                             headers={**headers, "Content-Type": "application/json"}) as r:
            err = await r.json()
            assert r.status == 400, err
            check("ErrorResponse", err)
            assert "surrogate" in err["error"]["message"]
    status, _ = await chat(http, lane.url, {"messages": ASK, "max_tokens": 2})
    assert status == 200  # the lane keeps serving


async def test_gateway_window_counts_tool_definitions(lane: Lane, gw_url: str, http: aiohttp.ClientSession) -> None:
    """Tool definitions are part of the prompt: the gateway's precheck counts them and clamps
    max_tokens to fit (not counted, the lane would refuse the request as too long)."""
    pick = {"type": "function", "function": {
        "name": "pick", "description": " ".join(f"Option {i} means colour number {i}." for i in range(40)),
        "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"],
                       "additionalProperties": False}}}
    counts = []
    for extra in ({}, {"tools": [pick]}):
        async with http.post(lane.url + "/tokenize", json={"messages": ASK, **extra}) as r:
            counts.append((await r.json())["count"])
    n_ctx = lane.state.engine.n_ctx
    assert counts[1] > counts[0] + 300 and counts[1] < n_ctx - 100
    body = {"messages": ASK, "tools": [pick], "tool_choice": {"type": "function", "function": {"name": "pick"}},
            "max_tokens": n_ctx - counts[0] - 1, "temperature": 0}
    async with http.post(gw_url + "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
        out = await r.json()
        assert r.status == 200, out
    call = out["choices"][0]["message"]["tool_calls"][0]
    assert call["function"]["name"] == "pick" and json.loads(call["function"]["arguments"])["n"] in (1, 2, 3)
