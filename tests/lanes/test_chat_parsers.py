"""lanes/chat_parsers.py without a model: each format's parser on whole answers and on every way of
cutting them into stream pieces (every single cut, every fixed step, random cuts), which must all
give the answer the whole text gives; no piece of content or reasoning ever holds a marker; bad
markup ends as content or as a call with the text written, never as an exception."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

import pytest

from common.chat_template import ChatTemplate
from lanes.chat_parsers import (
    Answer,
    AnswerParser,
    DefaultParser,
    Glm45Parser,
    HarmonyParser,
    Piece,
    collect,
    make_parser,
)
from tests.common.test_glm_format import GLM45_TEMPLATE
from tests.common.test_harmony_format import HARMONY_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "units": {"type": ["string", "null"]}, "where": {"type": "object"}}}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
NAMES = ["get_weather", "add"]

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>")
GLM_MARKERS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>")


def run(make: Callable[[], AnswerParser], chunks: list[str], reason: str = "stop") -> tuple[Answer, list[Piece]]:
    p = make()
    pieces: list[Piece] = []
    for c in chunks:
        pieces += p.feed(c)
    pieces += p.finish(reason)
    return collect(pieces), pieces


def plain(a: Answer) -> dict[str, Any]:
    """The answer without the (random) call ids, which are checked to be consistent instead."""
    for c in a.tool_calls:
        assert isinstance(c["id"], str) and c["id"].startswith("call_") and c["type"] == "function"
    return {"content": a.content, "reasoning": a.reasoning,
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in a.tool_calls]}


def splits(text: str, seed: int = 0) -> list[list[str]]:
    """Every cut into two pieces, every fixed step 1..9, and 40 random cuts into several pieces."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out += [[text[i: i + k] for i in range(0, len(text), k)] for k in range(1, 10)]
    rng = random.Random(seed)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(2, 12)))) if len(text) > 2 else []
        bounds = [0, *cuts, len(text)]
        out.append([text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)])
    return out


def check_all_splits(make: Callable[[], AnswerParser], text: str, want: dict[str, Any], reason: str = "stop",
                     markers: tuple[str, ...] = ()) -> None:
    whole, _ = run(make, [text], reason)
    assert plain(whole) == want
    for chunks in splits(text):
        got, pieces = run(make, chunks, reason)
        assert plain(got) == want, chunks
        ids = {p.index: p.id for p in pieces if p.name is not None}
        assert [c["id"] for c in got.tool_calls] == [ids[k] for k in sorted(ids)]  # one head per call
        for p in pieces:
            assert p.text or p.name is not None  # no empty deltas
            if p.kind != "call":
                assert not any(m in p.text for m in markers), (chunks, p)


# ---------------------------------------------------------------------------------------- harmony

HARMONY_CASES: list[tuple[str, str, list[str] | None, str, dict[str, Any]]] = [
    ("reasoning_then_final",
     "<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hello! 你好 — how can I help?",
     NAMES, "stop", {"content": "Hello! 你好 — how can I help?", "reasoning": "The user greets; answer briefly.",
                     "calls": []}),
    ("call_in_channel",
     "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris", "days": 2}',
     NAMES, "stop", {"content": None, "reasoning": "Need the weather tool.",
                     "calls": [("get_weather", '{"city": "Paris", "days": 2}')]}),
    ("call_in_role_with_end_marker",
     "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant to=functions.add<|channel|>commentary json"
     '<|message|>{"a": 1, "b": 2}<|call|>',
     NAMES, "stop", {"content": None, "reasoning": "Add them.", "calls": [("add", '{"a": 1, "b": 2}')]}),
    ("preamble_and_two_calls",
     "<|channel|>commentary<|message|>Checking both.<|end|>"
     '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"city":"Oslo"}<|call|>'
     '<|start|>assistant<|channel|>commentary to=functions.add<|message|>{"a":2,"b":3}<|call|>',
     NAMES, "stop", {"content": "Checking both.", "reasoning": None,
                     "calls": [("get_weather", '{"city":"Oslo"}'), ("add", '{"a":2,"b":3}')]}),
    ("no_markup_is_content", '{"answer": 42, "note": "<|not a marker"}', NAMES, "stop",
     {"content": '{"answer": 42, "note": "<|not a marker"}', "reasoning": None, "calls": []}),
    ("text_like_markers_kept",
     "<|channel|>final<|message|>Use <|channel| or <|end without the bar, and a<b>c.",
     None, "stop", {"content": "Use <|channel| or <|end without the bar, and a<b>c.", "reasoning": None,
                    "calls": []}),
    ("unknown_function_is_content",
     '<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{"x": 1}<|call|>',
     NAMES, "stop", {"content": '{"x": 1}', "reasoning": None, "calls": []}),
    ("tools_off_call_is_content",
     '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome"}',
     None, "stop", {"content": '{"city": "Rome"}', "reasoning": None, "calls": []}),
    ("bad_json_arguments_as_written",
     "<|channel|>commentary to=functions.add <|constrain|>json<|message|>{a: 1, b:",
     NAMES, "stop", {"content": None, "reasoning": None, "calls": [("add", "{a: 1, b:")]}),
    ("cut_inside_arguments", '<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary '
     'to=functions.get_weather<|message|>{"city": "Par', NAMES, "length",
     {"content": None, "reasoning": "x", "calls": [("get_weather", '{"city": "Par')]}),
    ("cut_inside_header", "<|channel|>analysis<|message|>Thinking<|end|><|start|>assistant<|channel|>commentary to=fu",
     NAMES, "length", {"content": "", "reasoning": "Thinking", "calls": []}),
    ("cut_inside_reasoning", "<|channel|>analysis<|message|>Half a thou", NAMES, "length",
     {"content": "", "reasoning": "Half a thou", "calls": []}),
    ("stray_markers_dropped",
     "<|end|><|channel|>analysis<|message|>a<|message|>b<|constrain|>c<|end|><|channel|>final<|message|>done<|return|>",
     None, "stop", {"content": "done", "reasoning": "abc", "calls": []}),
    ("empty", "", NAMES, "stop", {"content": "", "reasoning": None, "calls": []}),
]


@pytest.mark.parametrize(("name", "text", "names", "reason", "want"), HARMONY_CASES, ids=[c[0] for c in HARMONY_CASES])
def test_harmony_parser(name: str, text: str, names: list[str] | None, reason: str, want: dict[str, Any]) -> None:
    check_all_splits(lambda: HarmonyParser(names), text, want, reason, HARMONY_MARKERS)


def test_harmony_streams_reasoning_and_arguments_as_written() -> None:
    """Text is sent as it comes (not at the end), and a call's head goes out once its header is whole."""
    p = HarmonyParser(NAMES)
    assert p.feed("<|channel|>analysis<|message|>Step one") == [Piece("reasoning", "Step one")]
    assert p.feed(", step two<|") == [Piece("reasoning", ", step two")]  # "<|" held: it may be a marker
    assert p.feed("end|><|start|>assistant<|channel|>commentary to=functions.add ") == []
    head = p.feed("<|constrain|>json<|message|>{\"a\"")
    assert [(x.kind, x.name, x.text) for x in head] == [("call", "add", '{"a"')]  # the head with what follows it
    assert p.feed(": 1}") == [Piece("call", ": 1}", 0)]
    assert p.finish("stop") == []


def test_harmony_json_calls_under_a_grammar() -> None:
    """Forced calls come as the grammar's JSON (no channels): the inner default parser reads them."""
    text = '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"Nice"}}]'
    want = {"content": None, "reasoning": None,
            "calls": [("add", '{"a":1,"b":2}'), ("get_weather", '{"city":"Nice"}')]}
    check_all_splits(lambda: make_parser("harmony", TOOLS, forced=True, json_calls=True), text, want)  # type: ignore[arg-type]
    # and a JSON answer (tool_choice auto with response_format) stays content
    check_all_splits(lambda: make_parser("harmony", TOOLS, json_calls=True), '{"z": 3}',  # type: ignore[arg-type]
                     {"content": '{"z": 3}', "reasoning": None, "calls": []})


# ---------------------------------------------------------------------------------------- GLM-4.5

GLM_CASES: list[tuple[str, str, bool, str, dict[str, Any]]] = [
    ("think_then_answer", "\n<think>The user says hi.\n</think>\nHi there! 你好\n", True, "stop",
     {"content": "Hi there! 你好", "reasoning": "The user says hi.", "calls": []}),
    ("no_think", "\n<think></think>\nJust the answer.", True, "stop",
     {"content": "Just the answer.", "reasoning": None, "calls": []}),
    ("think_text_and_call",
     "\n<think>Need weather.</think>\nLet me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
     "<arg_value>123</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>units</arg_key>\n"
     "<arg_value>null</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{\"lat\": 48.8, \"tag\": \"é\"}</arg_value>\n"
     "</tool_call>", True, "stop",
     {"content": "Let me check.", "reasoning": "Need weather.",
      "calls": [("get_weather", '{"city":"123","days":2,"units":"null","where":{"lat":48.8,"tag":"é"}}')]}),
    ("two_calls_no_newlines",
     "<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>x y</arg_value>"
     "</tool_call><tool_call>get_weather</tool_call>", True, "stop",
     {"content": None, "reasoning": None, "calls": [("add", '{"a":1,"b":"x y"}'), ("get_weather", "{}")]}),
    ("values_not_json_are_strings",
     "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>NaN</arg_value>\n<arg_key>b</arg_key>\n<arg_value>[1,</arg_value>"
     "\n<arg_key>c</arg_key>\n<arg_value>  true </arg_value>\n</tool_call>", True, "stop",
     {"content": None, "reasoning": None, "calls": [("add", '{"a":"NaN","b":"[1,","c":true}')]}),
    ("unknown_function_kept_as_text",
     "Sure.\n<tool_call>launch\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\nDone.", True, "stop",
     {"content": "Sure.\n<tool_call>launch\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>\nDone.",
      "reasoning": None, "calls": []}),
    ("tools_off_call_kept_as_text", "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
     False, "stop", {"content": "<tool_call>add\n<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>",
                     "reasoning": None, "calls": []}),
    ("unterminated_call_stopped", "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b",
     True, "stop", {"content": None, "reasoning": None, "calls": [("add", '{"a":1}')]}),
    ("unterminated_value_stopped", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon", True, "stop",
     {"content": None, "reasoning": None, "calls": [("get_weather", '{"city":"Lyon"}')]}),
    ("cut_inside_call", "<think>go</think><tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n"
     "<arg_key>b</arg_key>\n<arg_value>2", True, "length",
     {"content": None, "reasoning": "go", "calls": [("add", '{"a":1')]}),
    ("cut_inside_name", "Hm.<tool_call>get_wea", True, "length",
     {"content": "Hm.", "reasoning": None, "calls": []}),
    ("call_end_cuts_value_and_key",
     "<tool_call>add\n<arg_key>a</arg_key><arg_value>7</tool_call><tool_call>add<arg_key>b</tool_call>", True, "stop",
     {"content": None, "reasoning": None, "calls": [("add", '{"a":7}'), ("add", "{}")]}),
    ("junk_inside_call_skipped", "<tool_call>add\nsome junk <b>\n<arg_key>a</arg_key>oops<arg_value>5</arg_value>"
     " more</tool_call>", True, "stop", {"content": None, "reasoning": None, "calls": [("add", '{"a":5}')]}),
    ("stray_markers", "</think>Answer with <tool_call literal and </tool_call> stray.", True, "stop",
     {"content": "Answer with <tool_call literal and  stray.", "reasoning": None, "calls": []}),
    ("unterminated_think", "<think>still thinking <tool_call>add", True, "length",
     {"content": "", "reasoning": "still thinking <tool_call>add", "calls": []}),
]


@pytest.mark.parametrize(("name", "text", "tools_on", "reason", "want"), GLM_CASES, ids=[c[0] for c in GLM_CASES])
def test_glm45_parser(name: str, text: str, tools_on: bool, reason: str, want: dict[str, Any]) -> None:
    markers = () if name.endswith("as_text") or name == "unterminated_think" else GLM_MARKERS
    check_all_splits(lambda: Glm45Parser(TOOLS if tools_on else None), text, want, reason, markers)


def test_glm45_prompt_left_inside_think() -> None:
    """A template that opens ``<think>`` in the prompt: the answer begins as reasoning."""
    check_all_splits(lambda: Glm45Parser(TOOLS, in_reasoning=True), "Let me see.\n</think>\n\nIt is 4.",
                     {"content": "It is 4.", "reasoning": "Let me see.", "calls": []}, "stop", GLM_MARKERS)


def test_glm45_streams_one_pair_at_a_time() -> None:
    p = Glm45Parser(TOOLS)
    assert p.feed("<think>a") == [Piece("reasoning", "a")]
    got = p.feed(" b </think>\n<tool_call>get_weather\n")  # the trailing blank of the reasoning is dropped
    assert [(x.kind, x.name, x.text) for x in got] == [("reasoning", None, " b"), ("call", "get_weather", "")]
    p = Glm45Parser(TOOLS)
    p.feed("<tool_call>get_weather")
    head = p.feed("\n<arg_key>city</arg_key>\n<arg_value>Par")
    assert [(x.name, x.text) for x in head] == [("get_weather", "")]
    assert p.feed("is</arg_value>\n<arg_key>days") == [Piece("call", '{"city":"Paris"', 0)]
    assert p.feed("</arg_key><arg_value>3</arg_value></tool_call>") == [Piece("call", ',"days":3}', 0)]
    assert p.finish("stop") == []


# ---------------------------------------------------------------------------------------- default

ONE = '{"name":"add","arguments":{"a":1,"b":-2}}'
TWO = '[{"name":"add","arguments":{"a":1,"b":2}},{"name":"get_weather","arguments":{"city":"P\\"a}ris"}}]'


@pytest.mark.parametrize(("text", "reason", "forced", "want"), [
    (ONE, "stop", False, {"content": None, "reasoning": None, "calls": [("add", '{"a":1,"b":-2}')]}),
    (TWO, "stop", False, {"content": None, "reasoning": None,
                          "calls": [("add", '{"a":1,"b":2}'), ("get_weather", '{"city":"P\\"a}ris"}')]}),
    (TWO[:-12], "length", False, {"content": None, "reasoning": None,
                                  "calls": [("add", '{"a":1,"b":2}'), ("get_weather", '{"city":"')]}),
    ("Plain text {with braces}", "stop", False, {"content": "Plain text {with braces}", "reasoning": None, "calls": []}),
    ("<tool_call>\n" + ONE + "\n</tool_call>", "stop", False,
     {"content": None, "reasoning": None, "calls": [("add", '{"a":1,"b":-2}')]}),
    ("<tool_call>{bad json}</tool_call>", "stop", False,
     {"content": "<tool_call>{bad json}</tool_call>", "reasoning": None, "calls": []}),
    ('{"name":"get_w', "length", False, {"content": "", "reasoning": None, "calls": []}),
    ('{"z": [1, {"name": "add"}]}', "stop", False, {"content": '{"z": [1, {"name": "add"}]}', "reasoning": None,
                                                   "calls": []}),  # a response_format answer beside tools
    ("", "length", True, {"content": "", "reasoning": None, "calls": []}),
])
def test_default_parser(text: str, reason: str, forced: bool, want: dict[str, Any]) -> None:
    check_all_splits(lambda: DefaultParser(NAMES, forced), text, want, reason)


def test_make_parser_picks_by_format() -> None:
    assert make_parser("default", None) is None
    assert make_parser("default", TOOLS) is None  # tools without a grammar: nothing shapes JSON calls
    assert isinstance(make_parser("default", TOOLS, json_calls=True), DefaultParser)
    assert isinstance(make_parser("harmony", None), HarmonyParser)
    assert isinstance(make_parser("glm45", TOOLS), Glm45Parser)


def test_piece_deltas_are_openai_chunk_deltas() -> None:
    assert Piece("content", "a").delta() == {"content": "a"}
    assert Piece("reasoning", "r").delta() == {"reasoning_content": "r"}
    assert Piece("call", "{}", 2, "call_x", "f").delta() == {"tool_calls": [
        {"index": 2, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    assert Piece("call", "1}", 2).delta() == {"tool_calls": [{"index": 2, "function": {"arguments": "1}"}}]}
    got = collect([Piece("reasoning", "r"), Piece("call", "", 0, "call_a", "f"), Piece("call", '{"x":', 0),
                   Piece("call", "1}", 0)])
    assert got.content is None and got.reasoning == "r"
    assert json.loads(got.tool_calls[0]["function"]["arguments"]) == {"x": 1}


@pytest.mark.parametrize(("template", "make", "generated", "prefix"), [
    (HARMONY_TEMPLATE, lambda: HarmonyParser(NAMES),
     "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}', "<|start|>assistant"),
    (GLM45_TEMPLATE, lambda: Glm45Parser(TOOLS),
     "\n<think>Need the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
     "</arg_value>\n</tool_call>", "<|assistant|>"),
], ids=["harmony", "glm45"])
def test_a_parsed_answer_renders_back_as_generated(template: str, make: Callable[[], AnswerParser], generated: str,
                                                   prefix: str) -> None:
    """The message a client gets back, sent again as history, renders as the markup the model wrote."""
    answer, _ = run(make, [generated])
    message = {"role": "assistant", "content": answer.content, "reasoning_content": answer.reasoning,
               "tool_calls": answer.tool_calls}
    history = [{"role": "user", "content": "Weather in Paris?"}, message,
               {"role": "tool", "tool_call_id": answer.tool_calls[0]["id"], "content": "{\"temp\": 21}"}]
    rendered = ChatTemplate(template).render(history, tools=TOOLS)
    assert prefix + generated in rendered
