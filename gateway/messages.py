"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API over the chat path.

A Messages request is translated into a chat request (``system`` -> a system message, content
blocks -> message text, ``tool_use`` / ``tool_result`` -> assistant tool calls / tool messages,
``tools[].input_schema`` -> function tools, ``tool_choice`` auto / any / tool / none,
``stop_sequences`` -> ``stop``), which takes the chat path unchanged (gateway/proxy.py: auth,
limits, window precheck, memory, documents, dispatch, failover); the lane's chat answer is
translated back by :class:`MessagesRelay`, whole or as the Messages stream events
(``message_start`` ... ``message_stop``). Nothing here generates. A model's reasoning (the chat
answer's ``reasoning_content``, lanes/chat_parsers.py) is a ``thinking`` block first when the request
asks for thinking (``thinking: {"type": "enabled"}``), and left out otherwise; ``thinking`` blocks
of an assistant turn in the history become its ``reasoning_content``.

Errors on these paths use Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``
(:data:`messages_error_middleware` rewrites the gateway's OpenAI-shaped error answers, auth and
limits included). Keys are accepted as ``x-api-key`` as well as ``Authorization: Bearer``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from common.errors import Handler
from gateway.dispatch import LaneFailure, Passthrough
from gateway.errors import APIError
from gateway.proxy import generation
from gateway.state import GATEWAY, PRINCIPAL, TRACE, read_body
from gateway.window import count_prompt

__all__ = ["MessagesRelay", "add_routes", "anthropic_error", "messages_error_middleware", "to_chat"]

# chat fields of the same meaning and name (Strata's extras included)
_SAME = ("model", "temperature", "top_p", "top_k", "stream", "session_id", "collections",
         "additional_properties_default")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
                529: "overloaded_error"}
_STOP = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error" if status >= 500 else
                                                                 "invalid_request_error"), "message": message}}


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks joined (tool results and system prompts carry these)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: expected a string or a list of text blocks", "messages")
    texts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise _bad(f"{where}[{j}]: only text blocks are supported here, got {json.dumps(kind)[:40]}",
                       "messages")
        texts.append(b["text"])
    return "\n".join(texts)


def to_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Messages API ``system`` + ``messages`` -> chat messages."""
    out: list[dict[str, Any]] = []
    if system is not None:
        text = _text_blocks(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: expected a non-empty list of messages", "messages")
    known: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise _bad(f"{where}.role: expected 'user' or 'assistant', got {json.dumps(role)[:40]}", "messages")
        assert isinstance(m, dict)
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content: expected a string or a list of content blocks", "messages")
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text" and isinstance(b.get("text"), str):
                texts.append(b["text"])
            elif kind == "tool_use" and role == "assistant":
                tid, name, args = b.get("id"), b.get("name"), b.get("input", {})
                if not (isinstance(tid, str) and tid and isinstance(name, str) and name and isinstance(args, dict)):
                    raise _bad(f"{at}: a tool_use block needs string id and name and an object input", "messages")
                calls.append({"id": tid, "type": "function", "function": {
                    "name": name, "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}})
                known.add(tid)
            elif kind == "tool_result" and role == "user":
                tid = b.get("tool_use_id")
                if not isinstance(tid, str) or tid not in known:
                    raise _bad(f"{at}: tool_result for tool_use_id {json.dumps(tid)[:60]}, which no earlier "
                               "assistant tool_use block has", "messages")
                text = _text_blocks(b.get("content", ""), f"{at}.content")
                if b.get("is_error") is True:
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": tid, "content": text})
            elif kind == "thinking" and role == "assistant" and isinstance(b.get("thinking"), str):
                thoughts.append(b["thinking"])  # the turn's reasoning, for templates that read it
            elif kind in ("thinking", "redacted_thinking"):
                continue  # redacted (another server's): not an error, nothing to read
            elif kind in ("image", "document", "search_result", "server_tool_use", "web_search_tool_result"):
                raise _bad(f"{at}: {kind} blocks are not supported by this server (text and tools only)",
                           "messages")
            else:
                raise _bad(f"{at}: unknown or misplaced content block type {json.dumps(kind)[:40]} for role "
                           f"{role}", "messages")
        out.extend(results)  # tool results answer the previous turn's calls: they come first
        if calls:
            out.append({"role": "assistant", "content": "\n".join(texts) or None, "tool_calls": calls})
        elif texts or thoughts or not results:
            out.append({"role": role, "content": "\n".join(texts)})
        if thoughts and out and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = "\n".join(thoughts)
    if messages[-1].get("role") == "assistant":
        # a prefill asks to continue the assistant's own text; the chat path always starts a new turn, so the
        # answer would not continue it: refused rather than answered differently than asked
        raise _bad("a last message with role 'assistant' (prefill) is not supported by this server", "messages")
    return out


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("tools: expected a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            kind = t.get("type") if isinstance(t, dict) else None
            raise _bad(f"tools[{i}]: only custom tools ({{name, description, input_schema}}) are supported by this "
                       f"server, got type {json.dumps(kind)[:40]}", "tools")
        fn: dict[str, Any] = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise _bad("tool_choice: expected {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}", "tool_choice")
    assert isinstance(choice, dict)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _bad("tool_choice: type 'tool' needs a name", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def to_chat(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """A Messages request -> the chat request (``counting``: count_tokens, no max_tokens needed)."""
    chat: dict[str, Any] = {k: body[k] for k in _SAME if k in body}
    chat["messages"] = to_messages(body.get("system"), body.get("messages"))
    if not counting:
        mt = body.get("max_tokens")
        if mt is None:
            raise _bad("max_tokens: field required", "max_tokens")
        chat["max_tokens"] = mt
        stops = body.get("stop_sequences")
        if stops is not None:
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise _bad("stop_sequences: expected a list of strings", "stop_sequences")
            chat["stop"] = stops
        meta = body.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("user_id"), str):
            chat["user"] = meta["user_id"]
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    return chat


def _close_json(text: str) -> Any:
    """The object a cut JSON text begins (strings and brackets closed), else {}."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    stack, in_str, esc = [], False, False
    for ch in text:
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]" and stack:
            stack.pop()
    body = text + ('"' if in_str else "")
    for trim in (body, body.rstrip(", "), body.rstrip(", ") + " null"):
        try:
            value = json.loads(trim + "".join(reversed(stack)))
            return value if isinstance(value, dict) else {}
        except ValueError:
            continue
    return {}


class MessagesRelay:
    """The lane's chat answer as a Messages API answer (whole, or as the Messages stream events)."""

    def __init__(self, body: dict[str, Any], trace: Any) -> None:
        self.id = "msg_" + uuid.uuid4().hex
        self.model = body.get("model") if isinstance(body.get("model"), str) else None
        thinking = body.get("thinking")
        # the model's reasoning as thinking blocks only when asked for, as the Messages API gives them
        self.thinking = isinstance(thinking, dict) and thinking.get("type") in ("enabled", "adaptive")
        self.trace = trace  # the precheck's prompt count gives message_start its input_tokens
        self.blocks: list[dict[str, Any]] = []
        self.open: int | None = None  # index of the block being streamed
        self.calls: dict[int, int] = {}  # chat tool-call index -> block index
        self.args: dict[int, str] = {}  # block index -> argument text so far
        self.finish: str | None = None
        self.stop_seq: str | None = None
        self.usage: dict[str, Any] = {}
        self.started = False
        self.ended = False

    def _usage(self, u: Any) -> dict[str, Any]:
        u = u if isinstance(u, dict) else {}
        p = u.get("prompt_tokens")
        p = int(p) if isinstance(p, int) else int(self.trace.prompt_tokens or 0)
        cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        return {"input_tokens": p - cached, "output_tokens": int(u.get("completion_tokens") or 0),
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}

    def _stop(self, finish: str | None, stop_reason: Any) -> tuple[str, str | None]:
        if finish == "stop" and isinstance(stop_reason, str):
            return "stop_sequence", stop_reason
        return _STOP.get(finish or "stop", "end_turn"), None

    def _message(self, content: list[dict[str, Any]], stop: str | None, seq: str | None,
                 usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model or "", "content": content,
                "stop_reason": stop, "stop_sequence": seq, "usage": usage}

    async def whole(self, data: dict[str, Any]) -> dict[str, Any]:
        ch = (data.get("choices") or [{}])[0]
        msg = ch.get("message") or {}
        self.model = self.model or data.get("model")
        content: list[dict[str, Any]] = []
        if self.thinking and msg.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": msg["reasoning_content"], "signature": ""})
        if msg.get("content"):
            content.append({"type": "text", "text": msg["content"]})
        for tc in msg.get("tool_calls") or []:
            content.append({"type": "tool_use", "id": tc["id"], "name": tc["function"]["name"],
                            "input": _close_json(tc["function"]["arguments"])})
        stop, seq = self._stop(ch.get("finish_reason"), ch.get("stop_reason"))
        out = self._message(content, stop, seq, self._usage(data.get("usage")))
        if data.get("citations") is not None:
            out["citations"] = data["citations"]  # Strata's documents extra, as on chat answers
        return out

    # ------------------------------------------------------------ streamed
    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return b"event: " + kind.encode() + b"\ndata: " + data.encode() + b"\n\n"

    def _start(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        usage = {**self._usage(None), "output_tokens": 0}
        return self._event("message_start", message=self._message([], None, None, usage))

    def _close_open(self) -> bytes:
        k, self.open = self.open, None
        return b"" if k is None else self._event("content_block_stop", index=k)

    async def chunk(self, obj: dict[str, Any]) -> bytes:
        out = self._start()
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        for ch in obj.get("choices") or []:
            if ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta") or {}
            if self.thinking and delta.get("reasoning_content"):
                if self.open is None or self.blocks[self.open]["type"] != "thinking":
                    out += self._close_open()
                    self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
                    self.open = len(self.blocks) - 1
                    out += self._event("content_block_start", index=self.open,
                                       content_block={"type": "thinking", "thinking": "", "signature": ""})
                out += self._event("content_block_delta", index=self.open,
                                   delta={"type": "thinking_delta", "thinking": delta["reasoning_content"]})
            if delta.get("content"):
                if self.open is None or self.blocks[self.open]["type"] != "text":
                    out += self._close_open()
                    self.blocks.append({"type": "text", "text": ""})
                    self.open = len(self.blocks) - 1
                    out += self._event("content_block_start", index=self.open, content_block={"type": "text",
                                                                                              "text": ""})
                out += self._event("content_block_delta", index=self.open,
                                   delta={"type": "text_delta", "text": delta["content"]})
            for tc in delta.get("tool_calls") or []:
                k = tc.get("index", 0)
                fn = tc.get("function") or {}
                if k not in self.calls:
                    out += self._close_open()
                    block = {"type": "tool_use", "id": tc.get("id") or "call_" + uuid.uuid4().hex[:24],
                             "name": fn.get("name") or "", "input": {}}
                    self.blocks.append(block)
                    self.open = self.calls[k] = len(self.blocks) - 1
                    out += self._event("content_block_start", index=self.open, content_block=block)
                piece = fn.get("arguments") or ""
                if piece:
                    out += self._event("content_block_delta", index=self.calls[k],
                                       delta={"type": "input_json_delta", "partial_json": piece})
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
                self.stop_seq = ch.get("stop_reason") if isinstance(ch.get("stop_reason"), str) else None
        return out

    async def end(self) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        stop, seq = self._stop(self.finish, self.stop_seq)
        usage = self._usage(self.usage)
        return (self._start() + self._close_open()
                + self._event("message_delta", delta={"stop_reason": stop, "stop_sequence": seq},
                              usage={"output_tokens": usage["output_tokens"]})
                + self._event("message_stop"))

    async def error(self, body: dict[str, Any]) -> bytes:
        if self.ended:
            return b""
        self.ended = True
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        kind = "overloaded_error" if err.get("code") in ("server_overloaded", "no_lane_available") else "api_error"
        return self._event("error", error={"type": kind, "message": str(err.get("message") or "the request failed")})


# ---------------------------------------------------------------------------------------- handlers


async def create_message(request: web.Request) -> web.StreamResponse:
    trace = request[TRACE]

    async def prepare(body: dict[str, Any]) -> tuple[dict[str, Any], MessagesRelay]:
        return to_chat(body), MessagesRelay(body, trace)

    return await generation(request, "chat", prepare)


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """The prompt's tokens as the lane counts them (tools included); counted against the key's rpm and
    concurrency like a generation request, since it costs a lane's tokenizer."""
    gw = request.app[GATEWAY]
    ticket = gw.limiter.admit(request[PRINCIPAL])
    try:
        return await _count_tokens(request)
    finally:
        gw.limiter.release(ticket)


async def _count_tokens(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    body = await json_body_dict(request)
    chat = to_chat(body, counting=True)
    model = chat.get("model") if isinstance(chat.get("model"), str) else None
    lane = gw.dispatcher.choose(None, set(), model)
    if lane is None and model is not None and gw.dispatcher.routable() and not gw.dispatcher.routable(model):
        raise APIError(404, f"the model {model!r} does not exist or no lane serving it is ready",
                       code="model_not_found", param="model")
    if lane is None or gw.session is None:
        raise APIError(503, "no lane is ready to count tokens; retry shortly", code="no_lane_available",
                       retry_after=1)
    try:
        counts, _ = await count_prompt(gw.session, lane, chat, "chat", gw.config.first_token_timeout_s,
                                       request[TRACE].id)
    except Passthrough as p:
        return web.Response(status=p.status, body=p.body, content_type="application/json")
    except LaneFailure as f:
        raise APIError(503, f"counting failed: {f.message}", code="upstream_unavailable", retry_after=1) from None
    return web.json_response({"input_tokens": counts[0]})


async def json_body_dict(request: web.Request) -> dict[str, Any]:
    body = await read_body(request)  # size, deadline and valid Unicode, as every JSON route
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return body


@web.middleware
async def messages_error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """On /v1/messages*: an error answer in OpenAI's shape (the gateway's own, a lane's 4xx passed through)
    is rewritten into Anthropic's; a stream already started speaks its errors through the relay."""
    resp = await handler(request)
    if not request.path.startswith("/v1/messages") or resp.status < 400 or not isinstance(resp, web.Response):
        return resp
    try:
        err = json.loads(resp.body)["error"]  # type: ignore[arg-type]
        message = str(err.get("message"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return resp
    out = web.json_response(anthropic_error(resp.status, message), status=resp.status)
    for h in ("Retry-After", "X-Request-Id", "Allow"):
        if h in resp.headers:
            out.headers[h] = resp.headers[h]
    return out


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)

