"""``/v1/responses``: OpenAI's Responses API over the chat path.

A request is translated into a chat request (``input`` items -> messages, ``instructions`` -> a
system message, ``text.format`` -> ``response_format``, function tools -> chat tools,
``max_output_tokens`` -> ``max_tokens``), which then goes the way every chat request goes
(gateway/proxy.py: auth, limits, window precheck, memory, documents, dispatch, failover); the
lane's chat answer is translated back by :class:`ResponsesRelay`, whole or event by event
(``response.created`` ... ``response.completed``). One engine path for sampling, grammars and
stops; nothing here generates. A model's reasoning (the chat answer's ``reasoning_content``, see
lanes/chat_parsers.py) is a ``reasoning`` output item with ``reasoning_text`` content, and a
``reasoning`` input item gives its text back to the assistant turn after it.

``previous_response_id`` continues a stored response of the same key (gateway/responses_store.py):
its conversation (inputs and outputs of the whole chain) comes before the new input.
``store: false`` keeps nothing. Errors keep OpenAI's shape (the Responses API uses the same).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from gateway.errors import APIError
from gateway.proxy import generation
from gateway.responses_store import ResponseStore
from gateway.state import GATEWAY, PRINCIPAL

__all__ = ["RESPONSES", "ResponsesRelay", "add_routes", "responses_context", "to_chat"]

log = logging.getLogger("strata.gateway")

RESPONSES = web.AppKey("strata_responses", ResponseStore)
_PURGE_EVERY_S = 3600.0

# Responses fields with a chat counterpart of the same meaning and name
_SAME = ("model", "temperature", "top_p", "parallel_tool_calls", "user", "stream", "session_id", "collections",
         "additional_properties_default")
_UNSUPPORTED = {"background": "background responses", "conversation": "conversation objects",
                "prompt": "prompt templates"}


def _bad(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex


def _text_of(content: Any, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string; other parts are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise _bad(f"{where}.content[{j}]: {kind} is not supported by this server (text only)", "input",
                       "unsupported_content")
        else:
            raise _bad(f"{where}.content[{j}]: unknown content part type {json.dumps(kind)[:40]}", "input")
    return "\n".join(texts)


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {tc.get("id") for m in messages for tc in (m.get("tool_calls") or []) if isinstance(tc, dict)}


def input_messages(items: Any, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) -> chat messages; ``history`` (the chain before it) is
    where tool outputs may find their calls."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("invalid input: expected a string or a non-empty list of input items", "input")
    out: list[dict[str, Any]] = []
    known = _call_ids(history)
    reasoning: list[str] = []  # reasoning items' text, for the assistant turn that follows them
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}: unknown role {json.dumps(role)[:40]} (expected user, assistant, system or "
                           "developer)", "input", "invalid_role")
            out.append({"role": role, "content": _text_of(item.get("content"), where)})
            if role == "assistant" and reasoning:
                out[-1]["reasoning_content"], reasoning = "\n".join(reasoning), []
        elif kind == "function_call":
            call_id, name, args = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and call_id and isinstance(name, str) and name and isinstance(args, str)):
                raise _bad(f"{where}: a function_call needs string call_id, name and arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # consecutive calls are one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = "\n".join(reasoning), []
            known.add(call_id)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or call_id not in known:
                raise _bad(f"{where}: no function_call with call_id {json.dumps(call_id)[:60]} precedes this "
                           "function_call_output (in input or the previous response)", "input",
                           "tool_output_without_call")
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text_of(output, where)})
        elif kind == "reasoning":
            # the model's reasoning before the turn that follows (templates of reasoning models read it);
            # only its text is used, an encrypted one (another server's) is not an error
            parts = item.get("content") if isinstance(item.get("content"), list) else []
            reasoning += [p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
                          and isinstance(p.get("text"), str)]
        else:
            raise _bad(f"{where}: unknown or unsupported input item type {json.dumps(kind)[:40]} (supported: "
                       "message, function_call, function_call_output)", "input", "unsupported_item_type")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("invalid tools: expected a list", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}]: tool type {json.dumps(kind)[:40]} is not supported by this server (function "
                       "tools only)", "tools", "unsupported_tool_type")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad(f"invalid text.format type {json.dumps(kind)[:40]}: expected text, json_object or json_schema",
               "text")


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A Responses request -> (the chat request, the new input as chat messages for the stored chain)."""
    for name, what in _UNSUPPORTED.items():
        if body.get(name):
            raise _bad(f"{what} ({name}) are not supported by this server", name, "unsupported_parameter")
    if "input" not in body:
        raise _bad("missing required parameter 'input'", "input")
    new = input_messages(body["input"], history)
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise _bad("invalid truncation: expected 'auto' or 'disabled'", "truncation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise _bad("invalid instructions: expected a string", "instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + new
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = body["tool_choice"]
    rf = _format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    return chat, new


def _usage(u: Any) -> dict[str, Any]:
    u = u if isinstance(u, dict) else {}
    p, g = int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"input_tokens": p, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": g,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + g}


class ResponsesRelay:
    """The lane's chat answer as a Responses API answer (whole, or as the Responses stream events)."""

    def __init__(self, body: dict[str, Any], history: list[dict[str, Any]], new: list[dict[str, Any]],
                 store: ResponseStore | None, key_id: int) -> None:
        self.id = _new_id("resp_")
        self.created = int(time.time())
        self.body = body
        self.history = history + new  # the chain so far plus this request's input (no instructions)
        self.store = store if body.get("store", True) is not False else None
        self.key_id = key_id
        self.model = body.get("model") if isinstance(body.get("model"), str) else None
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the output item being streamed
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
        self.finish: str | None = None
        self.usage: dict[str, Any] = _usage(None)
        self.citations: Any = None
        self.started = False
        self.ended = False

    # ------------------------------------------------------------ the response object
    def response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {}
        def given(name: str, default: Any) -> Any:  # null is "not given": the default is echoed
            return b[name] if b.get(name) is not None else default

        r: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"), "max_output_tokens": b.get("max_output_tokens"),
            "model": self.model or "", "output": self.output,
            "parallel_tool_calls": given("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"), "reasoning": {"effort": None, "summary": None},
            "store": self.store is not None, "temperature": given("temperature", 1.0),
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": given("tool_choice", "auto"),
            # echoed as OpenAI does: strict is always said (true unless the request said false)
            "tools": [{**t, "strict": t.get("strict") is not False, "parameters": t.get("parameters")}
                      for t in b.get("tools") or []],
            "top_p": given("top_p", 1.0), "truncation": given("truncation", "disabled"),
            "metadata": given("metadata", {}),
        }
        if status in ("completed", "incomplete"):
            r["usage"] = self.usage
        if isinstance(b.get("user"), str):
            r["user"] = b["user"]
        if self.citations is not None:
            r["citations"] = self.citations  # Strata's documents extra, as on chat answers
        return r

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": _new_id("rs_"), "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": text}]}

    def _message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": _new_id("msg_"), "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    async def _save(self) -> None:
        """Store the response and the conversation a follow-up continues (before the client hears it is done)."""
        if self.store is None:
            return
        reply: dict[str, Any] = {"role": "assistant", "content": None}
        texts = [p["text"] for it in self.output if it["type"] == "message" for p in it["content"]]
        calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
                 for it in self.output if it["type"] == "function_call"]
        reply["content"] = "".join(texts) if texts else None
        thoughts = [p["text"] for it in self.output if it["type"] == "reasoning" for p in it["content"]]
        if thoughts:
            reply["reasoning_content"] = "".join(thoughts)
        if calls:
            reply["tool_calls"] = calls
        await asyncio.to_thread(self.store.put, self.key_id, self.response(self._status()), [*self.history, reply])

    # ------------------------------------------------------------ whole
    async def whole(self, data: dict[str, Any]) -> dict[str, Any]:
        ch = (data.get("choices") or [{}])[0]
        msg = ch.get("message") or {}
        self.finish = ch.get("finish_reason")
        self.model = self.model or data.get("model")
        status = self._status()
        item_status = "incomplete" if status == "incomplete" else "completed"
        if msg.get("reasoning_content"):
            self.output.append(self._reasoning_item(msg["reasoning_content"], item_status))
        if msg.get("content"):
            self.output.append(self._message_item(msg["content"], item_status))
        for tc in msg.get("tool_calls") or []:
            self.output.append({"type": "function_call", "id": _new_id("fc_"), "call_id": tc["id"],
                                "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                                "status": item_status})
        self.usage = _usage(data.get("usage"))
        self.citations = data.get("citations")
        await self._save()
        return self.response(status)

    # ------------------------------------------------------------ streamed
    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        r = self.response("in_progress")
        return self._event("response.created", response=r) + self._event("response.in_progress", response=r)

    def _close_open(self) -> bytes:
        it, self.open = self.open, None
        if it is None:
            return b""
        status = "incomplete" if self.finish == "length" else "completed"
        idx = self.output.index(it)
        it["status"] = status
        if it["type"] == "reasoning":
            part = it["content"][0]
            return (self._event("response.reasoning_text.done", item_id=it["id"], output_index=idx, content_index=0,
                                text=part["text"])
                    + self._event("response.output_item.done", output_index=idx, item=it))
        if it["type"] == "message":
            part = it["content"][0]
            return (self._event("response.output_text.done", item_id=it["id"], output_index=idx, content_index=0,
                                text=part["text"], logprobs=[])
                    + self._event("response.content_part.done", item_id=it["id"], output_index=idx,
                                  content_index=0, part=part)
                    + self._event("response.output_item.done", output_index=idx, item=it))
        return (self._event("response.function_call_arguments.done", item_id=it["id"], output_index=idx,
                            name=it["name"], arguments=it["arguments"])
                + self._event("response.output_item.done", output_index=idx, item=it))

    async def chunk(self, obj: dict[str, Any]) -> bytes:
        out = self._start()
        self.model = self.model or obj.get("model")
        if isinstance(obj.get("usage"), dict):
            self.usage = _usage(obj["usage"])
        if obj.get("citations") is not None:
            self.citations = obj["citations"]
        for ch in obj.get("choices") or []:
            if ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    out += self._close_open()
                    it = self._reasoning_item("", "in_progress")
                    self.output.append(it)
                    self.open = it
                    out += self._event("response.output_item.added", output_index=len(self.output) - 1,
                                       item={**it, "content": []})
                it = self.open
                it["content"][0]["text"] += delta["reasoning_content"]
                out += self._event("response.reasoning_text.delta", item_id=it["id"],
                                   output_index=len(self.output) - 1, content_index=0,
                                   delta=delta["reasoning_content"])
            if delta.get("content"):
                if self.open is None or self.open["type"] != "message":
                    out += self._close_open()
                    it = self._message_item("", "in_progress")
                    self.output.append(it)
                    self.open = it
                    idx = len(self.output) - 1
                    out += self._event("response.output_item.added", output_index=idx,
                                       item={**it, "content": []})
                    out += self._event("response.content_part.added", item_id=it["id"], output_index=idx,
                                       content_index=0, part={**it["content"][0]})
                it = self.open
                it["content"][0]["text"] += delta["content"]
                out += self._event("response.output_text.delta", item_id=it["id"], output_index=len(self.output) - 1,
                                   content_index=0, delta=delta["content"], logprobs=[])
            for tc in delta.get("tool_calls") or []:
                k = tc.get("index", 0)
                fn = tc.get("function") or {}
                if k not in self.calls:
                    out += self._close_open()
                    it = {"type": "function_call", "id": _new_id("fc_"), "call_id": tc.get("id") or _new_id("call_"),
                          "name": fn.get("name") or "", "arguments": "", "status": "in_progress"}
                    self.calls[k] = it
                    self.output.append(it)
                    self.open = it
                    out += self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(it))
                it = self.calls[k]
                piece = fn.get("arguments") or ""
                if piece:
                    it["arguments"] += piece
                    out += self._event("response.function_call_arguments.delta", item_id=it["id"],
                                       output_index=self.output.index(it), delta=piece)
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
        return out

    async def end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        out = self._start() + self._close_open()
        await self._save()
        status = self._status()
        return out + self._event("response.completed" if status == "completed" else "response.incomplete",
                                 response=self.response(status))

    async def error(self, body: dict[str, Any]) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        code = str(err.get("code") or err.get("type") or "server_error")
        message = str(err.get("message") or "the response failed")
        # the failed response's code is one of the spec's few; the error event keeps ours
        failed = {"code": "rate_limit_exceeded" if code == "rate_limit_error" else "server_error", "message": message}
        return (self._start() + self._event("error", code=code, message=message, param=err.get("param"))
                + self._event("response.failed", response=self.response("failed", failed)))


# ---------------------------------------------------------------------------------------- handlers


def _store(request: web.Request) -> ResponseStore:
    return request.app[RESPONSES]


async def create_response(request: web.Request) -> web.StreamResponse:
    key = request[PRINCIPAL]

    async def prepare(body: dict[str, Any]) -> tuple[dict[str, Any], ResponsesRelay]:
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str) or not prev:
                raise _bad("invalid previous_response_id: expected a string", "previous_response_id")
            stored = await asyncio.to_thread(_store(request).get, key.id, prev)
            if stored is None:
                raise APIError(404, f"previous response with id {prev!r} not found", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored.history
        store = body.get("store")
        if store is not None and not isinstance(store, bool):
            raise _bad("invalid store: expected true or false", "store")
        meta = body.get("metadata")
        if meta is not None and (not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values())):
            raise _bad("invalid metadata: expected an object of string values", "metadata")
        chat, new = to_chat(body, history)
        return chat, ResponsesRelay(body, history, new, _store(request), key.id)

    try:
        resp = await generation(request, "chat", prepare)
    except APIError as e:  # the chat path's errors name chat's parameters: name this API's
        e.message, e.param = _rename(e.message, e.param)
        raise
    if isinstance(resp, web.Response) and resp.status >= 400 and not resp.prepared and resp.body:
        try:  # a lane's 4xx, passed through
            body = json.loads(resp.body)  # type: ignore[arg-type]
            err = body["error"]
            err["message"], err["param"] = _rename(str(err.get("message")), err.get("param"))
        except (ValueError, KeyError, TypeError):
            return resp
        resp.body = json.dumps(body).encode()
    return resp


_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input",
           "response_format": "text"}


def _rename(message: str, param: Any) -> tuple[str, Any]:
    """A chat-path error's message and param in this API's words (``max_tokens`` -> ``max_output_tokens``, ...)."""
    if param in _PARAMS:
        return message.replace(param, _PARAMS[param]), _PARAMS[param]
    return message, param


def _response_id(request: web.Request) -> str:
    return request.match_info["response_id"]


async def get_response(request: web.Request) -> web.Response:
    rid = _response_id(request)
    stored = await asyncio.to_thread(_store(request).get, request[PRINCIPAL].id, rid)
    if stored is None:
        raise APIError(404, f"response with id {rid!r} not found", param="response_id", code="response_not_found")
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    rid = _response_id(request)
    if not await asyncio.to_thread(_store(request).delete, request[PRINCIPAL].id, rid):
        raise APIError(404, f"response with id {rid!r} not found", param="response_id", code="response_not_found")
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def input_items(request: web.Request) -> web.Response:
    """The conversation a stored response answered, as Responses input items (newest first, as OpenAI lists)."""
    rid = _response_id(request)
    stored = await asyncio.to_thread(_store(request).get, request[PRINCIPAL].id, rid)
    if stored is None:
        raise APIError(404, f"response with id {rid!r} not found", param="response_id", code="response_not_found")
    items: list[dict[str, Any]] = []
    for m in stored.history[:-1]:  # the last entry is the answer itself
        if m["role"] == "assistant" and m.get("reasoning_content"):
            items.append({"type": "reasoning", "id": _new_id("rs_"), "summary": [], "status": "completed",
                          "content": [{"type": "reasoning_text", "text": m["reasoning_content"]}]})
        for tc in m.get("tool_calls") or []:
            items.append({"type": "function_call", "id": _new_id("fc_"), "call_id": tc["id"],
                          "name": tc["function"]["name"], "arguments": tc["function"]["arguments"],
                          "status": "completed"})
        if m["role"] == "tool":
            items.append({"type": "function_call_output", "id": _new_id("fco_"), "call_id": m["tool_call_id"],
                          "output": m["content"], "status": "completed"})
        elif m.get("content") is not None:
            kind = "output_text" if m["role"] == "assistant" else "input_text"
            items.append({"type": "message", "id": _new_id("msg_"), "role": m["role"], "status": "completed",
                          "content": [{"type": kind, "text": m["content"]}]})
    items.reverse()
    return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                              "last_id": items[-1]["id"] if items else None, "has_more": False})


async def _purge(store: ResponseStore) -> None:
    while True:
        try:
            n = await asyncio.to_thread(store.purge)
            if n:
                log.info("responses retention: deleted %d stored response(s)", n)
        except Exception as e:
            log.error("responses retention failed: %s: %s", type(e).__name__, e)
        await asyncio.sleep(_PURGE_EVERY_S)


async def responses_context(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx (after the gateway's own: it needs the database): the store and its retention task."""
    gw = app[GATEWAY]
    assert gw.db is not None
    store = ResponseStore(gw.db, gw.config.responses_retention_days)
    app[RESPONSES] = store
    task = asyncio.create_task(_purge(store), name="gateway-responses-retention")
    yield
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass


def add_routes(app: web.Application) -> None:
    app.cleanup_ctx.append(responses_context)
    r = app.router
    r.add_post("/v1/responses", create_response)
    r.add_get("/v1/responses/{response_id}", get_response)
    r.add_delete("/v1/responses/{response_id}", delete_response)
    r.add_get("/v1/responses/{response_id}/input_items", input_items)

