"""lanes/tools.py without a model run: the tool-call grammar walked with the default model's own
tokens, and the scanner that turns an answer (whole or piece by piece) into OpenAI tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.constraints import GrammarCompiler
from engine.engine import Engine
from lanes.tools import MAX_TOOL_CALLS, ToolCallScanner, parse_tool_calls, tools_grammar

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "description": "a } and a \" in here {"}},
    "required": ["city"], "additionalProperties": False}}}
TOOLS = [ADD, WEATHER]
NAMES = ["add", "get_weather"]
ONE = '{"name":"add","arguments":{"a":1,"b":-2}}'
TWO = '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"P\\"a}ris"}}]'


@pytest.fixture(scope="module")
def compiler(lane_engine: Engine) -> GrammarCompiler:
    """The default model's vocabulary (the lane tests' shared engine: no second tokenizer load)."""
    return GrammarCompiler.for_tokenizer(lane_engine.tokenizer)


def walk(compiler: GrammarCompiler, grammar: str, text: str) -> str:
    """'done' (a complete answer), 'open' (a valid prefix) or 'rejected'."""
    c = compiler.matcher(grammar)
    for t in compiler.tokenizer.encode(text, add_special=False, parse_special=False):
        if not c.consume(t):
            return "rejected"
    return "done" if c.done else "open"


def test_grammar_allows_several_calls_only_when_parallel(compiler: GrammarCompiler) -> None:
    many = "[" + ",".join([ONE] * MAX_TOOL_CALLS) + "]"
    too_many = "[" + ",".join([ONE] * (MAX_TOOL_CALLS + 1)) + "]"
    cases = {  # (mode, parallel) -> expected for ONE, TWO, many, too_many, text, an unknown function
        ("forced", True): ["done", "done", "done", "rejected", "rejected", "rejected"],
        ("forced", False): ["done", "rejected", "rejected", "rejected", "rejected", "rejected"],
        ("auto", True): ["done", "done", "done", "rejected", "open", "rejected"],
        ("auto", False): ["done", "rejected", "rejected", "rejected", "open", "rejected"],
    }
    texts = [ONE, TWO, many, too_many, "It is sunny.", '{"name":"sub","arguments":{}}']
    for (mode, parallel), want in cases.items():
        g = tools_grammar(mode, TOOLS, parallel)  # type: ignore[arg-type]
        compiler.check(g)
        assert [walk(compiler, g, t) for t in texts] == want, (mode, parallel)


def test_auto_text_cannot_start_like_a_call(compiler: GrammarCompiler) -> None:
    g = tools_grammar("auto", TOOLS, True)
    for text in (" {", "\n[", '{"x": 1}', "[1, 2]"):
        assert walk(compiler, g, text) == "rejected", text
    assert walk(compiler, g, "Sure: {not a call} [1]") == "open"
    # with a response_format schema, the non-call answer is that JSON instead of free text
    g = tools_grammar("auto", TOOLS, True, {"type": "object", "properties": {"z": {"type": "integer"}},
                                            "required": ["z"], "additionalProperties": False})
    assert [walk(compiler, g, t) for t in ('{"z":3}', ONE, "Hello")] == ["done", "done", "rejected"]


def replay(text: str, step: int) -> tuple[ToolCallScanner, list[dict[str, Any]]]:
    sc = ToolCallScanner(NAMES)
    deltas = []
    for i in range(0, len(text), step):
        sc.feed(text[i: i + step])
        deltas += [d.openai() for d in sc.take_deltas()]
    return sc, deltas


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_scanner_streams_calls_piece_by_piece(step: int) -> None:
    for text in (ONE, TWO, "  " + ONE):
        sc, deltas = replay(text, step)
        calls = sc.result()
        assert sc.kind == "json" and calls is not None
        want = json.loads(text)
        want = want if isinstance(want, list) else [want]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(w["name"], w["arguments"]) for w in want]
        # heads first per index (id, type, name), then argument pieces that join to the call's arguments
        for k, call in enumerate(calls):
            mine = [d for d in deltas if d["index"] == k]
            assert mine[0]["id"] == call["id"] and mine[0]["type"] == "function"
            assert mine[0]["function"]["name"] == call["function"]["name"]
            assert all("id" not in d and "name" not in d["function"] for d in mine[1:])
            assert "".join(d["function"]["arguments"] for d in mine) == call["function"]["arguments"]
        if step == 1:
            assert len(deltas) > 2 * len(calls)  # several argument pieces, not one per call


def test_scanner_text_tagged_and_not_calls() -> None:
    sc, deltas = replay("Hello {there}", 2)
    assert sc.kind == "text" and not deltas and sc.result() is None and sc.take_text() == "Hello {there}"
    sc, _ = replay("<tool_call>\n" + ONE + "\n</tool_call>\n<tool_call>" + ONE + "</tool_call>", 3)
    assert sc.kind == "tagged" and [c["function"]["name"] for c in sc.result() or []] == ["add", "add"]
    for bad in ('{"name":"nope","arguments":{}}', '{"name":"add","arguments":"x"}', ONE[:-1], "[]",
                '{"name":"add","arguments":{"a":1,"b":2},"x":1} trailing'):
        assert parse_tool_calls(bad, NAMES) is None, bad
    sc, deltas = replay('{"name":"nope","arguments":{"a":1}}', 1)
    assert not deltas  # an unknown name never starts a streamed call
    sc = ToolCallScanner(NAMES)
    sc.feed("  <tool_")
    assert sc.kind is None  # undecided while it may still be a tag


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_scanner_partial_calls_of_a_cut_answer(step: int) -> None:
    """An answer cut by max_tokens: the calls begun so far with the argument text written, and for a
    stream only what its deltas have not sent yet, so that joined they are the same partial calls."""
    cut = TWO[:-12]  # inside the second call's arguments
    sc, deltas = replay(cut, step)
    rest = [d.openai() for d in sc.take_partial()]
    whole = ToolCallScanner(NAMES)
    whole.feed(cut)
    calls = [d.call() for d in whole.partial()]
    assert [c["function"]["name"] for c in calls] == ["add", "get_weather"]
    assert calls[0]["function"]["arguments"] == '{"a":1,"b":2}' and calls[1]["function"]["arguments"] == '{"city":"'
    joined: dict[int, str] = {}
    for d in deltas + rest:
        joined[d["index"]] = joined.get(d["index"], "") + d["function"]["arguments"]
    assert [joined[k] for k in sorted(joined)] == [c["function"]["arguments"] for c in calls]
    assert sc.take_partial() == []  # nothing twice
    # a call cut inside its name: dropped when several functions could be meant, named when one can
    sc = ToolCallScanner(NAMES)
    sc.feed('{"name":"get_w')
    assert sc.partial() == []
    one = ToolCallScanner(["get_weather"])
    one.feed('{"name":"get_w')
    assert [(d.name, d.arguments) for d in one.partial()] == [("get_weather", "")]
    empty = ToolCallScanner(["get_weather"])
    assert [d.name for d in empty.partial()] == ["get_weather"] and empty.partial()[0].id == empty.calls[0].id
