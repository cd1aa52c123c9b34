"""Model chat formats: which one a chat template speaks, and OpenAI messages shaped for it.

A format is the syntax a model family writes its answers in and reads its history in:

* ``default``: plain text; tool calls as the JSON the fallback tool prompt teaches, or as
  ``<tool_call>{json}</tool_call>`` (Qwen-style native templates); no reasoning split.
* ``harmony`` (gpt-oss): messages in channels, ``<|channel|>analysis<|message|>...<|end|>`` for
  reasoning, ``<|channel|>final<|message|>...`` for the answer, a tool call as
  ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>``.
* ``glm45`` (GLM-4.5 / 4.6 / Air): reasoning in ``<think>...</think>``, a tool call as
  ``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``.

The format is read from the template's own text (the markers it renders), never from a model's
name; the lane falls back to the architecture when the GGUF has no template (lanes/chat_parsers.py
reads answers). :func:`shape_messages` turns OpenAI-shaped history into what these families'
published templates read: both iterate over ``arguments`` as an object (an OpenAI client sends a
JSON string), gpt-oss's renders one call per assistant message, names a tool result after the
call before it and reads the reasoning from ``thinking``, and it tells a tool-call turn by the
mere presence of a ``tool_calls`` key. Shaping runs wherever a prompt is rendered
(common.chat_template), so the gateway's count and the lane's prompt stay the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

__all__ = ["FORMATS", "ChatFormat", "detect_format", "format_for_architecture", "shape_messages"]

ChatFormat = Literal["default", "harmony", "glm45"]
FORMATS: tuple[ChatFormat, ...] = ("default", "harmony", "glm45")

# Architectures whose models write a format of their own even when the GGUF carries no template.
_ARCH_FORMATS: dict[str, ChatFormat] = {"gpt-oss": "harmony", "glm4moe": "glm45"}


def detect_format(template_source: str) -> ChatFormat:
    """The format a chat template renders: harmony when it writes channels, GLM-4.5 when it writes
    ``<arg_key>`` tool arguments, the default otherwise."""
    if "<|channel|>" in template_source and "<|message|>" in template_source:
        return "harmony"
    if "<arg_key>" in template_source and "<tool_call>" in template_source:
        return "glm45"
    return "default"


def format_for_architecture(arch: str | None) -> ChatFormat:
    """The format a model of ``arch`` writes when no template says (``general.architecture``)."""
    return _ARCH_FORMATS.get(arch or "", "default")


def _object_arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """A tool call whose ``function.arguments`` JSON string is an object, with it parsed (other values
    stay as they are: a template renders what it was given)."""
    out = dict(call)
    fn = out.get("function")
    if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except ValueError:
            return out
        if isinstance(args, dict):
            out["function"] = {**fn, "arguments": args}
    return out


def _call_name(call: Mapping[str, Any]) -> str | None:
    fn = call.get("function")
    name = fn.get("name") if isinstance(fn, Mapping) else call.get("name")
    return name if isinstance(name, str) else None


def _shape_harmony(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}  # tool_call_id -> function name, over the whole conversation
    out: list[dict[str, Any]] = []

    def result(r: dict[str, Any]) -> dict[str, Any]:
        call_id = r.get("tool_call_id")
        if not isinstance(r.get("name"), str) and isinstance(call_id, str) and call_id in names:
            return {**r, "name": names[call_id]}
        return r

    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant":
            out.append(result(m) if m.get("role") == "tool" else m)
            continue
        calls = m.pop("tool_calls", None) or []  # the template tests the key, not its value
        reasoning = m.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning and "thinking" not in m and not (calls and m.get("content")):
            m["thinking"] = reasoning  # beside a call, the template refuses both content and thinking
        if not calls:
            if m.get("content") is None:
                m["content"] = ""
            out.append(m)
            continue
        calls = [_object_arguments(c) if isinstance(c, Mapping) else c for c in calls]
        for c in calls:
            name = _call_name(c) if isinstance(c, Mapping) else None
            if name is not None and isinstance(c.get("id"), str):
                names[c["id"]] = name
        results = []  # the tool results that answer this turn
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        used: set[int] = set()
        # one call per assistant message (the template renders the first call only), each followed by
        # its own result: gpt-oss calls one function at a time
        for k, c in enumerate(calls):
            out.append({**m, "tool_calls": [c]} if k == 0 else {"role": "assistant", "content": None,
                                                                 "tool_calls": [c]})
            call_id = c.get("id") if isinstance(c, Mapping) else None
            mine = next((r for r in results if id(r) not in used and r.get("tool_call_id") == call_id), None)
            if mine is not None and len(calls) > 1:
                used.add(id(mine))
                out.append(result(mine))
        out.extend(result(r) for r in results if id(r) not in used)
    return out


def _shape_glm45(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and isinstance(calls, list):
            m = {**m, "tool_calls": [_object_arguments(c) if isinstance(c, Mapping) else c for c in calls]}
        out.append(m)
    return out


def shape_messages(fmt: ChatFormat, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` (OpenAI's shape, already checked) as the templates of ``fmt`` read them; the
    default format's pass through unchanged."""
    if fmt == "harmony":
        return _shape_harmony(messages)
    if fmt == "glm45":
        return _shape_glm45(messages)
    return messages
