"""The Responses and Messages relays over chat chunk sequences the live tests cannot force: several
calls in one answer after text, a failure after the first token, a call cut by the limit, a
reasoning model's reasoning (and reasoning given back in the history). Every
event is checked against the vendored schemas (the live tests check the common paths end to end)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.messages import MessagesRelay, _close_json, to_messages
from gateway.responses import ResponsesRelay, input_messages
from gateway.state import Trace
from tests.gateway.test_messages import check as check_messages
from tests.gateway.test_responses import EVENTS
from tests.gateway.test_responses import check as check_responses


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]
    return {"id": "gw-1", "object": "chat.completion.chunk", "created": 1, "model": "strata-default",
            "choices": choices}


def head(k: int, name: str, args: str = "") -> dict[str, Any]:
    return {"tool_calls": [{"index": k, "id": f"call_{k}", "type": "function",
                            "function": {"name": name, "arguments": args}}]}


def piece(k: int, args: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": k, "function": {"arguments": args}}]}


USAGE = {**chunk(), "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
                              "prompt_tokens_details": {"cached_tokens": 4}}}
TEXT_THEN_CALLS = [chunk({"role": "assistant", "content": "Let me look."}), chunk(head(0, "add")),
                   chunk(piece(0, '{"a":1,')), chunk(piece(0, '"b":2}')), chunk(head(1, "get_weather")),
                   chunk(piece(1, '{"city":"Par')), chunk({}, "length"), USAGE]


def parse(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        e = json.loads(data[6:])
        assert e["type"] == name[7:]
        out.append(e)
    return out


def run_responses(chunks: list[dict[str, Any]], error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    async def go() -> bytes:
        relay = ResponsesRelay({"input": "x", "model": "strata-default"}, [], [], None, 1)
        out = b"".join([await relay.chunk(c) for c in chunks])
        return out + (await relay.error(error) if error is not None else await relay.end()) + await relay.end()
    events = parse(asyncio.run(go()))
    for e in events:
        check_responses(EVENTS[e["type"]], e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def run_messages(chunks: list[dict[str, Any]], error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    trace = Trace()
    trace.prompt_tokens = 20

    async def go() -> bytes:
        relay = MessagesRelay({"model": "strata-default"}, trace)
        out = b"".join([await relay.chunk(c) for c in chunks])
        return out + (await relay.error(error) if error is not None else await relay.end()) + await relay.end()
    events = parse(asyncio.run(go()))
    for e in events:
        check_messages("ErrorResponse" if e["type"] == "error" else "RawMessageStreamEvent", e)
    return events


def test_responses_text_then_two_calls_cut_by_the_limit() -> None:
    events = run_responses(TEXT_THEN_CALLS)
    final = events[-1]
    assert final["type"] == "response.incomplete" and final["response"]["usage"]["input_tokens"] == 20
    out = final["response"]["output"]
    assert [o["type"] for o in out] == ["message", "function_call", "function_call"]
    assert out[1]["arguments"] == '{"a":1,"b":2}' and out[2]["arguments"] == '{"city":"Par'
    assert [o["status"] for o in out] == ["completed", "completed", "incomplete"]  # only the last was cut
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1, 2]


def test_responses_failure_after_the_first_token() -> None:
    err = {"error": {"message": "the lane failed", "type": "server_error", "param": None, "code": "upstream_error"}}
    events = run_responses(TEXT_THEN_CALLS[:3], err)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "upstream_error" and events[-1]["response"]["error"]["code"] == "server_error"


def test_messages_text_then_two_calls_and_a_failure() -> None:
    events = run_messages(TEXT_THEN_CALLS)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use", "tool_use"]
    assert [s["index"] for s in starts] == [0, 1, 2]
    assert kinds.count("content_block_stop") == 3
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 9
    assert events[0]["message"]["usage"]["input_tokens"] == 20
    failed = run_messages(TEXT_THEN_CALLS[:2], {"error": {"message": "x", "code": "upstream_error"}})
    assert failed[-1] == {"type": "error", "error": {"type": "api_error", "message": "x"}}
    stopped = run_messages([chunk({"content": "a"}), chunk({}, "stop", stop_reason="END")])
    assert stopped[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_partial_arguments_become_the_object_begun() -> None:
    assert _close_json('{"city":"Par') == {"city": "Par"}
    assert _close_json('{"a":1,') == {"a": 1}
    assert _close_json('{"a":{"b":[1,2') == {"a": {"b": [1, 2]}}
    assert _close_json('{"a":') == {"a": None}
    assert _close_json("") == {} and _close_json("[1") == {}


REASONING_THEN_CALL = [chunk({"role": "assistant", "reasoning_content": "The user wants "}),
                       chunk({"reasoning_content": "the weather."}), chunk({"content": "Checking."}),
                       chunk(head(0, "get_weather", '{"city":')), chunk(piece(0, '"Oslo"}')),
                       chunk({}, "tool_calls"), USAGE]


def test_responses_reasoning_item_streamed_and_whole() -> None:
    """A reasoning model's ``reasoning_content`` (gpt-oss, GLM-4.5: lanes/chat_parsers.py) is a reasoning
    item with reasoning_text content, before the message and the call."""
    events = run_responses(REASONING_THEN_CALL)
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["reasoning", "message", "function_call"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "The user wants the weather."}]
    assert out[0]["summary"] == [] and out[0]["status"] == "completed"
    deltas = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert deltas == ["The user wants ", "the weather."]
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == "The user wants the weather." and done["output_index"] == 0
    assert "The user" not in json.dumps([o for o in out if o["type"] == "message"])

    async def whole() -> dict[str, Any]:
        relay = ResponsesRelay({"input": "x", "model": "strata-default"}, [], [], None, 1)
        return await relay.whole({"model": "strata-default", "usage": USAGE["usage"], "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet back."}}]})
    r = asyncio.run(whole())
    check_responses("Response", r)
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == "Greet back." and r["output"][1]["content"][0]["text"] == "Hi."


def test_responses_reasoning_input_items_return_to_their_turn() -> None:
    items = [{"type": "message", "role": "user", "content": "Weather in Oslo?"},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Oslo"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "-3"},
             {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "opaque"}]
    msgs = input_messages(items, [])
    assert msgs[1] == {"role": "assistant", "content": None, "reasoning_content": "Call the tool.",
                       "tool_calls": [{"id": "c1", "type": "function",
                                       "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]}
    assert len(msgs) == 3 and all("reasoning_content" not in m for m in (msgs[0], msgs[2]))


def test_messages_thinking_blocks_only_when_asked() -> None:
    events = run_messages(REASONING_THEN_CALL)
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]  # not asked for thinking: left out

    trace = Trace()
    trace.prompt_tokens = 20

    async def go() -> tuple[bytes, dict[str, Any]]:
        body = {"model": "strata-default", "thinking": {"type": "enabled", "budget_tokens": 1024}}
        relay = MessagesRelay(body, trace)
        raw = b"".join([await relay.chunk(c) for c in REASONING_THEN_CALL]) + await relay.end()
        whole = await MessagesRelay(body, trace).whole({"model": "m", "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "content": "Hi.", "reasoning_content": "Greet back."}}]})
        return raw, whole
    raw, whole = asyncio.run(go())
    events = parse(raw)
    for e in events:
        check_messages("RawMessageStreamEvent", e)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use"]
    thinking = [e["delta"]["thinking"] for e in events if e["type"] == "content_block_delta"
                and e["delta"]["type"] == "thinking_delta"]
    assert thinking == ["The user wants ", "the weather."]
    check_messages("Message", whole)
    assert whole["content"] == [{"type": "thinking", "thinking": "Greet back.", "signature": ""},
                                {"type": "text", "text": "Hi."}]


def test_messages_thinking_history_is_the_turns_reasoning() -> None:
    msgs = to_messages(None, [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Use the tool.", "signature": "s"},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "-3"}]},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "Cold."}]},
        {"role": "user", "content": "Thanks"}])
    assert msgs[1]["reasoning_content"] == "Use the tool." and msgs[1]["tool_calls"][0]["id"] == "t1"
    assert msgs[3] == {"role": "assistant", "content": "Cold."}
