"""Generation requests through the gateway: limits, window precheck, dispatch, failover, streaming.

The life of one request (docs/gateway.md tells it in full):

1. the key's rpm / concurrency slot (429), the body (413 / 400), the extras stripped;
2. a lane is chosen; its tokenizer counts the prompt (loaded in the gateway: on the event loop for a short
   one, gateway/window.py ``precheck_inline``; else the lane's ``/tokenize``); ``max_tokens`` (the default when
   the request names none) is capped and fitted to the lane's window or the request is
   refused (400, the lane never sees it); the key's tpm reserves the prompt plus
   ``max_tokens`` per choice (429), the unused part is refunded when the request ends;
3. the request goes to the lane with ``X-Request-Id``. A connection error, timeout, 5xx or
   an error event *before the first token reached the client* retries once on another lane;
   a 4xx is returned unchanged; after the first token a failure becomes an SSE error event
   and ``[DONE]``;
4. streams are forwarded event by event as they arrive (``: ping`` comments while the lane
   is silent); a client that goes away closes the upstream connection, which makes the lane
   abort the engine request at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import aiohttp
from aiohttp import web

from common.http import SSE_HEADERS, client_gone
from gateway.dispatch import LaneFailure, LaneRuntime, Passthrough, check_lane_status, connection_problem
from gateway.documents.api import get_rag
from gateway.documents.chat import RagContext, fit_passages, parse_collections
from gateway.documents.chat import citations as rag_citations
from gateway.documents.chat import prepare as rag_prepare
from gateway.errors import APIError, error_body
from gateway.keys import KeyRecord
from gateway.limits import Reservation
from gateway.memory_chat import MemoryContext, fit_memory, is_memory_session, session_ref
from gateway.memory_chat import prepare as memory_prepare
from gateway.sessions import get_memory
from gateway.state import GATEWAY, PRINCIPAL, TRACE, Gateway, Trace, check_text, read_body
from gateway.store import IN_PROGRESS
from gateway.window import Clamp, WindowPlan, max_tokens_field, precheck, precheck_inline

__all__ = ["Relay", "chat_completions", "completions", "generation"]

log = logging.getLogger("strata.gateway")

Kind = Literal["chat", "completion"]
T = TypeVar("T")

POLL_S = 0.25  # how often a waiting handler looks at its client's connection
_NULL_USAGE = b',"usage":null}'  # the last member of a lane's stream chunk while the gateway asks for usage
_FRAMING = 4096  # bytes a write may add beyond its data: the status line and headers with the first, chunk framing
_EXTRAS = ("session_id", "collections", "citations")  # additive fields the lanes do not know
_PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class ClientGone(Exception):
    """The client closed its connection; the upstream request is dropped with it."""


class Relay(Protocol):
    """Speaks another API to the client over the chat path (gateway/responses.py, gateway/messages.py): the
    request was translated into a chat request; the lane's answer is translated back here."""

    async def whole(self, data: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat.completion -> that API's response body."""
        ...

    async def chunk(self, obj: dict[str, Any]) -> bytes:
        """One chat.completion.chunk (or the usage / citations chunk) -> that API's stream events."""
        ...

    async def end(self) -> bytes:
        """The stream's last events, in place of ``data: [DONE]``."""
        ...

    async def error(self, body: dict[str, Any]) -> bytes:
        """An OpenAI-shaped error body -> that API's error event(s) ending the stream."""
        ...


Prepare = Callable[[dict[str, Any]], Awaitable[tuple[dict[str, Any], Relay]]]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


async def _race(request: web.Request, aw: Awaitable[T], timeout: float) -> T:
    """Await ``aw`` unless the client leaves (ClientGone) or ``timeout`` passes (TimeoutError); either way
    ``aw`` is cancelled, which closes its upstream connection."""
    task = asyncio.ensure_future(aw)
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            done, _ = await asyncio.wait({task}, timeout=min(POLL_S, left))
            if done:
                return task.result()
            if client_gone(request):
                raise ClientGone
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_END_WAIT_S = 1.0  # how long a finished stream's upstream may take to send its body's end (the chunked terminator)


async def body_ended(up: aiohttp.ClientResponse, timeout: float = _END_WAIT_S) -> bool:
    """Whether the upstream body reached its end, waiting up to ``timeout`` for it: a stream whose ``[DONE]`` was
    read may still lack its terminator (an upstream that writes them apart sends two segments). Released before
    the end, aiohttp closes the connection, and the next request pays a new one (and the lane a closed one); read
    to the end, it goes back to the pool. Called after the client has its whole answer, so it costs the client
    nothing."""
    if up.content.at_eof():
        return True
    try:
        async with asyncio.timeout(timeout):
            while await up.content.readany():  # what a lane sends after [DONE] is dropped
                pass
    except (TimeoutError, aiohttp.ClientError, OSError):
        return False
    return up.content.at_eof()


def _error_code(raw: bytes) -> str | None:
    """The ``code`` (else ``type``) of an OpenAI-shaped error body, for logs and the request log."""
    try:
        err = json.loads(raw)["error"]
        return str(err.get("code") or err.get("type"))[:64]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def _record_usage(trace: Trace, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    for name in ("prompt_tokens", "completion_tokens"):
        if isinstance(usage.get(name), int):
            setattr(trace, name, usage[name])
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        trace.cached_tokens = details["cached_tokens"]


class _SSEParser:
    """Splits an event stream into the data of each event (comments and blank events dropped)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk.replace(b"\r\n", b"\n")
        events = []
        while (end := self._buf.find(b"\n\n")) >= 0:
            block, self._buf = self._buf[:end], self._buf[end + 2:]
            data = [line[5:].removeprefix(b" ") for line in block.split(b"\n") if line.startswith(b"data:")]
            if data:
                events.append(b"\n".join(data).decode("utf-8", "replace"))
        return events


class _EventStream(web.StreamResponse):
    """The client's event stream. Its status line and headers leave with the first event, in one write, not
    in a send of their own just before it: one wake-up of the client instead of two at the moment the first
    token is relayed (aiohttp's own ``Response`` buffers them the same way)."""

    _send_headers_immediately = False


class _Call:
    """One client request across its (at most two) lane attempts."""

    def __init__(self, request: web.Request, gw: Gateway, trace: Trace, key: KeyRecord, kind: Kind,
                 body: dict[str, Any], affinity: str | None, client_usage: bool) -> None:
        self.request = request
        self.gw = gw
        self.trace = trace
        self.key = key
        self.kind = kind
        self.body = body
        self.affinity = affinity
        self.client_usage = client_usage
        self.stream = bool(body.get("stream"))
        caps = [c for c in (key.max_tokens, gw.config.max_tokens_cap) if c is not None]
        self.cap = min(caps) if caps else None
        self.default_max_tokens = key.default_max_tokens or gw.config.default_max_tokens
        n = body.get("n")
        self.n_choices = min(n, 64) if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
        self.reservation: Reservation | None = None  # the tokens held against the key's tpm
        self.resp: web.StreamResponse | None = None  # the client's stream once its 200 went out
        self.row_logged = False  # the stream's row is journaled as in progress (before its 200 goes out)
        self.first_sent = False  # a token reached the client: no failover any more
        self.last_write = trace.t0
        self.texts: dict[int, list[str]] | None = {} if key.log_prompts else None
        self.clamp: Clamp | None = None
        self.lane_broke = False  # the lane failed after the first token
        self.rag: RagContext | None = None  # retrieved passages (the `collections` field)
        self.memory: MemoryContext | None = None  # session memory (a `sess_...` session_id)
        self.relay: Relay | None = None  # another API spoken over this chat request

    # ------------------------------------------------------------ attempts
    async def run(self) -> web.StreamResponse:
        try:
            return await self._attempts()
        except ClientGone:
            self.trace.client_gone = True
            return self.resp or web.Response(status=499, reason="Client Closed Request")
        except APIError as e:
            if self.resp is None:
                raise
            await self._error_event(e.body(), e.code or e.type)  # the 200 is out: say it in the stream
            return self.resp
        finally:
            if self.clamp is not None:
                self.gw.metrics.clamped.labels(reason=self.clamp.reason).inc()
            if self.memory is not None and not self.memory.stored and self.first_sent:
                await self._remember(complete=False)  # cut by a disconnect or a lane failure: what was streamed

    async def _attempts(self) -> web.StreamResponse:
        disp, cfg, trace = self.gw.dispatcher, self.gw.config, self.trace
        model = self.body.get("model") if isinstance(self.body.get("model"), str) else None
        tried: set[str] = set()
        failure: LaneFailure | None = None
        for attempt in range(2):
            lane = disp.choose(self.affinity, tried, model)
            if lane is None:
                break
            if attempt:
                trace.retried = True
                assert failure is not None
                self.gw.metrics.retries.labels(lane=failure.lane).inc()
                log.warning("id=%s lane=%s failed before the first token (%s: %s); retrying on lane=%s", trace.id,
                            failure.lane, failure.kind, failure.detail, lane.name)
            tried.add(lane.name)
            trace.lane = lane.name
            trace.model = model or lane.model
            disp.begin(lane)
            try:
                plan = await self._precheck(lane)
                trace.mark("counted")
                if self.reservation is None:  # the prompt and all it may generate, refunded in part at the end
                    self.reservation = self.gw.limiter.reserve(
                        self.key, plan.prompt_tokens, plan.max_new_tokens * plan.n_prompts * self.n_choices)
                lane_body = dict(self.body)
                if self.memory is not None:
                    trace.memory = self.memory.header()
                    if self.key.log_prompts:  # the request log shows what the lane got: the composed prompt
                        trace.prompt_text = json.dumps(lane_body.get("messages"), ensure_ascii=False)
                if plan.max_tokens is not None:
                    lane_body[max_tokens_field(self.body, self.kind)] = plan.max_tokens
                self.clamp = plan.clamp
                trace.clamped_from = plan.clamp.original if plan.clamp else None
                trace.clamped_to = plan.clamp.new if plan.clamp else None
                if self.stream:
                    result = await self._stream(lane, lane_body)
                else:
                    result = await self._plain(lane, lane_body)
                if not self.lane_broke:
                    disp.succeeded(lane)
                return result
            except LaneFailure as f:
                disp.failed(lane, f.kind, f.detail)
                failure = f
            except Passthrough as p:
                disp.succeeded(lane)  # a 4xx is the lane working correctly
                return await self._passthrough(p)
            finally:
                disp.end(lane)
        if failure is None:
            if model is not None and disp.routable() and not disp.routable(model):
                raise APIError(404, f"the model {model!r} does not exist or no lane serving it is ready",
                               code="model_not_found", param="model")
            raise APIError(503, "no lane is ready to take this request; retry shortly", code="no_lane_available",
                           retry_after=max(1.0, cfg.health_interval_s))
        return await self._fail(failure)

    async def _precheck(self, lane: LaneRuntime) -> WindowPlan:
        cfg = self.gw.config
        try:
            plan = None
            if self.rag is None and self.memory is None:  # the common request: counted here, nothing awaited
                plan = precheck_inline(lane, self.body, self.kind, cap=self.cap, min_clamp=cfg.min_clamp_tokens,
                                       default=self.default_max_tokens)
            if plan is None:  # a long prompt, no local tokenizer, memory or documents: awaited, raced with the client
                check = precheck if self.rag is None else functools.partial(fit_passages, ctx=self.rag)
                if self.memory is not None:  # compose first: the precheck counts the composed prompt (+ passages)
                    check = functools.partial(fit_memory, mem=self.memory, rag=self.rag)
                plan = await _race(self.request, check(
                    self.gw.session, lane, self.body, self.kind, cap=self.cap, min_clamp=cfg.min_clamp_tokens,
                    timeout=cfg.first_token_timeout_s, request_id=self.trace.id, default=self.default_max_tokens),
                    cfg.first_token_timeout_s + 1)
        except TimeoutError:
            raise LaneFailure(lane.name, "timeout", "the window precheck timed out") from None
        except APIError as e:
            if e.code == "context_length_exceeded":
                self.gw.metrics.context_rejected.inc()
                self.trace.prompt_tokens = e.extra.get("n_prompt_tokens")
            raise
        self.trace.prompt_tokens = plan.prompt_tokens
        return plan

    def _headers(self, lane: LaneRuntime) -> dict[str, str]:
        h = {"X-Request-Id": self.trace.id, "X-Strata-Lane": lane.name}
        if self.clamp is not None:
            h["X-Strata-Max-Tokens-Clamped"] = self.clamp.header()
        if self.rag is not None:
            h["X-Strata-Rag-Passages"] = self.rag.header()  # used/retrieved: fewer when the window is short
        if self.memory is not None and self.memory.comp is not None:
            h["X-Strata-Memory"] = self.memory.header()
        return h

    def _reply_text(self) -> str:
        parts = (self.texts or {}).get(0) or []
        return "".join(parts)

    async def _remember(self, *, complete: bool) -> None:
        """Store the request's new message(s) and the reply (once); a failure is logged, never raised: the
        client's answer is already on its way."""
        mem = self.memory
        if mem is None or mem.stored:
            return
        mem.stored = True
        try:
            await mem.svc.remember(mem.loaded.session, mem.new_messages, self._reply_text(), complete=complete,
                                   reply_tokens=self.trace.completion_tokens, request_id=self.trace.id)
        except Exception as e:
            self.trace.error_type = self.trace.error_type or "memory_store_failed"
            log.error("id=%s session=%s: storing the turn failed: %s: %s", self.trace.id,
                      mem.loaded.session.id, type(e).__name__, e)

    async def _passthrough(self, p: Passthrough) -> web.StreamResponse:
        code = _error_code(p.body)
        self.trace.error_type = code
        if self.resp is not None:
            try:
                body = json.loads(p.body)
            except ValueError:
                body = error_body(f"the lane answered {p.status}", "invalid_request_error")
            await self._error_event(body, code)
            return self.resp
        headers = {"Content-Type": p.headers.get("Content-Type", "application/json"), "X-Request-Id": self.trace.id}
        if "Retry-After" in p.headers:
            headers["Retry-After"] = p.headers["Retry-After"]
        return web.Response(status=p.status, body=p.body, headers=headers)

    async def _fail(self, f: LaneFailure) -> web.StreamResponse:
        """Every attempt failed: the last lane's own 5xx if it gave one, else 502 / 504."""
        log.warning("id=%s no lane could serve the request; the last failure: lane=%s %s: %s", self.trace.id, f.lane,
                    f.kind, f.detail)
        if f.status is not None and f.status >= 500 and f.body:
            code = _error_code(f.body) or "upstream_error"
            if self.resp is None:
                headers = {"Content-Type": f.headers.get("Content-Type", "application/json"),
                           "X-Request-Id": self.trace.id}
                if "Retry-After" in f.headers:
                    headers["Retry-After"] = f.headers["Retry-After"]
                self.trace.error_type = code
                return web.Response(status=f.status, body=f.body, headers=headers)
            try:
                body = json.loads(f.body)
            except ValueError:
                body = error_body("the lane failed", "server_error", code=code)
            await self._error_event(body, code)
            return self.resp
        if f.kind == "timeout":
            raise APIError(504, f"no lane answered in time: {f.message}", code="upstream_timeout", type="server_error")
        raise APIError(502, f"no lane could serve this request: {f.message}", code="upstream_unavailable",
                       type="server_error")

    # ------------------------------------------------------------ non-streaming
    async def _plain(self, lane: LaneRuntime, body: dict[str, Any]) -> web.StreamResponse:
        session = self.gw.session
        assert session is not None

        async def call() -> tuple[int, dict[str, str], bytes]:
            async with session.post(lane.url + _PATHS[self.kind], data=_dumps(body),
                                    headers={"Content-Type": "application/json", "X-Request-Id": self.trace.id}) as r:
                return r.status, dict(r.headers), await r.read()

        timeout = self.gw.config.request_timeout_s
        try:
            status, headers, raw = await _race(self.request, call(), timeout)
        except TimeoutError:
            raise LaneFailure(lane.name, "timeout", f"lane {lane.name} gave no answer within {timeout:.0f}s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise LaneFailure(lane.name, "connect", f"lane {lane.name}: {connection_problem(e)}",
                              detail=f"{type(e).__name__}: {e}") from None
        check_lane_status(lane.name, f"lane {lane.name}", status, raw, headers)
        try:
            data = json.loads(raw)
        except ValueError:
            raise LaneFailure(lane.name, "status", f"lane {lane.name} sent unreadable JSON") from None
        _record_usage(self.trace, data.get("usage"))
        if self.texts is not None:
            texts = []
            for ch in data.get("choices") or []:
                msg = ch.get("message") if isinstance(ch, dict) else None
                texts.append(msg.get("content") if isinstance(msg, dict) else ch.get("text"))
            if self.key.log_prompts:
                self.trace.response_text = texts[0] if len(texts) == 1 else json.dumps(texts, ensure_ascii=False)
            if self.memory is not None:
                self.texts = {0: [texts[0] if texts and isinstance(texts[0], str) else ""]}
                await self._remember(complete=True)
        if self.rag is not None and isinstance(data, dict):
            data["citations"] = rag_citations(self.rag)
            raw = _dumps(data)
        if self.relay is not None and isinstance(data, dict):
            raw = _dumps(await self.relay.whole(data))
        return web.Response(status=status, body=raw, content_type="application/json", headers=self._headers(lane))

    # ------------------------------------------------------------ streaming
    def _log_row(self, status: int, error_type: str | None = None) -> None:
        """The request's row as it stands, on disk before the client gets more (the final one follows at the
        end: rows with the same id replace each other)."""
        if self.gw.store is not None:
            row = self.trace.row(status, round((time.monotonic() - self.trace.t0) * 1000, 3))
            if error_type is not None:
                row["error_type"] = error_type
            self.gw.store.record(row)

    def _log_in_progress(self) -> None:
        self._log_row(200, IN_PROGRESS)
        self.row_logged = True
        self.trace.mark("logged")

    async def _commit(self, lane: LaneRuntime) -> None:
        if not self.row_logged:  # a stream is logged as in progress before its first byte leaves
            self._log_in_progress()
        self.resp = _EventStream(status=200, headers={**SSE_HEADERS, **self._headers(lane)})
        try:
            await self.resp.prepare(self.request)
        except ConnectionError:
            raise ClientGone from None
        self.trace.mark("prepared")

    async def _send(self, aw: Awaitable[None]) -> None:
        """One write to the client's stream, within ``stream_write_timeout_s``: a client that stopped reading (its
        socket buffers full) is disconnected, which raises ClientGone here and drops the lane request with it."""
        try:
            async with asyncio.timeout(self.gw.config.stream_write_timeout_s):
                await aw
        except TimeoutError:
            self.gw.metrics.connections_closed.labels(reason="stream_stalled").inc()
            log.warning("id=%s the client took no stream data for %.0fs: disconnected", self.trace.id,
                        self.gw.config.stream_write_timeout_s)
            if self.request.transport is not None:
                self.request.transport.abort()
            raise ClientGone from None
        except ConnectionError:  # aiohttp's ClientConnectionResetError: the client hung up
            raise ClientGone from None

    def _cannot_block(self, size: int) -> bool:
        """Whether writing ``size`` more bytes to the client returns without waiting for it: its transport is not
        paused and stays at or below its high-water mark after them (aiohttp waits for a drain only while the
        transport is paused, which happens above that mark). Such a write needs no deadline."""
        t = self.request.transport
        if t is None or self.request.protocol.writing_paused:
            return False
        return t.get_write_buffer_size() + size + _FRAMING <= t.get_write_buffer_limits()[1]

    async def _write(self, lane: LaneRuntime, data: bytes) -> None:
        if self.resp is None:
            await self._commit(lane)
        assert self.resp is not None
        if self._cannot_block(len(data)):
            try:  # the common write: no timer to arm and cancel per chunk
                await self.resp.write(data)
            except ConnectionError:
                raise ClientGone from None
        else:
            await self._send(self.resp.write(data))
        self.last_write = time.monotonic()

    async def _send_chunk(self, lane: LaneRuntime, obj: dict[str, Any]) -> None:
        await self._write(lane, b"data: " + _dumps(obj) + b"\n\n" if self.relay is None else await self.relay.chunk(obj))

    async def _error_event(self, body: dict[str, Any], code: str | None) -> None:
        assert self.resp is not None
        self.trace.error_type = code
        try:
            await self._send(self.resp.write(b"data: " + _dumps(body) + b"\n\ndata: [DONE]\n\n" if self.relay is None
                                             else await self.relay.error(body)))
            await self._send(self.resp.write_eof())
        except ClientGone:
            self.trace.client_gone = True

    async def _stream(self, lane: LaneRuntime, body: dict[str, Any]) -> web.StreamResponse:
        cfg, session = self.gw.config, self.gw.session
        assert session is not None
        t_start = time.monotonic()
        first_deadline = t_start + cfg.first_token_timeout_s
        last_up = t_start  # the lane's last byte (its own pings count): a silent lane is a hung lane
        self.trace.mark("post")
        try:
            up = await _race(self.request, session.post(
                lane.url + _PATHS[self.kind], data=_dumps(body),
                headers={"Content-Type": "application/json", "X-Request-Id": self.trace.id}), cfg.first_token_timeout_s)
        except TimeoutError:
            raise LaneFailure(lane.name, "timeout", f"lane {lane.name} did not answer within "
                              f"{cfg.first_token_timeout_s:.0f}s") from None
        except (aiohttp.ClientError, OSError) as e:
            raise LaneFailure(lane.name, "connect", f"lane {lane.name}: {connection_problem(e)}",
                              detail=f"{type(e).__name__}: {e}") from None
        self.trace.mark("headers")
        clean = False
        try:
            if up.status != 200:
                try:
                    raw = await _race(self.request, up.read(), 30.0)
                except (TimeoutError, aiohttp.ClientError, OSError):
                    raw = b""
                headers = dict(up.headers)
                if 400 <= up.status < 500:
                    raise Passthrough(up.status, raw, headers)
                raise LaneFailure(lane.name, "status", f"lane {lane.name} answered {up.status}", up.status, raw,
                                  headers)
            if not up.headers.get("Content-Type", "").startswith("text/event-stream"):
                raise LaneFailure(lane.name, "status", f"lane {lane.name} did not answer with an event stream")
            if self.resp is None:
                # the lane took the stream and now prefills: the row is journaled in that wait, off the first
                # token's path, and is still on disk before the client's first byte leaves
                self._log_in_progress()
            content = up.content
            parser = _SSEParser()
            done = False
            while True:
                if client_gone(self.request):
                    raise ClientGone
                now = time.monotonic()
                if not self.first_sent and now >= first_deadline:
                    raise LaneFailure(lane.name, "timeout", f"lane {lane.name} sent no token within "
                                      f"{cfg.first_token_timeout_s:.0f}s")
                if self.first_sent and now - last_up >= cfg.stream_idle_timeout_s:
                    raise LaneFailure(lane.name, "timeout", f"lane {lane.name} sent nothing for "
                                      f"{cfg.stream_idle_timeout_s:.0f}s")
                # the upstream is read here, not by a task feeding a queue: the first token reaches the client
                # without two more turns of the event loop (bytes; None: the lane closed; an exception: broken)
                item: bytes | Exception | None
                ping_in = cfg.ping_interval_s - (now - self.last_write)
                try:
                    if ping_in <= 0:
                        item = content.read_nowait()  # what has arrived goes first, then the ping
                    else:
                        wait = asyncio.timeout(min(POLL_S, ping_in))
                        try:
                            async with wait:
                                item = await content.readany()
                        except TimeoutError:
                            if not wait.expired():  # the stream's own error, not our poll interval
                                raise
                            continue
                except Exception as e:  # a broken upstream (reset, bad chunked encoding ...)
                    item = e
                if item == b"" and not content.at_eof():  # (only from read_nowait) nothing yet, a ping is due
                    await self._write(lane, b": ping\n\n")  # keeps clients and proxies from timing out
                    continue
                if item == b"":
                    item = None
                last_up = time.monotonic()
                if not self.first_sent:
                    self.trace.mark("chunk")
                if isinstance(item, BaseException):
                    raise LaneFailure(lane.name, "stream", f"lane {lane.name}'s stream broke",
                                      detail=f"{type(item).__name__}: {item}")
                if item is None:
                    raise LaneFailure(lane.name, "stream", f"lane {lane.name} ended its stream before [DONE]")
                for data in parser.feed(item):
                    if await self._event(lane, data):
                        done = True
                        break
                if done:
                    await self._remember(complete=True)  # a session's turns are stored before the client's [DONE]
                    if self.rag is not None:  # the citations ride in one last chunk, before [DONE]
                        await self._send_chunk(lane, {
                            "id": self.trace.id, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": self.trace.model, "choices": [], "citations": rag_citations(self.rag)})
                    self._log_row(200)  # complete before the client learns it is
                    end = b"data: [DONE]\n\n" if self.relay is None else await self.relay.end()
                    if self.resp is None:
                        await self._commit(lane)
                    assert self.resp is not None
                    # the last events and the body's end in one write, as the lane sends them: a client that stops
                    # at [DONE] finds its connection at the end and can keep it
                    await self._send(self.resp.write_eof(end))
                    clean = await body_ended(up)  # the connection back to the pool, not closed
                    return self.resp
        except LaneFailure as f:
            if not self.first_sent:
                raise
            # after the first token there is no failover: the client learns it in the stream
            self.lane_broke = True
            self.gw.dispatcher.failed(lane, f.kind, f.detail)
            log.warning("id=%s lane=%s failed mid-stream: %s", self.trace.id, lane.name, f.detail)
            await self._error_event(error_body("the lane failed while streaming this response; the answer is "
                                               "incomplete", "server_error", code="upstream_error"), "upstream_error")
            assert self.resp is not None
            return self.resp
        finally:
            if self.texts is not None and self.texts and self.key.log_prompts:
                parts = ["".join(self.texts[i]) for i in sorted(self.texts)]
                self.trace.response_text = parts[0] if len(parts) == 1 else json.dumps(parts, ensure_ascii=False)
            if clean:
                up.release()
            else:
                up.close()  # drops the connection: the lane aborts the engine request

    async def _event(self, lane: LaneRuntime, data: str) -> bool:
        """Forward one upstream event; True at ``[DONE]``."""
        if data == "[DONE]":
            return True
        try:
            obj = json.loads(data)
        except ValueError:
            raise LaneFailure(lane.name, "stream", f"lane {lane.name} sent an unreadable event") from None
        if not isinstance(obj, dict):
            raise LaneFailure(lane.name, "stream", f"lane {lane.name} sent an unreadable event")
        if "error" in obj and not obj.get("choices"):
            code = _error_code(data.encode()) or "upstream_error"
            if not self.first_sent:  # nothing reached the client: this lane failed, another may not
                raise LaneFailure(lane.name, "stream", f"lane {lane.name} failed before the first token: {code}")
            self.lane_broke = True
            self.gw.dispatcher.failed(lane, "stream", f"error event {code}")
            self.trace.error_type = code
            await self._write(lane, b"data: " + data.encode() + b"\n\n" if self.relay is None
                              else await self.relay.error(obj))
            return False
        usage = obj.get("usage")
        out = data.encode()
        if isinstance(usage, dict):
            _record_usage(self.trace, usage)
            if not self.client_usage and not obj.get("choices"):
                return False  # the usage chunk we asked for ourselves
        if not self.client_usage and "usage" in obj:
            del obj["usage"]
            # the lane ends each chunk with the null usage the gateway asked for: cut from its bytes, not re-encoded
            out = out[: -len(_NULL_USAGE)] + b"}" if usage is None and out.endswith(_NULL_USAGE) else _dumps(obj)
        if self.texts is not None:
            for ch in obj.get("choices") or []:
                delta = ch.get("delta") if isinstance(ch.get("delta"), dict) else None
                piece = delta.get("content") if delta is not None else ch.get("text")
                if isinstance(piece, str):
                    self.texts.setdefault(int(ch.get("index") or 0), []).append(piece)
        await self._write(lane, b"data: " + out + b"\n\n" if self.relay is None else await self.relay.chunk(obj))
        if obj.get("choices"):
            self.trace.streamed_chunks += 1
        if not self.first_sent and obj.get("choices"):
            self.first_sent = True
            ttft = time.monotonic() - self.trace.t0
            self.trace.ttft_ms = round(ttft * 1000, 3)
            self.trace.mark("first_token")
            self.gw.metrics.ttft.labels(lane=lane.name).observe(ttft)
        return False


# ---------------------------------------------------------------------------------------- handlers


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


async def generation(request: web.Request, kind: Kind, prepare: Prepare | None = None) -> web.StreamResponse:
    """One generation request. ``prepare`` (another API's endpoint) turns the body it read into a chat
    request and the :class:`Relay` that answers in that API; the rest is the chat path itself."""
    gw = request.app[GATEWAY]
    trace = request[TRACE]
    key = request[PRINCIPAL]
    trace.log_row = True
    ticket = gw.limiter.admit(key)
    call: _Call | None = None
    try:
        body = await read_body(request)
        trace.mark("body")
        if not isinstance(body, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
        relay: Relay | None = None
        if prepare is not None:
            body, relay = await prepare(body)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise _bad("stream", "invalid stream: expected true or false")
        trace.stream = bool(stream)
        if kind == "chat":
            if "messages" not in body:
                raise _bad("messages", "missing required parameter 'messages'")
            if not isinstance(body["messages"], list) or not body["messages"]:
                raise _bad("messages", "invalid messages: expected a non-empty list of messages")
        elif body.get("prompt") is None:
            raise _bad("prompt", "missing required parameter 'prompt'")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _bad("model", "invalid model: expected a string")
        trace.model = model
        session_id = session_ref(request, body)
        refs = parse_collections(body)
        # ids that reach the database: valid text (the header too) without NUL, which PostgreSQL refuses
        check_text({"session_id": session_id})
        for param, ids in (("session_id", [session_id] if session_id else []), ("collections", refs or [])):
            if any("\x00" in v for v in ids):
                raise _bad(param, f"invalid {param}: must not contain NUL characters")
        if is_memory_session(session_id) and kind != "chat":
            raise _bad("session_id", "session memory works with /v1/chat/completions only")
        if refs is not None and kind != "chat":
            raise _bad("collections", "collections works with /v1/chat/completions only")
        for extra in _EXTRAS:
            body.pop(extra, None)
        user = body.get("user")
        affinity = session_id or (user if isinstance(user, str) and user else None)
        client_usage = False
        if stream:
            opts = body.get("stream_options")
            if opts is not None and not isinstance(opts, dict):
                raise _bad("stream_options", "invalid stream_options: expected an object")
            client_usage = bool(opts) and opts.get("include_usage") is True
            body["stream_options"] = {**(opts or {}), "include_usage": True}  # the request log needs usage
        if key.log_prompts:
            trace.prompt_text = json.dumps(body.get("messages") if kind == "chat" else body.get("prompt"),
                                           ensure_ascii=False)
        if relay is not None:
            client_usage = True  # the relay reads the usage chunk and speaks it in its own API
        call = _Call(request, gw, trace, key, kind, body, affinity, client_usage)
        call.relay = relay
        if is_memory_session(session_id):
            assert session_id is not None
            call.memory = await memory_prepare(get_memory(request), key.id, session_id, body["messages"])
            call.texts = {}  # the reply is stored as a turn (logged only for keys with log_prompts)
            if refs is None and call.memory.loaded.session.collections:
                refs = call.memory.loaded.session.collections  # the session's own collections
        if refs:
            call.rag = await rag_prepare(get_rag(request), key.id, refs, body["messages"], gw.config.rag.top_k)
        return await call.run()
    finally:
        gw.limiter.release(ticket)
        if call is not None and call.reservation is not None:
            # what was used: the lane's usage, else (a stream cut short) the chunks that reached the client
            completion = trace.completion_tokens if trace.completion_tokens is not None else trace.streamed_chunks
            gw.limiter.settle(call.reservation, (trace.prompt_tokens or 0) + completion)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generation(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await generation(request, "completion")
