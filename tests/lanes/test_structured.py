"""Structured outputs and tools on a real lane (and through a real gateway), default model.

response_format json_object / json_schema, the openai client's parse helper with a pydantic
model, tool_choice required / named / auto with a full tool round trip (stream and not),
logit_bias over HTTP, and the strict-input 400s. Every response is also checked against the
vendored OpenAI schema subset.
"""

from __future__ import annotations

import asyncio
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

from lanes.tools import MAX_TOOL_CALLS
from tests.gateway.conftest import ADMIN_KEY, gateway_config, running_gateway
from tests.gateway.test_openai_schema import check
from tests.http_helpers import sse
from tests.lanes.conftest import Lane

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
    """An object schema of 1..3 fields (1..2 when nested): nested objects, arrays (of enums, bounded
    integers or small objects), enums, integers and numbers with bounds, strings, booleans, some
    required and some optional. Strings, arrays and numbers are bounded (a number's digits by
    multipleOf) so a modest max_tokens always completes the value."""
    props: dict[str, Any] = {}
    kinds = ["string", "integer", "number", "enum", "bool", "array"] + (["object"] * 2 if depth < 1 else [])
    for i in range(rng.randint(1, 3 if depth == 0 else 2)):
        kind = rng.choice(kinds)
        if kind == "string":
            s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(3, 8)}
            if rng.random() < 0.3:
                s["minLength"] = 1
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            s = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
        elif kind == "number":  # bounds, and multipleOf so the digits end (a free number may not)
            lo = rng.choice([-10, 0, 0.5, 2])
            s = {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1, 5, 20]),
                 "multipleOf": rng.choice([0.5, 0.25, 1])}
            if rng.random() < 0.3:
                s["exclusiveMinimum"] = s.pop("minimum")
        elif kind == "enum":
            s = {"enum": rng.sample(["red", "green", "blue", "cyan", "black", 3, None], rng.randint(1, 3))}
        elif kind == "bool":
            s = {"type": "boolean"}
        elif kind == "array":
            item = rng.choice([{"enum": ["a", "b", "c"]}, {"type": "integer", "minimum": 0, "maximum": 9},
                               {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"],
                                "additionalProperties": False}])
            s = {"type": "array", "items": item, "maxItems": rng.randint(1, 2)}
            if rng.random() < 0.5:
                s["minItems"] = 1
        else:
            s = random_schema(rng, depth + 1)
        props[f"f{i}_{kind}"] = s
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw_url(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    # the 100-schema test queues 50 requests behind each other on purpose: a queued stream's first
    # token may take longer than the default 120 s on a loaded 2-core machine
    cfg = gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}], first_token_timeout_s=600)
    async with running_gateway(cfg) as g:
        yield g.url


def client(base: str, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=120)


async def chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with http.post(url + "/v1/chat/completions", json=body, headers=headers or {}) as r:
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


N_SCHEMAS = 100
PROMPTS = ["Describe a fruit.", "Tell me about a planet.", "Make up a user profile.", "Hi",
           "List some settings for a game.", "What is the weather like?"]


@pytest.mark.slow  # ~110 engine steps of up to 32 sequences: minutes on a loaded 2-core machine
async def test_generated_schemas_always_validate(lane: Lane, gw_url: str, http: aiohttp.ClientSession) -> None:
    """Must-show 1: 100 seeded schemas x prompts, all at once (the lane batches them), half through
    the gateway and half straight to the lane, half streamed: every answer parses and validates."""
    rng = random.Random(15)
    schemas = [random_schema(rng) for _ in range(N_SCHEMAS)]
    text = json.dumps(schemas)
    for kind in ("object", "array", "enum", "number", "integer", "string", "bool"):  # what the generator covers
        assert text.count(f'_{kind}"') >= 20, kind
    assert sum(len(s["required"]) < len(s["properties"]) for s in schemas) >= 20  # optional fields
    sched = lane.state.aeng.scheduler
    most = 0

    async def one(i: int, schema: dict[str, Any]) -> None:
        body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], "max_tokens": 80,
                "temperature": (0, 0.8)[i % 3 == 2], "seed": i, "stream": i % 2 == 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                           "strict": True}}}
        url, headers = (gw_url, {"Authorization": f"Bearer {ADMIN_KEY}"}) if i % 4 < 2 else (lane.url, {})
        status, out = await chat(http, url, body, headers)
        assert status == 200, out
        if body["stream"]:
            text, reason = streamed_text(out)
        else:
            text, reason = out["choices"][0]["message"]["content"], out["choices"][0]["finish_reason"]
        assert reason == "stop", (i, schema, text)
        jsonschema.validate(json.loads(text), schema)

    async def watch() -> None:
        nonlocal most
        while True:
            most = max(most, sched.num_running)
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
    finally:
        watcher.cancel()
    assert most >= 8, most  # they really ran side by side


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


async def stream_calls(c: openai.AsyncOpenAI, kw: dict[str, Any]) -> tuple[list[Any], str | None]:
    """The tool_calls deltas of a streamed answer, in order, and its finish reason."""
    deltas, reason = [], None
    async for ev in await c.chat.completions.create(stream=True, **kw):
        for ch in ev.choices:
            reason = ch.finish_reason or reason
            deltas.extend(ch.delta.tool_calls or [])
    return deltas, reason


def check_calls(calls: list[Any], tools: list[dict[str, Any]]) -> None:
    """Every call names one of ``tools``, has its own id, and its arguments validate."""
    assert len({tc.id for tc in calls}) == len(calls) and all(tc.id.startswith("call_") for tc in calls)
    for tc in calls:
        assert tc.type == "function"
        tool = next(t for t in tools if t["function"]["name"] == tc.function.name)
        jsonschema.validate(json.loads(tc.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
async def test_forced_tool_calls_round_trip(lane: Lane, stream: bool) -> None:
    """required and a named function always give valid calls; the calls and their results in the
    history, then a plain answer (the openai client's own stream accumulation when streamed)."""
    async with client(lane.url) as c:
        for choice, name in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add")):
            kw: dict[str, Any] = {"model": "strata-default", "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                                  "max_tokens": 64, "temperature": 0}
            if stream:
                async with c.chat.completions.stream(**kw) as st:
                    done = await st.get_final_completion()
            else:
                done = await c.chat.completions.create(**kw)
            ch = done.choices[0]
            assert ch.finish_reason == "tool_calls" and not ch.message.content
            calls = ch.message.tool_calls or []
            assert calls
            check_calls(calls, TOOLS)
            if name is not None:
                assert [tc.function.name for tc in calls] == [name] * len(calls)
            history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                {"id": tc.id, "type": "function", "function": {"name": tc.function.name,
                                                                "arguments": tc.function.arguments}}
                for tc in calls]}]
            history += [{"role": "tool", "tool_call_id": tc.id, "content": json.dumps({"result": "sunny, 21 C"})}
                        for tc in calls]
            final = await c.chat.completions.create(model="strata-default", messages=history, tools=TOOLS,
                                                    tool_choice="none", max_tokens=16, temperature=0)
            assert final.choices[0].finish_reason in ("stop", "length")
            assert final.choices[0].message.content


async def test_tool_call_streams_as_incremental_deltas(lane: Lane, gw_url: str) -> None:
    """A call streams as OpenAI does: a head (index, id, type, name, arguments "") as soon as the
    name is written, then pieces of the arguments as they are generated; joined, they are the
    non-streamed call, and the openai client's accumulation rebuilds it (through the gateway)."""
    kw: dict[str, Any] = {"model": "strata-default", "messages": ASK, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                          "max_tokens": 64, "temperature": 0}
    async with client(lane.url) as c:
        whole = (await c.chat.completions.create(**kw)).choices[0].message.tool_calls
        deltas, reason = await stream_calls(c, kw)
    async with client(gw_url, ADMIN_KEY) as c, c.chat.completions.stream(**kw) as st:
        rebuilt = (await st.get_final_completion()).choices[0].message.tool_calls
    assert reason == "tool_calls" and whole and len(whole) == 1
    head, rest = deltas[0], deltas[1:]
    assert head.index == 0 and head.id and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather"
    assert len(rest) >= 3, deltas  # the arguments came in pieces, not in one delta
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments or "" for d in deltas) == whole[0].function.arguments
    assert rebuilt and len(rebuilt) == 1 and rebuilt[0].function.name == "get_weather"
    assert rebuilt[0].function.arguments == whole[0].function.arguments


LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look up an item by its number",
    "parameters": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["id"], "additionalProperties": False}}}


def array_bias(lane: Lane) -> dict[str, int]:
    """logit_bias that makes the model open a JSON array and never close it early: +100 on tokens
    starting with "[", -100 on tokens holding "]" (the grammar still closes it after the last call
    it allows). With parallel_tool_calls false the grammar allows no array at all."""
    tok = lane.state.engine.tokenizer
    bias = {}
    for i in range(tok.vocab_size):
        raw = tok.token_bytes(i)
        if b"]" in raw:
            bias[str(i)] = -100
        elif raw.startswith(b"["):
            bias[str(i)] = 100
    assert len(bias) <= 300
    return bias


async def test_parallel_tool_calls(lane: Lane) -> None:
    """Several calls in one answer unless parallel_tool_calls is false; then one at most (exactly
    one for required), whatever the model prefers; streamed through the openai client's
    accumulation and not; all at once so the lane batches them."""
    bias = array_bias(lane)

    def kw(choice: str, **extra: Any) -> dict[str, Any]:
        return {"model": "strata-default", "tools": [LOOKUP, ADD], "tool_choice": choice,
                "messages": [{"role": "user", "content": "Look up items 1, 2 and 3."}],
                "max_tokens": 160, "temperature": 0, "logit_bias": bias, **extra}

    async with client(lane.url) as c:
        async def streamed(choice: str) -> Any:
            async with c.chat.completions.stream(**kw(choice)) as st:
                return await st.get_final_completion()

        answers = await asyncio.gather(  # several calls: required not streamed, auto streamed; then one
            c.chat.completions.create(**kw("required")), streamed("auto"),
            c.chat.completions.create(**kw("required", parallel_tool_calls=False)),
            c.chat.completions.create(**kw("auto", parallel_tool_calls=False)))
    for choice, done in zip(("required", "auto"), answers[:2], strict=True):
        ch = done.choices[0]
        assert ch.finish_reason == "tool_calls", (choice, ch)
        calls = ch.message.tool_calls or []
        assert 2 <= len(calls) <= MAX_TOOL_CALLS, (choice, calls)
        check_calls(calls, [LOOKUP, ADD])
    for choice, single in zip(("required", "auto"), answers[2:], strict=True):
        calls = single.choices[0].message.tool_calls or []
        assert len(calls) == 1 if choice == "required" else len(calls) <= 1, (choice, calls)
        if calls:
            assert single.choices[0].finish_reason == "tool_calls"
            check_calls(calls, [LOOKUP, ADD])


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
