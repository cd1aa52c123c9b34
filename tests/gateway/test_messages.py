"""/v1/messages and /v1/messages/count_tokens through a real gateway and lane (default model, SQLite
file): the anthropic SDK's messages calls (plain, streamed, tools and tool results, stop sequences,
count_tokens), keys as x-api-key, every body and stream event validated against the SDK's own
response types (tests/schemas/anthropic_subset.json), bad input -> Anthropic-shaped 4xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
import pytest_asyncio
from jsonschema import Draft202012Validator

from tests.gateway.conftest import ADMIN_KEY, GW, Lane, gateway_config, running_gateway
from tests.http_helpers import sse

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = json.loads((Path(__file__).resolve().parent.parent / "schemas" / "anthropic_subset.json").read_text())
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def check(name: str, obj: Any) -> None:
    v = Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": SPEC["$defs"]})
    errors = list(v.iter_errors(obj))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]) + \
        f"\n{json.dumps(obj)[:1500]}"


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    async with running_gateway(gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}])) as gw:
        yield gw


def client(gw: GW, key: str = ADMIN_KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120)


async def raw(http: aiohttp.ClientSession, gw: GW, body: dict[str, Any], path: str = "/v1/messages",
              headers: dict[str, str] | None = None) -> tuple[int, Any]:
    hdrs = {"x-api-key": ADMIN_KEY, "anthropic-version": "2023-06-01"} if headers is None else headers
    async with http.post(gw.url + path, json=body, headers=hdrs) as r:
        if body.get("stream") and r.status == 200:
            events, name = [], None
            for ln in await sse(r):
                if ln.startswith("event: "):
                    name = ln[7:]
                elif ln.startswith("data: "):
                    e = json.loads(ln[6:])
                    assert e["type"] == name, (name, e)
                    check("RawMessageStreamEvent", e)
                    events.append(e)
            return r.status, events
        out = await r.json()
        if r.status != 200:
            check("ErrorResponse", out)
        elif path.endswith("count_tokens"):
            check("MessageTokensCount", out)
        else:
            check("Message", out)
        return r.status, out


async def test_plain_streamed_and_stop_sequences(stack: GW, http: aiohttp.ClientSession) -> None:
    async with client(stack) as c:
        m = await c.messages.create(model="strata-default", max_tokens=24, messages=ASK,
                                    system="Answer in one sentence.", extra_body={"temperature": 0})
        text = "".join(b.text for b in m.content if b.type == "text")
        assert "Paris" in text and m.stop_reason in ("end_turn", "max_tokens") and m.role == "assistant"
        assert m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 24
        async with c.messages.stream(model="strata-default", max_tokens=24, messages=ASK,
                                     system="Answer in one sentence.", extra_body={"temperature": 0}) as st:
            kinds = [e.type async for e in st]
            final = await st.get_final_message()
        assert "".join(b.text for b in final.content if b.type == "text") == text
        assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
        m = await c.messages.create(model="strata-default", max_tokens=24, messages=ASK, system="Answer in one "
                                    "sentence.", stop_sequences=["Paris"], extra_body={"temperature": 0})
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == "Paris"
        assert "Paris" not in "".join(b.text for b in m.content if b.type == "text")
    status, events = await raw(http, stack, {"max_tokens": 2, "temperature": 0, "stream": True, "system": [
        {"type": "text", "text": "Be brief."}], "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Say hello."}]}]})
    assert status == 200 and events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[0]["message"]["usage"]["input_tokens"] > 5 and events[-2]["usage"]["output_tokens"] == 2
    async with http.get(stack.url + "/v1/admin/requests?limit=100", headers={"x-api-key": ADMIN_KEY}) as r:
        rows = [row for row in (await r.json())["data"] if row["endpoint"] == "/v1/messages"]
    assert len(rows) >= 4 and {row["stream"] for row in rows} == {True, False}
    assert all(row["status"] == 200 and row["prompt_tokens"] > 5 and row["completion_tokens"] for row in rows)


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_round_trip(stack: GW, stream: bool) -> None:
    async with client(stack) as c:
        kw: dict[str, Any] = {"model": "strata-default", "max_tokens": 48, "extra_body": {"temperature": 0},
                              "tools": [WEATHER],
                              "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                              "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
        if stream:
            async with c.messages.stream(**kw) as st:
                m = await st.get_final_message()
        else:
            m = await c.messages.create(**kw)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and len(uses) == 1, m
        assert uses[0].name == "get_weather" and set(uses[0].input) <= {"city"}  # type: ignore[arg-type]
        history = [*kw["messages"], {"role": "assistant", "content": [b.model_dump() for b in m.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                 "content": "sunny, 21 C"}]}]
        final = await c.messages.create(model="strata-default", max_tokens=24, tools=[WEATHER], messages=history,
                                        tool_choice={"type": "none"}, extra_body={"temperature": 0})
        assert final.stop_reason in ("end_turn", "max_tokens") and final.content[0].type == "text"
        cut = await c.messages.create(**{**kw, "max_tokens": 3, "tool_choice": {"type": "tool", "name": "get_weather"}})
        assert cut.stop_reason == "max_tokens" and [b.type for b in cut.content] == ["tool_use"]


async def test_count_tokens_and_x_api_key(stack: GW, http: aiohttp.ClientSession) -> None:
    key = stack.key("anthropic-style")
    async with client(stack, key) as c:
        plain = await c.messages.count_tokens(model="strata-default", messages=ASK)
        more = await c.messages.count_tokens(model="strata-default", messages=ASK, system="Be brief.",
                                             tools=[WEATHER])  # type: ignore[list-item]
        m = await c.messages.create(model="strata-default", max_tokens=2, messages=ASK)
    assert plain.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    assert more.input_tokens > plain.input_tokens + 10
    status, out = await raw(http, stack, {"messages": ASK}, "/v1/messages/count_tokens",
                            {"Authorization": f"Bearer {key}"})
    assert status == 200 and out["input_tokens"] == plain.input_tokens
    limited = stack.key("one-a-minute", rpm=1)  # counting is a request like any other for the key's limits
    for want in (200, 429):
        status, out = await raw(http, stack, {"messages": ASK}, "/v1/messages/count_tokens", {"x-api-key": limited})
        assert status == want, out
    assert out["error"]["type"] == "rate_limit_error"
    status, out = await raw(http, stack, {"max_tokens": 2, "messages": ASK}, headers={"x-api-key": limited})
    assert status == 429 and out["error"]["type"] == "rate_limit_error"


async def test_bad_input_is_an_anthropic_error(stack: GW, http: aiohttp.ClientSession) -> None:
    tool_use = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                  "input": {"city": "Paris"}}]}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": ASK}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "non-empty"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]}, "role"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x",
                                                                      "content": "1"}]}]}, "no earlier"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]}, "hologram"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "q"}, tool_use, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "1"}]}]}, "toolu_2"),
        ({"max_tokens": 4, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "web_search"),
        ({"max_tokens": 4, "messages": ASK, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}},
         "nope"),
        ({"max_tokens": 4, "messages": ASK, "stop_sequences": "x"}, "stop_sequences"),
        ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "The"}]}, "prefill"),
        ({"max_tokens": "many", "messages": ASK}, "max_tokens"),
    ]
    for body, needle in cases:
        status, err = await raw(http, stack, body)
        assert status == 400 and err["error"]["type"] == "invalid_request_error", (body, err)
        assert needle in err["error"]["message"], (body, err)
    for headers, want in (({}, 401), ({"x-api-key": "sk-strata-nope"}, 401)):
        status, err = await raw(http, stack, {"max_tokens": 4, "messages": ASK}, headers=headers)
        assert status == want and err["error"]["type"] == "authentication_error", err
    async with client(stack, "sk-strata-nope") as c:
        with pytest.raises(anthropic.AuthenticationError):
            await c.messages.create(model="strata-default", max_tokens=4, messages=ASK)  # type: ignore[arg-type]
    async with client(stack) as c:
        with pytest.raises(anthropic.BadRequestError) as e:
            await c.messages.create(model="strata-default", max_tokens=4, messages=[])
        assert e.value.status_code == 400


ODD = [None, -1, "x", [], [{}], [None], {"a": 1}, True]


async def test_odd_values_never_a_5xx(stack: GW, http: aiohttp.ClientSession) -> None:
    """Every top-level field and every block field set to values of the wrong shape: a 200 or a 4xx in
    Anthropic's shape, never a 5xx; count_tokens likewise."""
    base: dict[str, Any] = {"max_tokens": 2, "messages": ASK}
    fields = ["model", "max_tokens", "messages", "system", "stop_sequences", "tools", "tool_choice", "temperature",
              "top_p", "top_k", "metadata", "stream", "thinking"]
    bodies = [{**base, f: v} for f in fields for v in ODD]
    use = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}
    for f in ("type", "text", "id", "name", "input", "tool_use_id", "content", "is_error"):
        for v in ODD:
            bodies.append({**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", f: v}]}]})
            bodies.append({**base, "messages": [ASK[0], {"role": "assistant", "content": [{**use, f: v}]},
                                                {"role": "user", "content": [{**result, f: v}]}]})
    bodies += [{**base, "tools": [{**WEATHER, "input_schema": v}]} for v in ODD]
    for body in bodies:
        status, out = await raw(http, stack, body)
        assert status == 200 or 400 <= status < 500, (body, out)
    for f in ("messages", "system", "tools", "tool_choice"):
        for v in ODD:
            status, out = await raw(http, stack, {"messages": ASK, f: v}, "/v1/messages/count_tokens")
            assert status == 200 or 400 <= status < 500, (f, v, out)
