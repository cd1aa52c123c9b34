"""Reading a chat answer in the model's own format: its content, its reasoning and its tool calls.

One parser per format (common/chat_formats.py), all with one interface, :class:`AnswerParser`:
``feed(text)`` takes the next piece of generated text and returns the :class:`Piece` s that are
certain so far; ``finish(finish_reason)`` returns the rest when the answer ends. A streamed answer
sends the pieces as they come (``delta.content``, ``delta.reasoning_content``, ``delta.tool_calls``);
a whole answer is :func:`collect` of the same pieces, so the two carry the same message by
construction, however the text was cut into pieces. Text that may still be the start of a marker
is held back until the next piece tells, so no part of a marker ever reaches ``content``.

* :class:`DefaultParser`: the answer the tool grammar shapes (lanes/tools.py): text, calls as a
  JSON object or array streamed as written, or ``<tool_call>{json}</tool_call>`` blocks read when
  the answer ends (kept as content when they are not calls of known functions).
* :class:`HarmonyParser` (gpt-oss): ``analysis`` channel -> reasoning; ``final`` and ``commentary``
  without a recipient -> content; a message addressed ``to=functions.NAME`` (in the channel or the
  role part of its header) -> a tool call of NAME whose arguments are the message text, streamed as
  written. A call of a function not offered keeps its text as content.
* :class:`Glm45Parser` (GLM-4.5): ``<think>...</think>`` -> reasoning; ``<tool_call>NAME`` followed by
  ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs -> a call whose arguments are the JSON object
  of the pairs (V as a string where the tool's schema says string, else as JSON when it parses, else
  a string), one pair streamed at a time; a call of a function not offered stays as its text in
  content. Content and reasoning are stripped of surrounding white space, as GLM's template writes them.

Arguments are the text the model wrote (harmony) or the JSON of what it wrote (GLM); invalid JSON
in them stays as written, as OpenAI returns it. An answer cut by ``max_tokens`` inside a call
keeps the call with the arguments written so far; a message cut inside its header adds nothing.
With tools under a grammar (forced calls, or a JSON ``response_format``), a format parser hands its
content to a :class:`DefaultParser`, which reads the JSON calls the grammar produces.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

from common.chat_formats import ChatFormat
from lanes.tools import ToolCallScanner, ToolDelta

__all__ = ["Answer", "AnswerParser", "DefaultParser", "Glm45Parser", "HarmonyParser", "Piece", "collect",
           "make_parser"]

PieceKind = Literal["content", "reasoning", "call"]


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class Piece:
    """A part of an answer: content or reasoning text, or a part of tool call ``index`` (its head,
    with ``id`` and ``name`` set, or more of its ``arguments`` text)."""

    kind: PieceKind
    text: str
    index: int = 0
    id: str | None = None
    name: str | None = None

    def delta(self) -> dict[str, Any]:
        """This piece as the ``delta`` of a chat.completion.chunk."""
        if self.kind == "content":
            return {"content": self.text}
        if self.kind == "reasoning":
            return {"reasoning_content": self.text}
        if self.name is not None:
            return {"tool_calls": [{"index": self.index, "id": self.id, "type": "function",
                                    "function": {"name": self.name, "arguments": self.text}}]}
        return {"tool_calls": [{"index": self.index, "function": {"arguments": self.text}}]}


@dataclass
class Answer:
    """A whole answer: ``content`` (None when the answer is only calls), ``reasoning`` (None when
    there is none) and ``tool_calls`` (OpenAI's ``message.tool_calls`` entries)."""

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]


def collect(pieces: list[Piece]) -> Answer:
    """The answer the pieces make, as a stream's client joins them."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for p in pieces:
        if p.kind == "content":
            content.append(p.text)
        elif p.kind == "reasoning":
            reasoning.append(p.text)
        elif p.name is not None:
            calls[p.index] = {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.text}}
        elif p.index in calls:
            calls[p.index]["function"]["arguments"] += p.text
    text = "".join(content)
    return Answer(content=text if text or not calls else None, reasoning="".join(reasoning) if reasoning else None,
                  tool_calls=[calls[k] for k in sorted(calls)])


class AnswerParser(ABC):
    """One answer, read piece by piece (see the module docstring)."""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces the answer so far makes certain, not returned before."""

    @abstractmethod
    def finish(self, finish_reason: str | None) -> list[Piece]:
        """The rest of the answer once it has ended (``stop`` or ``length``)."""


def _add(out: list[Piece], piece: Piece) -> None:
    """Append ``piece``, joined to the last one when both are text of one kind or more arguments of
    one call (fewer, larger stream chunks; the same answer)."""
    if not piece.text and piece.name is None:
        return
    if out and piece.name is None:
        last = out[-1]
        if last.kind == piece.kind and (piece.kind != "call" or last.index == piece.index):
            out[-1] = Piece(last.kind, last.text + piece.text, last.index, last.id, last.name)
            return
    out.append(piece)


# ---------------------------------------------------------------------------------------- default


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _from_delta(d: ToolDelta) -> Piece:
    return Piece("call", d.arguments, d.index, d.id if d.name is not None else None, d.name)


class DefaultParser(AnswerParser):
    """The answer under the tool grammar: text, JSON calls streamed as written, or ``<tool_call>``
    blocks (lanes/tools.py's :class:`ToolCallScanner` tells which). ``forced``: the answer must be a
    call, so even one cut before anything was written is a (partial) call."""

    def __init__(self, names: list[str], forced: bool = False) -> None:
        self.scanner = ToolCallScanner(names)
        self.forced = forced

    @staticmethod
    def _pieces(deltas: list[ToolDelta]) -> list[Piece]:
        out: list[Piece] = []
        for d in deltas:
            _add(out, _from_delta(d))
        return out

    def feed(self, text: str) -> list[Piece]:
        sc = self.scanner
        sc.feed(text)
        if sc.kind == "text":
            return [Piece("content", t)] if (t := sc.take_text()) else []
        if sc.kind == "json":
            return self._pieces(sc.take_deltas())
        return []  # undecided, or tagged calls: the end tells

    def finish(self, finish_reason: str | None) -> list[Piece]:
        sc = self.scanner
        if finish_reason not in ("stop", "length"):
            return []
        if sc.kind == "json" or (sc.kind is None and self.forced):
            out = self._pieces(sc.take_deltas())
            if sc.result() is not None and finish_reason == "stop":
                return out
            if not self.forced and not sc.streamed_calls and _is_json(sc.text):
                return [Piece("content", sc.take_text())]  # a JSON answer (response_format), not a call
            return out + self._pieces(sc.take_partial())  # cut short or not whole: the calls as written
        if sc.kind == "tagged" and finish_reason == "stop" and (calls := sc.result()) is not None:
            return [Piece("call", c["function"]["arguments"], k, c["id"], c["function"]["name"])
                    for k, c in enumerate(calls)]
        return [Piece("content", t)] if (t := sc.take_text()) else []


# ---------------------------------------------------------------------------------------- marker scanning


def _split(buf: str, markers: tuple[str, ...], final: bool) -> tuple[str, str | None, str]:
    """(text before the first whole marker in ``buf``, that marker, what follows it); without a
    whole marker: (the text that cannot begin one, None, the tail that may: held for the next
    piece, or given too when ``final``)."""
    first, found = -1, None
    for m in markers:
        i = buf.find(m)
        if i >= 0 and (first < 0 or i < first):
            first, found = i, m
    if found is not None:
        return buf[:first], found, buf[first + len(found):]
    if final:
        return buf, None, ""
    longest = max(len(m) for m in markers) - 1
    for k in range(min(longest, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return buf[:-k], None, tail
    return buf, None, ""


class _FormatParser(AnswerParser):
    """What the format parsers share: an optional inner parser for content (JSON calls under a
    grammar) whose calls are numbered after and among the format's own."""

    def __init__(self, names: list[str] | None, inner: AnswerParser | None) -> None:
        self.names = names  # functions that may be called (None: tools are off)
        self.inner = inner
        self._n_calls = 0
        self._inner_index: dict[int, int] = {}

    def _new_call(self) -> int:
        self._n_calls += 1
        return self._n_calls - 1

    def _inner_pieces(self, pieces: list[Piece], out: list[Piece]) -> None:
        for p in pieces:
            if p.kind == "call":
                if p.index not in self._inner_index:
                    self._inner_index[p.index] = self._new_call()
                p = Piece("call", p.text, self._inner_index[p.index], p.id, p.name)
            _add(out, p)

    def _content(self, text: str, out: list[Piece]) -> None:
        if not text:
            return
        if self.inner is not None:
            self._inner_pieces(self.inner.feed(text), out)
        else:
            _add(out, Piece("content", text))

    def _finish_inner(self, finish_reason: str | None, out: list[Piece]) -> None:
        if self.inner is not None:
            self._inner_pieces(self.inner.finish(finish_reason), out)


# ---------------------------------------------------------------------------------------- harmony

_START, _CHANNEL, _MESSAGE, _END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
_CALL, _RETURN, _CONSTRAIN = "<|call|>", "<|return|>", "<|constrain|>"
_HARMONY = (_START, _CHANNEL, _MESSAGE, _END, _CALL, _RETURN, _CONSTRAIN)


class HarmonyParser(_FormatParser):
    """gpt-oss's channels (see the module docstring). The prompt ends with ``<|start|>assistant``, so
    an answer begins with ``<|channel|>``; text outside any message (an answer under a JSON grammar
    has no markup at all) is content."""

    def __init__(self, names: list[str] | None = None, inner: AnswerParser | None = None) -> None:
        super().__init__(names, inner)
        self._buf = ""
        self._state: Literal["out", "header", "body"] = "out"
        self._header = ""  # role and channel text of the message being opened
        self._target: PieceKind = "content"
        self._call = -1  # the call the body's text belongs to (target "call")

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self, finish_reason: str | None) -> list[Piece]:
        out: list[Piece] = []
        if finish_reason in ("stop", "length"):
            self._run(out, final=True)
            self._finish_inner(finish_reason, out)
        return out

    def _run(self, out: list[Piece], final: bool) -> None:
        while True:
            text, marker, self._buf = _split(self._buf, _HARMONY, final)
            if self._state == "header":
                self._header += text
            elif self._state == "body":
                self._body(text, out)
            else:
                self._content(text, out)
            if marker is None:
                return
            self._marker(marker, out)

    def _body(self, text: str, out: list[Piece]) -> None:
        if self._target == "call":
            if text:
                _add(out, Piece("call", text, self._call))
        elif self._target == "reasoning":
            _add(out, Piece("reasoning", text))
        else:
            self._content(text, out)

    def _marker(self, marker: str, out: list[Piece]) -> None:
        if marker == _START:  # a new message (the one open, if any, ends without its end marker)
            self._state, self._header = "header", ""
        elif marker == _CHANNEL:
            if self._state != "header":
                self._state, self._header = "header", ""
            self._header += " "
        elif marker == _MESSAGE:
            if self._state == "header":
                self._open(out)
            elif self._state == "out":
                self._state, self._target = "body", "content"  # a message without a header
        elif marker == _CONSTRAIN:
            if self._state == "header":
                self._header += " "  # the content type follows; it does not change where the text goes
        else:  # <|end|>, <|call|>, <|return|>: the message (or a header never completed) ends
            self._state = "out"

    def _open(self, out: list[Piece]) -> None:
        """A header is complete (``<|message|>``): decide where the message's text goes."""
        words = self._header.split()
        recipient = next((w[3:] for w in words if w.startswith("to=")), None)
        channels = [w for w in words if not w.startswith("to=")]
        self._state = "body"
        if recipient is not None and recipient != "assistant":
            name = recipient[len("functions."):] if recipient.startswith("functions.") else recipient
            if self.names is not None and name in self.names:
                self._call = self._new_call()
                self._target = "call"
                _add(out, Piece("call", "", self._call, _call_id(), name))
                return
            self._target = "content"  # a call that cannot be returned as one keeps its text
            return
        self._target = "reasoning" if "analysis" in channels else "content"


# ---------------------------------------------------------------------------------------- GLM-4.5

_THINK, _THINK_END, _TOOL, _TOOL_END = "<think>", "</think>", "<tool_call>", "</tool_call>"
_KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_string_schema(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, list):
        return "string" in kind and set(kind) <= {"string", "null"}
    return kind == "string"


class Glm45Parser(_FormatParser):
    """GLM-4.5's ``<think>`` blocks and XML-ish tool calls (see the module docstring).
    ``tools`` are the request's tools (None: off); ``in_reasoning``: the prompt ends inside an open
    ``<think>``, so the answer begins with reasoning."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, inner: AnswerParser | None = None,
                 in_reasoning: bool = False) -> None:
        names = [t["function"]["name"] for t in tools] if tools is not None else None
        super().__init__(names, inner)
        self._props: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            params = t["function"].get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            self._props[t["function"]["name"]] = props if isinstance(props, dict) else {}
        self._buf = ""
        self._state: Literal["content", "reasoning", "call", "raw"] = "reasoning" if in_reasoning else "content"
        self._started = {"content": False, "reasoning": False}  # leading white space dropped until then
        self._held = {"content": "", "reasoning": ""}  # trailing white space, sent when more text follows
        self._call = -1
        self._name: str | None = None  # the open call's function; None: its name is not read yet
        self._pairs = 0

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        self._buf += text
        self._run(out, None)
        return out

    def finish(self, finish_reason: str | None) -> list[Piece]:
        out: list[Piece] = []
        if finish_reason in ("stop", "length"):
            self._run(out, finish_reason)
            self._finish_inner(finish_reason, out)
        return out

    # -------------------------------------------------------------- text outside calls
    def _text(self, kind: Literal["content", "reasoning"], text: str, out: list[Piece]) -> None:
        if not self._started[kind]:
            text = text.lstrip()
            if not text:
                return
            self._started[kind] = True
        text = self._held[kind] + text
        body = text.rstrip()
        self._held[kind] = text[len(body):]
        if kind == "reasoning":
            _add(out, Piece("reasoning", body))
        else:
            self._content(body, out)

    def _run(self, out: list[Piece], end: str | None) -> None:
        final = end is not None
        while True:
            if self._state == "call":
                if not self._read_call(out, end):
                    return
                continue
            markers = {"content": (_THINK, _THINK_END, _TOOL, _TOOL_END), "reasoning": (_THINK_END,),
                       "raw": (_TOOL_END,)}[self._state]
            text, marker, self._buf = _split(self._buf, markers, final)
            if self._state == "raw":
                self._text("content", text + (marker or ""), out)
                if marker is not None:
                    self._state = "content"
                    continue
                return
            self._text(self._state, text, out)
            if marker is None:
                return
            if marker == _THINK:
                self._state = "reasoning"
            elif marker == _THINK_END:
                self._state = "content"
            elif marker == _TOOL:
                self._state, self._name, self._pairs = "call", None, 0
            # a stray </tool_call> in content is dropped

    # -------------------------------------------------------------- calls
    def _read_call(self, out: list[Piece], end: str | None) -> bool:
        """Read as much of the open call as the buffer holds; False when it needs more text."""
        if self._name is None:
            return self._read_name(out, end)
        buf = self._buf.lstrip()
        if buf.startswith(_TOOL_END):
            self._buf = buf[len(_TOOL_END):]
            self._close_call(out)
            return True
        if buf.startswith(_KEY):
            return self._read_pair(buf, out, end)
        # text that is no part of the call's syntax is skipped up to the next tag the call may hold
        cut = [i for i in (buf.find(_KEY), buf.find(_TOOL_END)) if i >= 0]
        if cut:
            self._buf = buf[min(cut):]
            return True
        if end is None:
            keep = max((k for k in range(1, len(_TOOL_END)) if any(t.startswith(buf[-k:]) for t in (_KEY, _TOOL_END))),
                       default=0)
            self._buf = buf[-keep:] if keep else ""
            return False
        return self._end_call(out, end)

    def _read_pair(self, buf: str, out: list[Piece], end: str | None) -> bool:
        """``<arg_key>K</arg_key><arg_value>V</arg_value>`` at the start of ``buf``. Each tag is looked for
        before the call's end: a key or value that the call's ``</tool_call>`` cuts short ends there
        (the earliest whole tag decides, whatever pieces the text came in)."""
        t_end = buf.find(_TOOL_END)
        k_end = buf.find(_KEY_END)
        if k_end >= 0 and not 0 <= t_end < k_end:
            v_start = buf.find(_VALUE, k_end)
            if v_start >= 0 and not 0 <= t_end < v_start:
                key, v_from = buf[len(_KEY): k_end], v_start + len(_VALUE)
                v_end = buf.find(_VALUE_END, v_from)
                t_end = buf.find(_TOOL_END, v_from)
                stops = [i for i in (v_end, t_end) if i >= 0]
                if stops:
                    stop = min(stops)
                    self._pair(key, buf[v_from: stop], out)
                    self._buf = buf[stop + len(_VALUE_END):] if stop == v_end else buf[stop:]
                    return True
                if end is None:
                    return False
                if end == "stop":  # ended inside a value: that value as written
                    self._pair(key, buf[v_from:], out)
                return self._end_call(out, end)
        if t_end >= 0:  # a key without its value: dropped, the call ends
            self._buf = buf[t_end:]
            return True
        return False if end is None else self._end_call(out, end)

    def _end_call(self, out: list[Piece], end: str) -> bool:
        """The answer ended inside the open call: closed when it stopped, left as written when cut."""
        self._buf = ""
        if end == "stop":
            self._close_call(out)
        return False

    def _read_name(self, out: list[Piece], end: str | None) -> bool:
        buf = self._buf
        lead = len(buf) - len(buf.lstrip())
        stops = [i for i in (buf.find("\n", lead), buf.find("<", lead)) if i >= 0]
        if not stops and end is None:
            return False
        stop = min(stops) if stops else len(buf)
        name = buf[lead:stop].strip()
        if not stops and end == "length":  # cut before the name is whole: no call
            self._buf, self._state = "", "content"
            return False
        if self.names is not None and name in self.names:
            self._name = name
            self._call = self._new_call()
            _add(out, Piece("call", "", self._call, _call_id(), name))
            self._buf = buf[stop:]
            return True
        # not a call of an offered function: its text is content, as the model wrote it
        self._state = "raw"
        self._text("content", _TOOL + buf[:stop], out)
        self._buf = buf[stop:]
        return True

    def _value(self, key: str, raw: str) -> Any:
        if _is_string_schema(self._props.get(self._name or "", {}).get(key)):
            return raw
        try:
            return json.loads(raw, parse_constant=_no_constant)
        except ValueError:
            return raw

    def _pair(self, key: str, raw: str, out: list[Piece]) -> None:
        key = key.strip()
        piece = ("{" if self._pairs == 0 else ",") + json.dumps(key, ensure_ascii=False) + ":" + json.dumps(
            self._value(key, raw), ensure_ascii=False, separators=(",", ":"))
        self._pairs += 1
        _add(out, Piece("call", piece, self._call))

    def _close_call(self, out: list[Piece]) -> None:
        _add(out, Piece("call", "}" if self._pairs else "{}", self._call))
        self._state, self._name = "content", None


# ---------------------------------------------------------------------------------------- choosing


def make_parser(fmt: ChatFormat, tools: list[dict[str, Any]] | None, *, forced: bool = False,
                json_calls: bool = False, in_reasoning: bool = False) -> AnswerParser | None:
    """The parser of one chat answer in ``fmt``; None when there is nothing to read (the default
    format without tools: the answer is its content as generated).

    ``tools``: the functions the answer may call (None or empty: tools are off); ``json_calls``: a
    grammar shapes the answer as JSON calls (lanes/tools.py), so content is read for them;
    ``forced``: that grammar enforces a call; ``in_reasoning``: the prompt leaves a ``<think>`` open."""
    names = [t["function"]["name"] for t in tools] if tools else None
    inner = DefaultParser(names, forced) if json_calls and names else None
    if fmt == "harmony":
        return HarmonyParser(names, inner)
    if fmt == "glm45":
        return Glm45Parser(tools or None, inner, in_reasoning)
    return inner
