"""Chat formats through a real lane: small random gpt-oss and glm4moe GGUFs with harmony / GLM-4.5 templates,
served over real HTTP.

A random model writes random tokens, so the markup is forced: a ``response_format`` schema whose only value
is a JSON string holding the markup makes the engine's grammar write exactly ``"<markup>"`` (the quotes
are content outside any message). What runs is the lane's own path: the format chosen from the file's
template, the engine's constrained decoding, the parser fed piece by piece as the engine streams, and the
answer split into ``content``, ``reasoning_content`` and ``tool_calls``, the same whole and streamed. The
reverse direction: an OpenAI-shaped tool conversation sent to ``/tokenize`` renders as the template reads it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from engine.engine import Engine
from lanes.protocol import ChatRequest
from tests.common.test_glm_format import GLM45_TEMPLATE
from tests.common.test_harmony_format import HARMONY_TEMPLATE
from tests.engine.gguf_factory import make_glm4moe_gguf, make_gptoss_gguf
from tests.gateway.test_openai_schema import check
from tests.http_helpers import sse
from tests.lanes.conftest import Lane, lane_config, running_lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

PING = {"type": "function", "function": {"name": "ping", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "Hello"}]


def forced(markup: str) -> dict[str, Any]:
    """A response_format under which the answer can only be ``markup`` as a JSON string."""
    return {"type": "json_schema", "json_schema": {"name": "forced", "schema": {"type": "string", "const": markup}}}


def no_json_call(eng: Engine) -> dict[str, float]:
    """A logit_bias that keeps a JSON call (``{`` or ``[`` first) from being chosen over the forced string
    (with tools, ``auto`` and a response_format the grammar allows either)."""
    return {str(t): -100.0 for c in "{[" for t in eng.tokenizer.encode(c, add_special=False)}


@pytest.fixture(scope="module")
def oss_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = make_gptoss_gguf(tmp_path_factory.mktemp("oss") / "oss.gguf", n_layer=2, chat_template=HARMONY_TEMPLATE)
    with Engine.open(path, threads=2, kv_tokens=1024, max_model_len=1024) as eng:
        yield eng


@pytest.fixture(scope="module")
def glm_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    path = make_glm4moe_gguf(tmp_path_factory.mktemp("glm") / "glm.gguf", n_moe=1, chat_template=GLM45_TEMPLATE)
    with Engine.open(path, threads=2, kv_tokens=1024, max_model_len=1024) as eng:
        yield eng


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def oss_lane(oss_engine: Engine) -> AsyncIterator[Lane]:
    async with running_lane(lane_config(kv_tokens=1024), lambda config, cores: oss_engine) as lane:
        yield lane


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def glm_lane(glm_engine: Engine) -> AsyncIterator[Lane]:
    async with running_lane(lane_config(kv_tokens=1024), lambda config, cores: glm_engine) as lane:
        yield lane


async def both(lane: Lane, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(the whole answer's message + finish_reason, the streamed one joined, the stream's deltas)."""
    body = {"messages": ASK, "temperature": 0, "max_tokens": 200, **body}
    async with aiohttp.ClientSession() as http:
        async with http.post(lane.url + "/v1/chat/completions", json=body) as r:
            whole = await r.json()
            assert r.status == 200, whole
        check("CreateChatCompletionResponse", whole)
        async with http.post(lane.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status == 200, await r.text()
            lines = await sse(r)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
    msg: dict[str, Any] = {"content": None, "reasoning_content": None, "tool_calls": {}}
    deltas = []
    for e in events:
        check("CreateChatCompletionStreamResponse", e)
        for ch in e["choices"]:
            d = ch["delta"]
            deltas.append(d)
            for key in ("content", "reasoning_content"):
                if d.get(key) is not None:
                    msg[key] = (msg[key] or "") + d[key]
            for tc in d.get("tool_calls") or []:
                if "id" in tc:
                    msg["tool_calls"][tc["index"]] = {"id": tc["id"], "type": "function", "function": {
                        "name": tc["function"]["name"], "arguments": ""}}
                msg["tool_calls"][tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
            if ch.get("finish_reason"):
                msg["finish_reason"] = ch["finish_reason"]
    msg["tool_calls"] = [msg["tool_calls"][k] for k in sorted(msg["tool_calls"])]
    ch = whole["choices"][0]
    return {**ch["message"], "finish_reason": ch["finish_reason"]}, msg, deltas


def calls(msg: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]


async def test_harmony_reasoning_and_final_answer(oss_lane: Lane) -> None:
    async with aiohttp.ClientSession() as http, http.get(oss_lane.url + "/v1/lane") as r:
        assert (await r.json())["chat_format"] == "harmony"
    markup = "<|channel|>analysis<|message|>The user greets.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    whole, streamed, deltas = await both(oss_lane, {"response_format": forced(markup)})
    for m in (whole, streamed):
        assert m["content"] == '"Hi!"' and m["reasoning_content"] == "The user greets."
        assert not m.get("tool_calls") and m["finish_reason"] == "stop"
    assert not any("<|" in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas)


async def test_harmony_tool_call(oss_lane: Lane, oss_engine: Engine) -> None:
    markup = ("<|channel|>analysis<|message|>Ping it.<|end|><|start|>assistant<|channel|>commentary to=functions.ping "
              "<|constrain|>json<|message|>{}<|call|>")
    whole, streamed, _ = await both(oss_lane, {"response_format": forced(markup), "tools": [PING, WEATHER],
                                               "logit_bias": no_json_call(oss_engine)})
    for m in (whole, streamed):
        assert calls(m) == [("ping", "{}")] and m["reasoning_content"] == "Ping it."
        assert m["content"] == '""' and m["finish_reason"] == "tool_calls"  # the grammar's quotes, outside messages
    assert whole["tool_calls"][0]["id"].startswith("call_")


async def test_glm45_thinking_and_tool_call(glm_lane: Lane, glm_engine: Engine) -> None:
    assert glm_lane.state.chat_format == "glm45"
    markup = ("<think>Plan it.</think>Sure.<tool_call>ping<arg_key>n</arg_key><arg_value>3</arg_value></tool_call>"
              "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Nice</arg_value></tool_call>")
    whole, streamed, deltas = await both(glm_lane, {"response_format": forced(markup), "tools": [PING, WEATHER],
                                                    "logit_bias": no_json_call(glm_engine)})
    for m in (whole, streamed):
        assert m["reasoning_content"] == "Plan it." and m["content"] == '"Sure."'
        assert calls(m) == [("ping", '{"n":3}'), ("get_weather", '{"city":"Nice"}')]
        assert m["finish_reason"] == "tool_calls"
    assert not any("<" in (d.get("content") or "") for d in deltas)


@pytest.mark.parametrize("lane_name", ["oss_lane", "glm_lane"])
async def test_free_answers_stream_as_they_read_whole(lane_name: str, request: pytest.FixtureRequest) -> None:
    """With tool_choice auto a native-format model answers unconstrained (its parser reads the calls);
    whatever the random model writes, the streamed answer joins to the whole one."""
    lane = request.getfixturevalue(lane_name)
    whole, streamed, _ = await both(lane, {"tools": [PING, WEATHER], "max_tokens": 24})
    assert streamed["content"] == whole["content"]
    assert streamed["reasoning_content"] == whole.get("reasoning_content")
    assert calls(streamed) == calls(whole)
    assert streamed["finish_reason"] == whole["finish_reason"]
    req = ChatRequest.model_validate({"messages": ASK, "tools": [PING]})
    req.native_tool_calls = True
    assert req.grammar()[0] is None
    req = ChatRequest.model_validate({"messages": ASK, "tools": [PING], "tool_choice": "required"})
    req.native_tool_calls = True
    assert req.grammar()[0] is not None  # a forced call is still the grammar's JSON


async def test_openai_tool_history_renders_as_harmony(oss_lane: Lane) -> None:
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "-3"}]
    async with aiohttp.ClientSession() as http:
        async with http.post(oss_lane.url + "/tokenize", json={"messages": history, "tools": [WEATHER]}) as r:
            ids = (await r.json())["tokens"]
        async with http.post(oss_lane.url + "/detokenize", json={"tokens": ids}) as r:
            text = (await r.json())["prompt"]
    assert text.endswith("<|start|>assistant<|channel|>analysis<|message|>Look it up.<|end|>"
                         "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                         '{"city": "Oslo"}<|call|>'
                         "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>-3<|end|>"
                         "<|start|>assistant")
