"""The lane through the official openai client on a real port: chat, completions, models, usage."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest
import pytest_asyncio

from engine.sampling import SamplingParams
from tests.lanes.conftest import Lane

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "strata-default"
QUESTION = [{"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client(lane: Lane) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=lane.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    await c.close()


async def test_models(client: openai.AsyncOpenAI, lane: Lane) -> None:
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.owned_by == "strata"
    extra = card.model_extra or {}
    assert extra["max_model_len"] == lane.state.engine.n_ctx
    assert extra["lane"] == "a"
    assert extra["engine_build"].startswith("strata-")


async def test_chat_non_stream_usage_and_prefix_cache(client: openai.AsyncOpenAI, lane: Lane) -> None:
    first = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert first.id.startswith("chatcmpl-") and first.object == "chat.completion"
    assert first.system_fingerprint and first.system_fingerprint.startswith("strata-")
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    async with aiohttp.ClientSession() as s, s.post(lane.url + "/tokenize", json={"messages": QUESTION}) as r:
        count = (await r.json())["count"]
    u = first.usage
    assert u is not None
    assert u.prompt_tokens == count  # the gateway's precheck counts exactly what the lane bills
    assert 1 <= u.completion_tokens <= 8 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    again = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    # the whole prompt's full blocks were computed by the first request
    assert again.usage.prompt_tokens_details.cached_tokens == (count // 16) * 16 > 0
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic


async def test_chat_stream_matches_non_stream(client: openai.AsyncOpenAI) -> None:
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    stream = await client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
    parts, roles, reasons, usage = [], [], [], None
    async for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
            assert chunk.choices == []
            continue
        for c in chunk.choices:
            if c.delta.role:
                roles.append(c.delta.role)
            if c.delta.content:
                parts.append(c.delta.content)
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert roles == ["assistant"]
    assert "".join(parts) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and full.usage is not None
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


async def test_chat_logprobs_and_n(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0.8,
                                             seed=7, n=2, logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs is not None and c.logprobs.content
        for t in c.logprobs.content:
            assert t.logprob <= 0 and len(t.top_logprobs) == 3
            assert bytes(t.bytes or []).decode("utf-8", "replace") == t.token
    assert r.usage is not None and r.usage.completion_tokens == sum(
        len(c.logprobs.content) + (c.finish_reason == "stop") for c in r.choices if c.logprobs)
    # seeded: the same request gives the same choices
    r2 = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0.8,
                                              seed=7, n=2)
    assert [c.message.content for c in r2.choices] == [c.message.content for c in r.choices]


async def test_chat_stream_n2(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=3, temperature=0,
                                                  n=2, stream=True)
    texts: dict[int, str] = {0: "", 1: ""}
    reasons: dict[int, str] = {}
    async for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts[0] == texts[1] != "" and set(reasons) == {0, 1}  # greedy: both choices equal


async def test_completions_stream_and_non_stream(client: openai.AsyncOpenAI) -> None:
    full = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, logprobs=2)
    assert full.id.startswith("cmpl-") and full.object == "text_completion"
    c = full.choices[0]
    assert c.text and c.finish_reason in ("stop", "length")
    assert c.logprobs is not None and len(c.logprobs.tokens or []) == len(c.logprobs.token_logprobs or [])
    assert "".join(c.logprobs.tokens or []) == c.text
    assert full.usage is not None and full.usage.prompt_tokens > 0
    text, reason = [], None
    stream = await client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                             temperature=0, stream=True)
    async for chunk in stream:
        for ch in chunk.choices:
            text.append(ch.text)
            reason = ch.finish_reason or reason
    assert "".join(text) == c.text and reason == c.finish_reason
    # token-id prompts and several prompts in one request
    ids = (await client.completions.create(model=MODEL, prompt=[504, 3575, 282], max_tokens=2, temperature=0))
    assert ids.usage is not None and ids.usage.prompt_tokens == 3
    many = await client.completions.create(model=MODEL, prompt=["One,", "Two,"], max_tokens=2, n=2, temperature=0)
    assert [ch.index for ch in many.choices] == [0, 1, 2, 3]


async def test_max_tokens_defaults_to_remaining_window(client: openai.AsyncOpenAI, lane: Lane,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Omitted max_tokens: the engine may generate up to the end of the window, not to some constant."""
    aeng = lane.state.aeng
    asked: list[SamplingParams] = []
    submit = aeng.submit

    def recording_submit(ids: list[int], params: SamplingParams, rid: str) -> Any:
        asked.append(params)
        return submit(ids, params.model_copy(update={"max_tokens": 2}), rid)  # keep the test short

    monkeypatch.setattr(aeng, "submit", recording_submit)
    r = await client.completions.create(model=MODEL, prompt=[504] * 10, temperature=0)
    assert asked[0].max_tokens == lane.state.engine.n_ctx - 10
    assert r.usage is not None and r.usage.prompt_tokens == 10
