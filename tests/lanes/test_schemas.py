"""lanes/schemas.py: object schemas closed by default, walked with the default model's own tokens."""

from __future__ import annotations

from typing import Any

import pytest

from engine.constraints import GrammarCompiler, json_schema_grammar
from engine.engine import Engine
from lanes.errors import APIError
from lanes.protocol import ChatRequest
from lanes.schemas import close_objects
from tests.lanes.test_tools import walk

# as LangChain writes a tool's parameters: no additionalProperties anywhere
LANGCHAIN = {"type": "object", "properties": {
    "city": {"type": "string", "description": "the city"},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
    "free": {"type": "object"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def compiler(lane_engine: Engine) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(lane_engine.tokenizer)


def test_close_objects_closes_listed_objects_only() -> None:
    out = close_objects(LANGCHAIN)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["free"]  # free-form by intent
    assert "additionalProperties" not in LANGCHAIN  # the input is left as it was
    # a schema's own rule stands; $defs and anyOf branches are closed; allOf members are not
    assert close_objects({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"]
    assert close_objects({"properties": {"a": {}}, "patternProperties": {"^x": {}}}).get("additionalProperties") is None
    defs = close_objects({"$defs": {"P": {"type": "object", "properties": {"n": {}}}},
                          "anyOf": [{"$ref": "#/$defs/P"}, {"type": "object", "properties": {"m": {}}}]})
    assert defs["$defs"]["P"]["additionalProperties"] is False and defs["anyOf"][1]["additionalProperties"] is False
    assert "additionalProperties" not in defs["anyOf"][0]
    both = close_objects({"allOf": [{"type": "object", "properties": {"a": {}}},
                                    {"type": "object", "properties": {"b": {}}}]})
    assert all("additionalProperties" not in m for m in both["allOf"]) and "additionalProperties" not in both
    assert close_objects(True) is True


def test_grammar_rejects_invented_keys_unless_opened(compiler: GrammarCompiler) -> None:
    extra = '{"city":"Paris","unit":"C"}'
    nested = '{"city":"Paris","where":{"lat":1,"x":2}}'
    fine = '{"city":"Paris","where":{"lat":1.5},"free":{"any":1}}'
    closed = json_schema_grammar(close_objects(LANGCHAIN))
    assert [walk(compiler, closed, t) for t in (extra, nested, fine)] == ["rejected", "rejected", "done"]
    opened = json_schema_grammar(LANGCHAIN)
    assert walk(compiler, opened, extra) == "done" and walk(compiler, opened, nested) == "done"


def _req(**kw: Any) -> ChatRequest:
    return ChatRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": LANGCHAIN}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def test_request_closes_tool_and_response_schemas(compiler: GrammarCompiler) -> None:
    call = '{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}'
    for opened, want in ((None, "rejected"), (False, "rejected"), (True, "done")):
        req = _req(tools=[WEATHER], tool_choice="required", additional_properties_default=opened)
        assert walk(compiler, req.grammar()[0], call) == want, opened
        rf = _req(response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": LANGCHAIN}},
                  additional_properties_default=opened)
        assert walk(compiler, rf.grammar()[0], '{"city":"Paris","unit":"C"}') == want, opened
    # json_object stays any object
    assert walk(compiler, _req(response_format={"type": "json_object"}).grammar()[0], '{"q":1}') == "done"


def test_tool_choice_forms() -> None:
    tools = [WEATHER, ADD]
    forms: list[tuple[Any, str, list[str]]] = [
        ("none", "none", []), ("auto", "auto", ["get_weather", "add"]), (None, "auto", ["get_weather", "add"]),
        ("required", "forced", ["get_weather", "add"]), ("any", "forced", ["get_weather", "add"]),
        ({"type": "function", "function": {"name": "add"}}, "forced", ["add"]),
        ({"type": "function", "name": "add"}, "forced", ["add"]),  # the Responses API's flat form
        ({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
            {"type": "function", "function": {"name": "add"}}]}}, "auto", ["add"]),
        ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "get_weather"}]},
         "forced", ["get_weather"]),
    ]
    for choice, mode, names in forms:
        got_mode, got = _req(tools=tools, tool_choice=choice).tool_mode()
        assert (got_mode, [t["function"]["name"] for t in got]) == (mode, names), choice
    bad = ["sometimes", {"type": "function"}, {"type": "function", "function": {"name": "nope"}},
           {"type": "allowed_tools", "allowed_tools": {"mode": "maybe", "tools": [{"type": "function", "name": "add"}]}},
           {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}},
           {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "name": "x"}]}},
           {"type": "custom", "custom": {"name": "add"}}, 3]
    for choice in bad:
        with pytest.raises(APIError) as e:
            _req(tools=tools, tool_choice=choice).tool_mode()
        assert e.value.status == 400 and e.value.param == "tool_choice", choice
