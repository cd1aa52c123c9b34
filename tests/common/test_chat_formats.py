"""common/chat_formats.py: which format a template speaks, and OpenAI-shaped history rendered through the
harmony (gpt-oss) and GLM-4.5 templates as those templates read it: calls with object arguments, one
call per harmony assistant message followed by its own result, tool results named after their call,
reasoning where each template looks for it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from common.chat_formats import detect_format, format_for_architecture, shape_messages
from common.chat_template import CHATML_TEMPLATE, ChatTemplate
from tests.common.test_glm_format import GLM45_TEMPLATE
from tests.common.test_glm_format import TOOLS as GLM_TOOLS
from tests.common.test_harmony_format import HARMONY_TEMPLATE
from tests.common.test_harmony_format import TOOLS as HARMONY_TOOLS
from tests.common.test_harmony_format import _jinja2_render as harmony_jinja2

QWEN_LIKE = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}{%- for c in m.tool_calls or [] %}"
             "<tool_call>\n{{ c.function | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endfor %}")


def call(cid: str, name: str, args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_format_is_read_from_the_template() -> None:
    assert detect_format(HARMONY_TEMPLATE) == "harmony"
    assert detect_format(GLM45_TEMPLATE) == "glm45"
    assert detect_format(CHATML_TEMPLATE) == "default"
    assert detect_format(QWEN_LIKE) == "default"  # <tool_call> JSON blocks: the default reading
    assert ChatTemplate(HARMONY_TEMPLATE).format == "harmony" and ChatTemplate(GLM45_TEMPLATE).format == "glm45"
    assert ChatTemplate(CHATML_TEMPLATE, is_fallback=True).format == "default"
    assert [format_for_architecture(a) for a in ("gpt-oss", "glm4moe", "qwen3moe", None)] == \
        ["harmony", "glm45", "default", "default"]


def test_default_format_passes_messages_through() -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call("c", "f", '{"a": 1}')]}]
    assert shape_messages("default", msgs) is msgs


def test_harmony_history_from_an_openai_client() -> None:
    """Two parallel calls with string arguments, their results in the other order and without names: each
    call becomes its own assistant message followed by its result, named after it; the reasoning the lane
    returned (``reasoning_content``) is the analysis message before the first call."""
    openai = [
        {"role": "user", "content": "Weather in Paris and Berlin?"},
        {"role": "assistant", "content": None, "reasoning_content": "Two cities: two calls.",
         "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}'), call("c2", "get_weather", '{"city": "Berlin"}')]},
        {"role": "tool", "tool_call_id": "c2", "content": "{\"temp\": 17}"},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "Paris 21°, Berlin 17°.", "reasoning_content": "Report."},
        {"role": "user", "content": "Thanks"},
    ]
    by_hand = [
        openai[0],
        {"role": "assistant", "content": None, "reasoning_content": "Two cities: two calls.",
         "thinking": "Two cities: two calls.", "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": None, "tool_calls": [call("c2", "get_weather", {"city": "Berlin"})]},
        {"role": "tool", "tool_call_id": "c2", "name": "get_weather", "content": "{\"temp\": 17}"},
        {"role": "assistant", "content": "Paris 21°, Berlin 17°.", "reasoning_content": "Report.", "thinking": "Report."},
        openai[5],
    ]
    assert shape_messages("harmony", openai) == by_hand
    ours = ChatTemplate(HARMONY_TEMPLATE).render(openai, tools=HARMONY_TOOLS)
    assert ours == harmony_jinja2(HARMONY_TEMPLATE, by_hand, True, tools=HARMONY_TOOLS)
    first = ours.index("<|start|>assistant<|channel|>analysis<|message|>Two cities: two calls.<|end|>"
                       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                       "{\"city\": \"Paris\"}<|call|>"
                       "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 21}<|end|>"
                       "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                       "{\"city\": \"Berlin\"}<|call|>"
                       "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{\"temp\": 17}<|end|>")
    assert first > 0


def test_harmony_shaping_keeps_what_the_template_refuses_out() -> None:
    msgs = [{"role": "user", "content": "x"},
            {"role": "assistant", "content": "Let me look.", "reasoning_content": "r",
             "tool_calls": [call("c1", "get_weather", "not json")]},
            {"role": "tool", "tool_call_id": "unknown", "content": "?"},
            {"role": "assistant", "content": None, "tool_calls": None}]
    shaped = shape_messages("harmony", msgs)
    # content beside a call: no thinking too (gpt-oss's template raises on both); arguments that are not
    # a JSON object stay as given; a result of an unknown call gets no name; no tool_calls key without calls
    assert "thinking" not in shaped[1] and shaped[1]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert "name" not in shaped[2]
    assert shaped[3] == {"role": "assistant", "content": ""}
    assert msgs[3] == {"role": "assistant", "content": None, "tool_calls": None}  # the caller's messages untouched


def test_glm45_history_from_an_openai_client() -> None:
    openai = [
        {"role": "user", "content": "Weather in Paris for 2 days?"},
        {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
         "tool_calls": [call("c1", "get_weather", json.dumps({"city": "Paris", "days": 2}))]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
    ]
    ours = ChatTemplate(GLM45_TEMPLATE).render(openai, tools=GLM_TOOLS)
    assert ("<|assistant|>\n<think>Call the tool.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
            "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call><|observation|>\n"
            "<tool_response>\n{\"temp\": 21}\n</tool_response><|assistant|>") in ours
    assert openai[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "days": 2}'  # not changed


@pytest.mark.parametrize("args", ["[1, 2]", "{broken", "\"text\""])
def test_glm45_arguments_that_are_no_object_stay_as_given(args: str) -> None:
    msgs = [{"role": "assistant", "content": None, "tool_calls": [call("c", "get_weather", args)]}]
    assert shape_messages("glm45", msgs)[0]["tool_calls"][0]["function"]["arguments"] == args
    ChatTemplate(GLM45_TEMPLATE).render(msgs)  # renders (without arguments), no exception
