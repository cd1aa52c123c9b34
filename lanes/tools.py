"""Tool calls in a chat answer: the grammar that shapes them and the scanner that finds them.

The model calls a tool by answering ``{"name": <function>, "arguments": {...}}``, or several at
once with a JSON array of such objects (at most :data:`MAX_TOOL_CALLS`), the form the fallback
tool prompt teaches (common.chat_template.TOOL_PROMPT). The grammar (:func:`tools_grammar`)
enforces it:

* ``required`` or a named function: the answer *is* one call (``parallel_tool_calls: false``) or
  one call or an array of 1..N calls (otherwise);
* ``auto``: either those calls or plain text; text may not begin with ``{``, ``[`` or white
  space, so an answer that starts like a call is held to a well-formed one.

:class:`ToolCallScanner` reads the answer as it grows, so a stream can send OpenAI-shaped
``tool_calls`` deltas as the tokens arrive: a call's first delta (index, id, type, name,
``arguments: ""``) once its name is complete, then pieces of its ``arguments`` text. The same
scanner, run over the whole answer, gives the non-streamed ``message.tool_calls``, so both carry
the very same argument text the model wrote. An answer cut short (``max_tokens``) that began a
call, or any answer of a forced call, gives its partial calls (:meth:`ToolCallScanner.partial`),
never the call's JSON envelope as text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from engine.constraints import json_schema_grammar, text_or_json_grammar

__all__ = ["MAX_TOOL_CALLS", "ScannedCall", "ToolCallScanner", "calls_schema", "tool_call_schema",
           "tools_grammar"]

MAX_TOOL_CALLS = 8  # calls in one answer: bounds a small model that would repeat calls until max_tokens

_TAG_OPEN, _TAG_CLOSE = "<tool_call>", "</tool_call>"


def tool_call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The JSON shape of one call of ``tool``: ``{"name": <its name>, "arguments": <its parameters>}``."""
    fn = tool["function"]
    return {"type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One call of any of ``tools``; with ``parallel`` also an array of 1..MAX_TOOL_CALLS calls."""
    shapes = [tool_call_schema(t) for t in tools]
    one = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
    if not parallel:
        return one
    return {"anyOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_TOOL_CALLS}]}


def tools_grammar(mode: Literal["forced", "auto"], tools: list[dict[str, Any]], parallel: bool,
                  answer_schema: dict[str, Any] | bool | None = None) -> str:
    """The grammar of a chat answer that may (``auto``) or must (``forced``) call ``tools``.

    ``answer_schema`` is the ``response_format`` schema of a non-call answer in ``auto`` mode
    (None: free text)."""
    calls = calls_schema(tools, parallel)
    if mode == "forced":
        return json_schema_grammar(calls)
    if answer_schema is not None:
        return json_schema_grammar({"anyOf": [calls, answer_schema]})
    return text_or_json_grammar(calls)


@dataclass
class ScannedCall:
    id: str
    name: str | None = None
    args_start: int | None = None  # offsets in the answer text of the arguments value
    args_end: int | None = None
    sent_head: bool = False
    sent_to: int = 0  # argument text streamed up to this offset
    closed: bool = False  # the call object's closing brace was seen


@dataclass
class ToolDelta:
    """A piece of a streamed tool call: the head (``name`` set) or more ``arguments`` text."""
    index: int
    id: str | None
    name: str | None
    arguments: str

    def openai(self) -> dict[str, Any]:
        """The entry of ``delta.tool_calls`` in a chat.completion.chunk."""
        if self.name is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}

    def call(self) -> dict[str, Any]:
        """The whole call as an entry of ``message.tool_calls`` (a head: id and name set)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolCallScanner:
    """Incremental reader of one answer that may be tool calls (see the module docstring).

    ``kind`` says what the answer is, as far as the text so far shows: None (undecided: only
    white space or the start of ``<tool_call>``), ``"text"``, ``"json"`` (a call object or an
    array of them, streamed call by call) or ``"tagged"`` (``<tool_call>`` blocks, as templates
    with native tools write them: parsed when the answer ends).
    """

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.text = ""
        self.kind: Literal["text", "json", "tagged"] | None = None
        self.calls: list[ScannedCall] = []
        self.text_sent = 0  # content streamed up to this offset (kind "text")
        self._pos = 0
        self._start = 0  # offset of the first non-blank character
        self._stack: list[str] = []
        self._in_str = False
        self._esc = False
        self._str_start = 0
        self._base = 1  # stack depth inside a call object: 1 for {...}, 2 for [{...}, ...]
        self._key: str | None = None
        self._expect: Literal["key", "value", "other"] = "other"

    # ------------------------------------------------------------------ scanning
    def feed(self, piece: str) -> None:
        self.text += piece
        if self.kind is None:
            body = self.text.lstrip()
            if not body or (_TAG_OPEN.startswith(body) and len(body) < len(_TAG_OPEN)):
                return
            self._start = len(self.text) - len(body)
            if body.startswith(_TAG_OPEN):
                self.kind = "tagged"
            elif body[0] in "{[":
                self.kind = "json"
                self._base = 1 if body[0] == "{" else 2
                self._pos = self._start
            else:
                self.kind = "text"
        if self.kind == "json":
            self._scan()

    def _scan(self) -> None:
        s = self.text
        for i in range(self._pos, len(s)):
            ch = s[i]
            at_call = len(self._stack) == self._base and self._stack[-1] == "{"
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if at_call:
                        self._string_done(s[self._str_start: i + 1], i + 1)
                continue
            if ch in " \t\r\n":
                continue
            if at_call and self._expect == "value":
                self._value_start(i)
            if ch == '"':
                self._in_str, self._str_start = True, i
            elif ch in "{[":
                self._stack.append(ch)
                if len(self._stack) == self._base and ch == "{":
                    self.calls.append(ScannedCall("call_" + uuid.uuid4().hex[:24]))
                    self._expect, self._key = "key", None
            elif ch in "}]":
                if at_call and ch == "}":  # the call object ends (after a scalar arguments value too)
                    if self._key == "arguments":
                        self._args_done(i)
                    self.calls[-1].closed = True
                if self._stack:
                    self._stack.pop()
                if len(self._stack) == self._base and self._key == "arguments" and self.calls:
                    self._args_done(i + 1)  # its arguments object or array ends
            elif at_call and ch == ":":
                self._expect = "value"
            elif at_call and ch == ",":
                if self._key == "arguments":  # a scalar arguments value ends here
                    self._args_done(i)
                self._expect, self._key = "key", None
        self._pos = len(s)

    def _value_start(self, i: int) -> None:
        self._expect = "other"
        if self._key == "arguments" and self.calls and self.calls[-1].args_start is None:
            self.calls[-1].args_start = i

    def _string_done(self, raw: str, end: int) -> None:
        try:
            value = json.loads(raw)
        except ValueError:
            return
        if self._expect == "key":
            self._key = value
            self._expect = "other"
        elif self._key == "name" and self.calls and isinstance(value, str):
            self.calls[-1].name = value
        elif self._key == "arguments":
            self._args_done(end)

    def _args_done(self, end: int) -> None:
        call = self.calls[-1]
        if call.args_start is not None and call.args_end is None:
            call.args_end = end

    # ------------------------------------------------------------------ streaming
    def take_text(self) -> str:
        """Content not streamed yet (kind ``"text"``)."""
        out = self.text[self.text_sent:]
        self.text_sent = len(self.text)
        return out

    def take_deltas(self) -> list[ToolDelta]:
        """Tool-call deltas not streamed yet (kind ``"json"``): heads once a name is known
        (and valid), then argument text as far as it has been written."""
        out: list[ToolDelta] = []
        for k, call in enumerate(self.calls):
            if call.name is None or call.name not in self.names:
                continue
            piece = ""
            if call.args_start is not None:
                start = max(call.sent_to, call.args_start)
                end = call.args_end if call.args_end is not None else len(self.text)
                piece = self.text[start:end]
                call.sent_to = end
            if not call.sent_head:
                call.sent_head = True
                out.append(ToolDelta(k, call.id, call.name, piece))
            elif piece:
                out.append(ToolDelta(k, None, None, piece))
        return out

    @property
    def streamed_calls(self) -> bool:
        return any(c.sent_head for c in self.calls)

    # ------------------------------------------------------------------ the whole answer
    def result(self) -> list[dict[str, Any]] | None:
        """The finished answer as OpenAI tool calls, or None when it is not (only) well-formed
        calls of known functions."""
        if self.kind == "tagged":
            return self._tagged()
        if self.kind != "json":
            return None
        try:
            obj = json.loads(self.text)
        except ValueError:
            return None
        objs = obj if isinstance(obj, list) else [obj]
        if not objs or len(objs) != len(self.calls):
            return None
        out = []
        for o, call in zip(objs, self.calls, strict=True):
            if not isinstance(o, dict) or o.get("name") not in self.names or not isinstance(o.get("arguments"), dict):
                return None
            args = (self.text[call.args_start: call.args_end] if call.args_start is not None and call.args_end is not None
                    else _compact(o["arguments"]))
            out.append({"id": call.id, "type": "function", "function": {"name": o["name"], "arguments": args}})
        return out

    def partial(self) -> list[ToolDelta]:
        """The calls of an answer cut short (``max_tokens``) or otherwise not whole: each call whose
        name is known (or, with one function to call, any call begun) with the argument text written
        so far. A forced call comes back as a call even then, never as its envelope in ``content``."""
        only = self.names[0] if len(self.names) == 1 else None
        out: list[ToolDelta] = []
        for k, call in enumerate(self.calls):
            name = call.name if call.name in self.names else only
            if name is None:
                continue
            args = ""
            if call.args_start is not None:
                args = self.text[call.args_start: call.args_end if call.args_end is not None else len(self.text)]
            out.append(ToolDelta(k, call.id, name, args))
        if not out and only is not None and self.kind in ("json", None):  # cut before the call object began
            self.calls.append(ScannedCall("call_" + uuid.uuid4().hex[:24]))
            out.append(ToolDelta(len(self.calls) - 1, self.calls[-1].id, only, ""))
        return out

    def take_partial(self) -> list[ToolDelta]:
        """:meth:`partial` for a stream that has sent :meth:`take_deltas` so far: what is still unsent
        (heads of calls not sent yet with all their text, the rest of the others' arguments)."""
        out = []
        for d in self.partial():
            call = self.calls[d.index]
            if not call.sent_head:
                call.sent_head = True
                out.append(d)
            else:
                end = call.args_end if call.args_end is not None else len(self.text)
                if call.args_start is not None and end > max(call.sent_to, call.args_start):
                    out.append(ToolDelta(d.index, None, None, self.text[max(call.sent_to, call.args_start): end]))
                    call.sent_to = end
        return out

    def _tagged(self) -> list[dict[str, Any]] | None:
        rest = self.text.strip()
        out = []
        while rest:
            if not rest.startswith(_TAG_OPEN) or _TAG_CLOSE not in rest:
                return None
            body, _, rest = rest[len(_TAG_OPEN):].partition(_TAG_CLOSE)
            rest = rest.strip()
            try:
                o = json.loads(body)
            except ValueError:
                return None
            if not isinstance(o, dict) or o.get("name") not in self.names or not isinstance(o.get("arguments"), dict):
                return None
            out.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                        "function": {"name": o["name"], "arguments": _compact(o["arguments"])}})
        return out or None


def _compact(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def parse_tool_calls(text: str, names: list[str]) -> list[dict[str, Any]] | None:
    """A whole answer -> its OpenAI tool calls (None when it is not only calls of ``names``)."""
    sc = ToolCallScanner(names)
    sc.feed(text)
    return sc.result()
