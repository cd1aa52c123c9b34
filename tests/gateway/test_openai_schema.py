"""Real lane and gateway responses against OpenAI's published OpenAPI schema (tests/schemas/openai_subset.json).

The vendored file keeps the spec's OpenAPI 3.0 ``nullable: true`` in places; JSON Schema ignores
that keyword, so :func:`_nullable` turns each one into ``anyOf [..., null]`` (what it means in
the spec) before validating.
"""

from __future__ import annotations

import copy
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from jsonschema import Draft202012Validator

from tests.gateway.conftest import ADMIN_KEY, GW, KV_TOKENS, Lane, auth, gateway_config, running_gateway
from tests.http_helpers import sse

pytestmark = pytest.mark.asyncio(loop_scope="module")

SPEC = json.loads((Path(__file__).resolve().parent.parent / "schemas" / "openai_subset.json").read_text())
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _nullable(node: Any) -> Any:
    if isinstance(node, list):
        return [_nullable(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


COMPONENTS = _nullable(SPEC["components"])


def validator(name: str, components: dict[str, Any] = COMPONENTS) -> Draft202012Validator:
    return Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": components})


def check(name: str, obj: Any, components: dict[str, Any] = COMPONENTS) -> None:
    errors = sorted(validator(name, components).iter_errors(obj), key=lambda e: list(e.absolute_path))
    assert not errors, f"{name}: " + "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]) + \
        f"\n{json.dumps(obj)[:1500]}"


def _completion_chunk_components() -> dict[str, Any]:
    """The spec has no schema of its own for streamed completions: they are CreateCompletionResponse
    objects whose ``finish_reason`` is null until the last chunk (as OpenAI sends them)."""
    comps = copy.deepcopy(COMPONENTS)
    choice = comps["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    return comps


async def test_the_checker_can_fail() -> None:
    """Today's bug, on purpose: a chat message without ``refusal`` does not validate."""
    bad = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                        "message": {"role": "assistant", "content": "hi"}}]}
    with pytest.raises(AssertionError, match="refusal"):
        check("CreateChatCompletionResponse", bad)
    bad["choices"][0]["message"]["refusal"] = None  # type: ignore[index]
    check("CreateChatCompletionResponse", bad)
    bad["choices"][0]["logprobs"] = {"content": []}  # type: ignore[index]
    with pytest.raises(AssertionError, match="refusal"):
        check("CreateChatCompletionResponse", bad)
    with pytest.raises(AssertionError):
        check("ErrorResponse", {"error": {"message": "m", "type": "t"}})  # param and code are required


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    async with running_gateway(gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}],
                                              max_body_bytes=4096)) as g:
        yield g


def _events(lines: list[str]) -> list[dict[str, Any]]:
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1] if ln.startswith("data: ")]


@pytest.mark.parametrize("via", ["lane", "gateway"])
async def test_generation_responses(via: str, lane: Lane, gw: GW, http: aiohttp.ClientSession) -> None:
    base, headers = (lane.url, {}) if via == "lane" else (gw.url, auth(gw.key(f"schema-{via}")))
    chat = {"messages": QUESTION, "max_tokens": 6, "temperature": 0}
    for extra in ({}, {"logprobs": True, "top_logprobs": 2}, {"n": 2, "temperature": 0.8, "seed": 1}):
        async with http.post(base + "/v1/chat/completions", json={**chat, **extra}, headers=headers) as r:
            assert r.status == 200
            check("CreateChatCompletionResponse", await r.json())
        body = {**chat, **extra, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(base + "/v1/chat/completions", json=body, headers=headers) as r:
            events = _events(await sse(r))
        assert events[-1]["usage"] is not None and any(e["choices"] for e in events)
        for e in events:
            check("CreateChatCompletionStreamResponse", e)
    completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    for extra in ({}, {"logprobs": 2}, {"prompt": ["One", "Two"]}):
        async with http.post(base + "/v1/completions", json={**completion, **extra}, headers=headers) as r:
            assert r.status == 200
            check("CreateCompletionResponse", await r.json())
        async with http.post(base + "/v1/completions", json={**completion, **extra, "stream": True},
                             headers=headers) as r:
            events = _events(await sse(r))
        chunk_components = _completion_chunk_components()
        for e in events:
            check("CreateCompletionResponse", e, chunk_components)
    async with http.get(base + "/v1/models", headers=headers) as r:
        models = await r.json()
    check("ListModelsResponse", models)
    if via == "gateway":
        async with http.get(base + f"/v1/models/{models['data'][0]['id']}", headers=headers) as r:
            assert r.status == 200
            check("Model", await r.json())


async def test_embeddings_response(gw: GW, http: aiohttp.ClientSession) -> None:
    """The gateway's own /v1/embeddings (the documents service's embedding model, float format: the spec
    does not describe base64)."""
    async with http.post(gw.url + "/v1/embeddings", json={"input": ["the cat sat", "on the mat"]},
                         headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200, await r.text()
        check("CreateEmbeddingResponse", await r.json())
    got, body = await _error(http, "POST", gw.url + "/v1/embeddings", json={"input": []}, headers=auth(ADMIN_KEY))
    assert got == 400


async def _error(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
    async with http.request(method, url, **kw) as r:
        body = await r.json()
        check("ErrorResponse", body)
        return r.status, body


async def test_error_responses(lane: Lane, gw: GW, http: aiohttp.ClientSession) -> None:
    key = gw.key("schema-errors", rpm=1)
    cases: list[tuple[str, str, dict[str, Any], int]] = [
        # the lane's own
        ("POST", lane.url + "/v1/chat/completions", {"json": {"messages": QUESTION, "temperature": -1}}, 400),
        ("POST", lane.url + "/v1/chat/completions", {"data": b"{"}, 400),
        ("POST", lane.url + "/v1/completions", {"json": {"prompt": "x", "echo": True}}, 400),
        ("GET", lane.url + "/nope", {}, 404),
        # the gateway's
        ("GET", gw.url + "/v1/models", {}, 401),
        ("GET", gw.url + "/v1/admin/lanes", {"headers": auth(key)}, 403),
        ("POST", gw.url + "/v1/chat/completions", {"data": b"{", "headers": auth(key)}, 400),
        ("POST", gw.url + "/v1/chat/completions", {"json": {"messages": QUESTION}, "headers": auth(key)}, 429),
        ("POST", gw.url + "/v1/completions", {"data": b"x" * 10_000, "headers": auth(ADMIN_KEY)}, 413),
        ("POST", gw.url + "/v1/chat/completions",
         {"json": {"messages": QUESTION, "model": "gpt-9"}, "headers": auth(ADMIN_KEY)}, 404),
        ("POST", gw.url + "/v1/chat/completions", {"json": {  # the window precheck: extra fields in the error
            "messages": [{"role": "user", "content": "go " * (KV_TOKENS + 10)}]}, "headers": auth(ADMIN_KEY)}, 400),
        ("DELETE", gw.url + "/v1/admin/keys/12345", {"headers": auth(ADMIN_KEY)}, 404),
        ("GET", gw.url + "/nope", {"headers": auth(ADMIN_KEY)}, 404),
    ]
    for method, url, kw, status in cases:
        got, body = await _error(http, method, url, **kw)
        assert got == status, (method, url, body)
        if status == 400 and "go go" in json.dumps(kw.get("json")):
            assert body["error"]["code"] == "context_length_exceeded" and body["error"]["n_ctx"] == KV_TOKENS
