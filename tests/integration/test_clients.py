"""The clients people already use, unchanged, against the real stack (supervisord, both lanes, the
gateway, the real default model): the openai SDK's responses and the anthropic SDK's messages
(plain, streamed, chained), langchain-openai (invoke, stream, abatch, bind_tools with every
tool_choice form on schemas without additionalProperties, with_structured_output both methods,
embeddings) and litellm through its OpenAI and Anthropic providers (plain, streamed, tools).
(tests/gateway/test_responses.py and test_messages.py cover the two APIs in depth.)

No network: litellm reads its bundled model cost map (LITELLM_LOCAL_MODEL_COST_MAP) and the
embeddings client skips tiktoken's length check (which would download an encoding)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import anthropic
import langchain_openai
import openai
import pytest
from langchain_core.tools import tool
from pydantic import BaseModel, Field

from tests.integration.conftest import ADMIN_KEY, Stack

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before litellm is imported: no fetch at import
import litellm  # noqa: E402  (after the line above)

MODEL = "strata-default"
ASK = "What is the capital of France?"


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"sunny in {city}"


class Place(BaseModel):
    """A city and the country it is in."""

    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_sdks_on_the_new_apis(stack: Stack) -> None:
    """Through supervisord's gateway: a stored response continued by id (a follow-up may land on the
    other lane: the chain lives in the gateway's database), streamed too; Messages plain and streamed."""
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, max_retries=0) as c:
        first = c.responses.create(model=MODEL, input="My name is Ada. Reply OK.", max_output_tokens=8)
        with c.responses.stream(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=16) as st:
            # the last event: response.completed, or response.incomplete at the limit (which the SDK's
            # get_final_response does not accept, with OpenAI's server either)
            last = [e for e in st][-1]
        assert last.type in ("response.completed", "response.incomplete")
        follow = last.response  # type: ignore[union-attr]
        assert follow.output_text
        assert follow.usage and first.usage and follow.usage.input_tokens > first.usage.input_tokens
    with anthropic.Anthropic(base_url=stack.gateway_url, api_key=ADMIN_KEY, max_retries=0) as a:
        m = a.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": ASK}])
        assert m.content and m.content[0].type == "text" and m.usage.input_tokens > 5
        with a.messages.stream(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": ASK}]) as ms:
            final = ms.get_final_message()
        assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0


def chat_model(stack: Stack, **kw: Any) -> Any:
    return langchain_openai.ChatOpenAI(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY, model=MODEL,
                                       temperature=0, max_retries=0, timeout=120, **{"max_tokens": 48, **kw})


def test_langchain_invoke_stream_abatch(stack: Stack) -> None:
    llm = chat_model(stack)
    answer = llm.invoke(ASK)
    assert answer.content and answer.usage_metadata["input_tokens"] > 5
    streamed = "".join(str(c.content) for c in llm.stream(ASK))
    assert streamed == answer.content
    batch = asyncio.run(llm.abatch([ASK, "What is the capital of Italy?"]))
    assert len(batch) == 2 and batch[0].content and batch[1].content


@pytest.mark.parametrize("choice", ["get_weather", "any", "required", True])
def test_langchain_bind_tools_every_choice(stack: Stack, choice: Any) -> None:
    """LangChain's schema has no additionalProperties: the call still completes (closed objects by default)."""
    schema = langchain_openai.chat_models.base.convert_to_openai_tool(get_weather)["function"]["parameters"]
    assert "additionalProperties" not in schema
    llm = chat_model(stack, max_tokens=64).bind_tools([get_weather], tool_choice=choice)
    msg = llm.invoke("What is the weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather", msg
    assert set(msg.tool_calls[0]["args"]) == {"city"} and not msg.content
    assert msg.response_metadata["finish_reason"] == "tool_calls"
    chunks = list(llm.stream("What is the weather in Paris?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.tool_calls and total.tool_calls[0]["name"] == "get_weather"
    assert total.tool_calls[0]["args"] == msg.tool_calls[0]["args"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(stack: Stack, method: str) -> None:
    out = chat_model(stack, max_tokens=64).with_structured_output(Place, method=method).invoke(
        "Name a city and its country.")
    assert isinstance(out, Place) and out.city and out.country


def test_langchain_embeddings(stack: Stack) -> None:
    stack.wait_retrieval()
    emb = langchain_openai.OpenAIEmbeddings(base_url=stack.gateway_url + "/v1", api_key=ADMIN_KEY,
                                            model="all-MiniLM-L6-v2", check_embedding_ctx_length=False,
                                            max_retries=0)
    docs = emb.embed_documents(["Paris is in France.", "Rome is in Italy."])
    query = emb.embed_query("Where is Paris?")
    assert len(docs) == 2 and len(docs[0]) == len(query) == 384


def _litellm(stack: Stack, provider: str, **kw: Any) -> Any:
    base = stack.gateway_url + ("/v1" if provider == "openai" else "")
    return litellm.completion(model=f"{provider}/{MODEL}", api_base=base, api_key=ADMIN_KEY, temperature=0,
                              num_retries=0, timeout=120, **kw)


@pytest.mark.parametrize("provider", ["openai", "anthropic"])
def test_litellm_providers(stack: Stack, provider: str) -> None:
    """litellm's OpenAI provider speaks /v1/chat/completions, its Anthropic provider /v1/messages."""
    r = _litellm(stack, provider, messages=[{"role": "user", "content": ASK}], max_tokens=24)
    text = r.choices[0].message.content
    assert text and r.usage.prompt_tokens > 5
    pieces = [c.choices[0].delta.content or "" for c in _litellm(
        stack, provider, messages=[{"role": "user", "content": ASK}], max_tokens=24, stream=True)]
    assert "".join(pieces) == text
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 20}},
                                                   "required": ["city"]}}}]
    r = _litellm(stack, provider, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                 max_tokens=48, tools=tools, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"
