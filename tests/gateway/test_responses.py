"""/v1/responses through a real gateway and lane (default model, SQLite file): the openai SDK's
responses calls (plain, streamed, tools and tool outputs, structured output, previous_response_id,
retrieve / delete), every body and stream event validated against the vendored subset of OpenAI's
spec (tests/schemas/openai_responses_subset.json), and bad input -> OpenAI-shaped 4xx, never a 500."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio
from pydantic import BaseModel, Field

from gateway.responses import RESPONSES
from gateway.responses_store import ResponseStore
from tests.gateway.conftest import ADMIN_KEY, GW, Lane, auth, gateway_config, running_gateway
from tests.gateway.test_openai_schema import _nullable
from tests.gateway.test_openai_schema import check as _check
from tests.gateway.test_openai_schema import check as check_chat
from tests.http_helpers import sse

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = json.loads((Path(__file__).resolve().parent.parent / "schemas" / "openai_responses_subset.json").read_text())
COMPONENTS = _nullable(SPEC["components"])
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


# stream event type -> its schema (validated one by one: a failed anyOf over every event says too little)
EVENTS = {COMPONENTS["schemas"][ref["$ref"].split("/")[-1]]["properties"]["type"]["enum"][0]: ref["$ref"].split("/")[-1]
          for ref in COMPONENTS["schemas"]["ResponseStreamEvent"]["anyOf"]}


class Place(BaseModel):
    city: str = Field(max_length=16)
    country: str = Field(max_length=16)


def check(name: str, obj: Any) -> None:
    _check(name, obj, COMPONENTS)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def stack(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    async with running_gateway(gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}])) as gw:
        yield gw


def client(gw: GW, key: str = ADMIN_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)


async def raw(http: aiohttp.ClientSession, gw: GW, body: dict[str, Any], key: str = ADMIN_KEY,
              ) -> tuple[int, Any]:
    """POST /v1/responses; a stream comes back as its list of events (each checked, names matching types)."""
    async with http.post(gw.url + "/v1/responses", json=body, headers=auth(key)) as r:
        if body.get("stream") and r.status == 200:
            lines = await sse(r)
            events = []
            name = None
            for ln in lines:
                if ln.startswith("event: "):
                    name = ln[7:]
                elif ln.startswith("data: "):
                    e = json.loads(ln[6:])
                    assert e["type"] == name and name in EVENTS, (name, e)
                    check(EVENTS[name], e)
                    events.append(e)
            assert [e["sequence_number"] for e in events] == list(range(len(events)))
            return r.status, events
        out = await r.json()
        check("Response" if r.status == 200 else "ErrorResponse", out)
        return r.status, out


async def test_plain_and_streamed_text(stack: GW, http: aiohttp.ClientSession) -> None:
    async with client(stack) as c:
        r = await c.responses.create(model="strata-default", input="What is the capital of France?",
                                     instructions="Answer in one sentence.", max_output_tokens=24, temperature=0)
        assert r.status in ("completed", "incomplete") and "Paris" in r.output_text
        assert r.usage and r.usage.input_tokens > 5 and 0 < r.usage.output_tokens <= 24
        async with c.responses.stream(model="strata-default", input="What is the capital of France?",
                                      instructions="Answer in one sentence.", max_output_tokens=24,
                                      temperature=0) as st:
            kinds = [e.type async for e in st]
            final = await st.get_final_response()
    assert final.output_text == r.output_text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds and "response.output_item.done" in kinds
    status, out = await raw(http, stack, {"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 8,
                                          "metadata": {"t": "1"}})
    assert status == 200 and out["metadata"] == {"t": "1"} and out["output"][0]["type"] == "message"
    status, events = await raw(http, stack, {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Say hello."}]}], "max_output_tokens": 2, "temperature": 0, "stream": True})
    assert status == 200 and events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    # the request log has them like chat requests: endpoint, lane, tokens
    async with http.get(stack.url + "/v1/admin/requests?limit=100", headers=auth(ADMIN_KEY)) as r:
        rows = [row for row in (await r.json())["data"] if row["endpoint"] == "/v1/responses"]
    assert len(rows) >= 4 and {row["stream"] for row in rows} == {True, False}
    assert all(row["status"] == 200 and row["lane"] == "a" and row["prompt_tokens"] > 5 and row["completion_tokens"]
               for row in rows)


@pytest.mark.parametrize("stream", [False, True])
async def test_function_tool_round_trip(stack: GW, stream: bool) -> None:
    """A forced function call on a schema without additionalProperties, its output sent back with
    previous_response_id, then a plain answer; streamed through the SDK's accumulation and not."""
    async with client(stack) as c:
        kw: dict[str, Any] = {"model": "strata-default", "input": "What is the weather in Paris?",
                              "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 48,
                              "temperature": 0}
        if stream:
            async with c.responses.stream(**kw) as st:
                r = await st.get_final_response()
        else:
            r = await c.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1, r
        assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) <= {"city"}
        nxt = await c.responses.create(model="strata-default", previous_response_id=r.id, tools=[WEATHER],
                                       input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                               "output": json.dumps({"weather": "sunny, 21 C"})}],
                                       max_output_tokens=24, temperature=0)
        assert nxt.previous_response_id == r.id and nxt.output_text
        # stateless, as agent frameworks chain with store=False: the output items go back as input
        items = [{"role": "user", "content": "What is the weather in Paris?"},
                 *[o.model_dump(exclude_none=True) for o in r.output],
                 {"type": "function_call_output", "call_id": calls[0].call_id,
                  "output": json.dumps({"weather": "sunny, 21 C"})}]
        again = await c.responses.create(model="strata-default", input=items, tools=[WEATHER], store=False,
                                         max_output_tokens=24, temperature=0)
        assert again.output_text and again.usage and nxt.usage
        assert again.usage.input_tokens == nxt.usage.input_tokens  # the same conversation either way


async def test_structured_output_and_named_choice(stack: GW) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                               "country": {"type": "string", "maxLength": 16}},
              "required": ["city", "country"]}
    async with client(stack) as c:
        r = await c.responses.create(model="strata-default", input="Name a city and its country as JSON.",
                                     text={"format": {"type": "json_schema", "name": "place", "schema": schema}},
                                     max_output_tokens=48, temperature=0)
        assert set(json.loads(r.output_text)) == {"city", "country"}  # closed: no invented keys
        parsed = await c.responses.parse(model="strata-default", input="Name a city and its country.",
                                         text_format=Place, max_output_tokens=48, temperature=0)
        assert isinstance(parsed.output_parsed, Place) and parsed.output_parsed.city
        r = await c.responses.create(model="strata-default", input="Weather in Rome?", tools=[WEATHER],
                                     tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=3)
        (call,) = [o for o in r.output if o.type == "function_call"]
        assert r.status == "incomplete" and call.name == "get_weather"  # cut by the limit: still a call


async def test_streamed_call_events(stack: GW, http: aiohttp.ClientSession) -> None:
    status, events = await raw(http, stack, {"input": "Weather in Rome?", "tools": [WEATHER], "stream": True,
                                             "tool_choice": "required", "max_output_tokens": 48,
                                             "parallel_tool_calls": False})
    kinds = [e["type"] for e in events]
    assert status == 200 and kinds[-1] == "response.completed", kinds
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    pieces = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert pieces == done["arguments"] and "city" in json.loads(pieces)
    (item,) = events[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["arguments"] == pieces and item["status"] == "completed"


async def test_previous_response_chain_store_and_keys(stack: GW, http: aiohttp.ClientSession) -> None:
    mine, other = stack.key("mine"), stack.key("other")
    async with client(stack, mine) as c:
        first = await c.responses.create(model="strata-default", input="My name is Ada. Reply OK.",
                                         max_output_tokens=8, temperature=0)
        second = await c.responses.create(model="strata-default", input="What is my name?",
                                          previous_response_id=first.id, max_output_tokens=16, temperature=0)
        assert second.usage and first.usage and second.usage.input_tokens > first.usage.input_tokens + 5
        got = await c.responses.retrieve(second.id)
        assert got.id == second.id and got.output_text == second.output_text
        items = await c.responses.input_items.list(second.id)
        texts = [p.text for it in items.data if it.type == "message" for p in it.content]  # type: ignore[union-attr]
        assert any("Ada" in t for t in texts)
        unstored = await c.responses.create(model="strata-default", input="Hi", store=False, max_output_tokens=4)
        with pytest.raises(openai.NotFoundError):
            await c.responses.retrieve(unstored.id)
    async with client(stack, other) as c:  # another key's response does not exist for this one
        for call in (c.responses.retrieve(first.id), c.responses.delete(first.id),
                     c.responses.create(model="strata-default", input="Hi", previous_response_id=first.id)):
            with pytest.raises(openai.NotFoundError) as e:
                await call
            assert e.value.status_code == 404
    async with client(stack, mine) as c:
        await c.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await c.responses.create(model="strata-default", input="Hi", previous_response_id=first.id)
    store = stack.app[RESPONSES]
    assert isinstance(store, ResponseStore) and store.get(0, second.id) is None  # key 0 (admin) is not "mine"
    assert store.purge(now=10**12) >= 1 and store.get(0, second.id) is None


async def test_bad_input_is_a_typed_4xx(stack: GW, http: aiohttp.ClientSession) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({}, "input", "missing"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, "input", "computer_call_output"),
        ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input", "call_nope"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input", "wizard"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
         "input_image"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text", "xml"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"input": "hi", "background": True}, "background", "background"),
        ({"input": "hi", "previous_response_id": 5}, "previous_response_id", "string"),
        ({"input": "hi", "max_output_tokens": "x"}, "max_output_tokens", "integer"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "hi", "metadata": {"a": 1}}, "metadata", "string values"),
        ({"input": "hi", "temperature": "hot"}, "temperature", "temperature"),
        ({"input": "hi", "stream": "yes"}, "stream", "true or false"),
        ({"input": "hi", "tool_choice": {"type": "file_search"}, "tools": [WEATHER]}, "tool_choice", "tool_choice"),
    ]
    for body, param, needle in cases:
        status, err = await raw(http, stack, {**body, "max_output_tokens": body.get("max_output_tokens", 4)})
        assert status == 400, (body, err)
        assert err["error"]["param"] == param and needle in err["error"]["message"], (body, err)
    status, err = await raw(http, stack, {"input": "hi", "previous_response_id": "resp_nope"})
    assert status == 404 and err["error"]["code"] == "previous_response_not_found"
    status, err = await raw(http, stack, {"input": "word " * 1500, "truncation": "auto"})  # the window is 1024
    assert status == 400 and err["error"]["code"] == "context_length_exceeded" and err["error"]["param"] == "input"
    async with http.post(stack.url + "/v1/responses", json={"input": "hi"}) as r:
        assert r.status == 401
        check("ErrorResponse", await r.json())
    async with http.get(stack.url + "/v1/responses/resp_nope", headers=auth(ADMIN_KEY)) as r:
        assert r.status == 404
    # the chat path still answers as before next to it
    async with http.post(stack.url + "/v1/chat/completions", headers=auth(ADMIN_KEY),
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}) as r:
        assert r.status == 200
        check_chat("CreateChatCompletionResponse", await r.json())



ODD = [None, -1, "x", [], [{}], [None], {"a": 1}, True]


async def test_odd_values_never_a_5xx(stack: GW, http: aiohttp.ClientSession) -> None:
    """Every top-level field and every input item field set to values of the wrong shape: a 200 or a
    4xx in OpenAI's shape, never a 5xx."""
    base: dict[str, Any] = {"input": "hi", "max_output_tokens": 2}
    fields = ["input", "instructions", "tools", "tool_choice", "text", "max_output_tokens", "previous_response_id",
              "store", "metadata", "parallel_tool_calls", "temperature", "top_p", "user", "stream", "model",
              "truncation", "reasoning", "include"]
    bodies = [{**base, f: v} for f in fields for v in ODD]
    item = {"type": "message", "role": "user", "content": "hi"}
    for f in ("type", "role", "content", "call_id", "output", "name", "arguments"):
        bodies += [{**base, "input": [{**item, f: v}]} for v in ODD]
        bodies += [{**base, "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                      {"type": "function_call_output", "call_id": "c1", "output": "1", f: v}]}
                   for v in ODD]
    bodies += [{**base, "text": {"format": {"type": "json_schema", "name": "x", "schema": v}}} for v in ODD]
    bodies += [{**base, "tools": [{**WEATHER, "parameters": v}]} for v in ODD]
    for body in bodies:
        status, out = await raw(http, stack, body)
        assert status == 200 or 400 <= status < 500, (body, out)


async def test_memory_and_documents_on_both_new_apis(stack: GW, http: aiohttp.ClientSession) -> None:
    """session_id and collections work on /v1/responses and /v1/messages as on chat: the turns are stored
    in the session (streamed and not) and the passages' citations come back with the answer."""
    from tests.gateway.documents.helpers import create_collection, upload, wait_done

    key = stack.key("extras")
    async with http.post(stack.url + "/v1/sessions", json={"title": "t"}, headers=auth(key)) as r:
        sid = (await r.json())["id"]
    status, _ = await raw(http, stack, {"input": "My name is Ada.", "max_output_tokens": 4, "session_id": sid}, key)
    assert status == 200
    status, _ = await raw(http, stack, {"input": "And you?", "max_output_tokens": 4, "session_id": sid,
                                        "stream": True}, key)
    assert status == 200
    async with http.post(stack.url + "/v1/messages", headers={"x-api-key": key}, json={
            "max_tokens": 4, "session_id": sid, "messages": [{"role": "user", "content": "Bye."}]}) as r:
        assert r.status == 200 and r.headers["X-Strata-Memory"].startswith("turns=4;")
    async with http.get(stack.url + f"/v1/sessions/{sid}", headers=auth(key)) as r:
        turns = (await r.json())["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant"] * 3
    assert [t["content"] for t in turns[::2]] == ["My name is Ada.", "And you?", "Bye."]
    cid = (await create_collection(http, stack.url, key, "facts"))["id"]
    _, doc = await upload(http, stack.url, key, cid, "boiler.md", b"# Boiler\n\nThe boiler pressure limit is 42 bar.")
    assert (await wait_done(http, stack.url, key, cid, doc["id"]))["status"] == "ready"
    ask = "What is the boiler pressure limit?"
    status, out = await raw(http, stack, {"input": ask, "max_output_tokens": 8, "collections": ["facts"]}, key)
    assert status == 200 and out["citations"][0]["document"] == "boiler.md"
    async with http.post(stack.url + "/v1/messages", headers={"x-api-key": key}, json={
            "max_tokens": 8, "collections": ["facts"], "messages": [{"role": "user", "content": ask}]}) as r:
        out = await r.json()
    assert r.status == 200 and out["citations"][0]["document"] == "boiler.md"
