"""One generation request: its engine requests (prompts x n), their outputs, the answer.

The handler never cancels anything inside the engine: it reads a merged queue of the
engine's outputs with a timeout, checks its client's connection at every wake-up, and
aborts the engine requests when the client is gone, the handler is cancelled or the lane
gives up on them (drain timeout, shutdown).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from common.http import SSE_HEADERS, client_gone
from engine.block_manager import KVCapacityError
from engine.constraints import GrammarCompiler, GrammarError
from engine.sampling import SamplingParams
from engine.scheduler import EngineFailedError, OverloadedError, RequestOutput, TokenLogprob
from lanes.chat_parsers import AnswerParser, Piece, collect, make_parser
from lanes.errors import APIError, request_info
from lanes.protocol import MAX_CHOICES, ChatRequest, CompletionRequest, sampling_params
from lanes.state import LaneState

__all__ = ["Run", "generate", "json_response"]

log = logging.getLogger("strata.lanes")

_POLL_S = 0.25  # how often a waiting handler looks at its client's connection


def _context_error(n_prompt: int, n_ctx: int, max_tokens: int | None, param: str, prompt_param: str) -> APIError:
    if max_tokens is None:
        msg = (f"this model's maximum context length is {n_ctx} tokens; the prompt has {n_prompt} tokens, "
               f"leaving no room to generate")
    else:
        msg = (f"this model's maximum context length is {n_ctx} tokens; the prompt has {n_prompt} tokens and "
               f"{param}={max_tokens} asks for {n_prompt + max_tokens}")
    return APIError(400, msg, code="context_length_exceeded", param=param if max_tokens is not None else prompt_param,
                    n_prompt_tokens=n_prompt, n_ctx=n_ctx)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_dumps(obj), status=status, content_type="application/json", headers=headers)


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


@dataclass
class _Choice:
    index: int
    rid: str
    queue: asyncio.Queue[RequestOutput]
    prompt_tokens: int
    first_of_prompt: bool
    t_submit: float
    t_first: float | None = None
    t_last_token: float | None = None
    t_done: float | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string / token that ended it (vLLM's field of that name)
    error: str | None = None
    done: bool = False
    started: bool = False  # a stream chunk was sent for this choice
    parser: AnswerParser | None = None  # reads the answer in the model's format (lanes/chat_parsers.py)
    pieces: list[Piece] = field(default_factory=list)  # what the parser has read so far
    sent: int = 0  # pieces streamed so far
    held_logprobs: list[TokenLogprob] = field(default_factory=list)  # of text held back while undecided


class Run:
    """The engine requests behind one HTTP request (prompts x n choices) and their outputs."""

    def __init__(self, request: web.Request, st: LaneState, kind: Literal["chat", "completion"],
                 req: ChatRequest | CompletionRequest, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        self.request = request
        self.st = st
        self.kind = kind
        self.req = req
        self.prompts = prompts
        self.params = params
        self.n = req.n or 1
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model = st.config.served_model_name
        self.info = request_info()
        self.t0 = self.info.t0
        self.want_logprobs = req.engine_logprobs() is not None
        self.choices: list[_Choice] = []
        self.merged: asyncio.Queue[tuple[_Choice, RequestOutput]] = asyncio.Queue()
        self.pumps: list[asyncio.Task[None]] = []
        self.tokenizer = st.engine.tokenizer if st.engine is not None else None
        self.info.fields["id"] = self.id
        # tools: an answer may be tool calls, in the JSON a grammar shapes (lanes/tools.py) or in the
        # model's own syntax; reasoning may be set apart: the format's parser reads it (lanes/chat_parsers.py)
        self.tool_mode, self.tools = req.tool_mode() if isinstance(req, ChatRequest) else ("none", [])
        self.json_calls = self.tool_mode != "none" and params[0].grammar is not None

    def _parser(self, prompt: list[int]) -> AnswerParser | None:
        if self.kind != "chat":
            return None
        tail = ""
        if self.st.chat_format == "glm45" and self.tokenizer is not None:
            tail = self.tokenizer.decode(prompt[-4:])
        return make_parser(self.st.chat_format, self.tools or None, forced=self.tool_mode == "forced",
                           json_calls=self.json_calls, in_reasoning=tail.rstrip().endswith("<think>"))

    # ---------------------------------------------------------------- engine side
    def submit(self) -> None:
        aeng = self.st.aeng
        assert aeng is not None
        param = "messages" if self.kind == "chat" else "prompt"
        try:
            for p_idx, (ids, params) in enumerate(zip(self.prompts, self.params, strict=True)):
                for i in range(self.n):
                    p = params
                    if params.seed is not None and i:
                        p = params.model_copy(update={"seed": params.seed + i})
                    index = p_idx * self.n + i
                    rid = f"{self.id}-{index}"
                    t_submit = time.monotonic()
                    self.st.metrics.submitted(rid)  # first: the engine loop may admit it at once
                    try:
                        _, queue = aeng.submit(ids, p, rid)
                    except BaseException:
                        self.st.metrics.forget(rid)
                        raise
                    self.choices.append(_Choice(index, rid, queue, len(ids), i == 0, t_submit,
                                                parser=self._parser(ids)))
        except OverloadedError as e:
            self.abort_all()
            raise APIError(429, f"the lane is overloaded: {e}", code="server_overloaded",
                           retry_after=e.retry_after) from None
        except EngineFailedError:
            self.abort_all()
            raise APIError(503, "the lane's engine failed; retry on another lane", code="engine_failed",
                           retry_after=5) from None
        except KVCapacityError as e:
            self.abort_all()
            raise APIError(400, str(e), code="context_length_exceeded", param=param,
                           n_prompt_tokens=max(len(p) for p in self.prompts),
                           n_ctx=self.st.engine.n_ctx if self.st.engine else 0) from None
        except ValueError as e:
            self.abort_all()
            raise APIError(400, str(e), param=param) from None
        self.st.runs.add(self)
        for c in self.choices:
            self.pumps.append(asyncio.create_task(self._pump(c)))

    async def _pump(self, c: _Choice) -> None:
        while True:
            out = await c.queue.get()
            self.merged.put_nowait((c, out))
            if out.finished:
                return

    async def next(self, timeout: float) -> tuple[_Choice, RequestOutput] | None:
        try:
            return await asyncio.wait_for(self.merged.get(), timeout)
        except TimeoutError:
            return None

    @property
    def pending(self) -> bool:
        return any(not c.done for c in self.choices)

    def apply(self, c: _Choice, out: RequestOutput) -> tuple[str, list[TokenLogprob]]:
        """Fold one output into its choice; returns the text delta and the logprobs to show."""
        now = time.monotonic()
        m = self.st.metrics
        lps = out.logprobs if out.token_ids else []  # the stop token's logprob is not shown
        if out.token_ids:
            if c.t_first is None:
                c.t_first = now
                m.ttft.observe(now - self.t0)
            elif c.t_last_token is not None:
                m.itl.observe((now - c.t_last_token) / len(out.token_ids))
            c.t_last_token = now
        c.text.append(out.text)
        if c.parser is not None:
            c.pieces += c.parser.feed(out.text)
            if out.finished and out.finish_reason in ("stop", "length"):
                c.pieces += c.parser.finish(out.finish_reason)
        c.logprobs.extend(lps)
        c.completion_tokens = out.completion_tokens
        c.cached_tokens = out.cached_tokens
        if out.finished:
            c.done = True
            c.t_done = now
            c.finish_reason = out.finish_reason
            c.stop_reason = out.stop_reason
            c.error = out.error
            if c.t_first is None and out.finish_reason != "abort":
                c.t_first = now  # stopped at once (EOS first): still a first answer
                m.ttft.observe(now - self.t0)
            self._finished(c)
        return out.text, lps

    def _finished(self, c: _Choice) -> None:
        self.st.metrics.finished(c.rid, c.finish_reason, c.prompt_tokens, c.completion_tokens, self.t0,
                                 c.t_submit, c.t_first, c.t_done)
        if c.error:
            log.error("lane=%s id=%s engine error: %s", self.st.config.name, c.rid, c.error)

    def abort_all(self) -> None:
        """Abort every unfinished engine request (client gone, handler cancelled, submit failed)."""
        aeng = self.st.aeng
        for c in self.choices:
            if not c.done:
                if aeng is not None:
                    aeng.abort(c.rid)
                c.done = True
                c.finish_reason = "abort"
                c.t_done = time.monotonic()
                self._finished(c)

    def close(self, client_gone: bool) -> None:
        for t in self.pumps:
            t.cancel()  # only our own queue readers; the engine keeps running
        self.abort_all()
        self.st.runs.discard(self)
        first = [c.t_first for c in self.choices if c.t_first is not None]
        self.info.fields.update(n=len(self.choices), prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                    cached_tokens=self.cached_tokens,
                    ttft=f"{min(first) - self.t0:.3f}" if first else "-",
                    finish=",".join(sorted({c.finish_reason or "abort" for c in self.choices})) or "-",
                    stream=int(bool(self.req.stream)))
        self.info.client_gone = client_gone

    # ---------------------------------------------------------------- response side
    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def cached_tokens(self) -> int:
        return sum(c.cached_tokens for c in self.choices if c.first_of_prompt)

    def usage(self) -> dict[str, Any]:
        p, g = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": g, "total_tokens": p + g,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def failure(self) -> APIError | None:
        """Why the request failed on the server side (engine error, aborted by drain/shutdown)."""
        for c in self.choices:
            if c.error:
                return APIError(500, "the engine failed while generating this request", code="engine_error")
        for c in self.choices:
            if c.finish_reason == "abort":
                return APIError(503, "the request was aborted because the lane is shutting down",
                                code="server_stopping")
        return None

    def _token_text(self, tid: int) -> tuple[str, list[int]]:
        tok = self.tokenizer
        if tok is None:
            return "", []
        try:
            return tok.decode([tid]), list(tok.token_bytes(tid))
        except ValueError:
            return "", []

    def chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        content = []
        for lp in lps:
            text, raw = self._token_text(lp.token_id)
            top = []
            for tid, v in lp.top or []:
                t_text, t_raw = self._token_text(tid)
                top.append({"token": t_text, "logprob": _finite(v), "bytes": t_raw})
            content.append({"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": top})
        return {"content": content, "refusal": None}  # OpenAI requires both keys; this server never refuses

    def completion_logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in lps:
            text, _ = self._token_text(lp.token_id)
            tokens.append(text)
            token_lps.append(_finite(lp.logprob))
            tops.append({self._token_text(tid)[0]: _finite(v) for tid, v in lp.top or []})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def message(self, c: _Choice) -> tuple[dict[str, Any], str | None]:
        """A finished chat choice's message and finish reason. Read by its parser: the same pieces a
        stream sends, joined; calls (possibly cut short, never their envelope as text) end as
        ``tool_calls``, a call cut before its name leaves ``content: ""``."""
        if c.parser is None:
            return {"role": "assistant", "content": "".join(c.text), "refusal": None}, c.finish_reason
        ans = collect(c.pieces)
        message: dict[str, Any] = {"role": "assistant", "content": ans.content, "refusal": None}
        if ans.reasoning is not None:
            message["reasoning_content"] = ans.reasoning
        if not ans.tool_calls:
            return message, c.finish_reason
        message["tool_calls"] = ans.tool_calls
        return message, ("tool_calls" if c.finish_reason == "stop" else c.finish_reason)

    def response(self) -> dict[str, Any]:
        choices = []
        for c in self.choices:
            if self.kind == "chat":
                message, reason = self.message(c)
                choices.append({"index": c.index, "message": message,
                                "logprobs": self.chat_logprobs(c.logprobs) if self.want_logprobs else None,
                                "finish_reason": reason, "stop_reason": c.stop_reason})
            else:
                choices.append({"index": c.index, "text": "".join(c.text),
                                "logprobs": self.completion_logprobs(c.logprobs, 0) if self.want_logprobs else None,
                                "finish_reason": c.finish_reason})
        return {"id": self.id, "object": "chat.completion" if self.kind == "chat" else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": self.st.build_id,
                "choices": choices, "usage": self.usage()}

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id,
                             "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                             "created": self.created, "model": self.model, "system_fingerprint": self.st.build_id,
                             "choices": choices}
        if self.req.include_usage:
            d["usage"] = None
        return d

    def stream_chunks(self, c: _Choice, out: RequestOutput, text: str, lps: list[TokenLogprob]) -> list[dict]:
        if c.parser is not None:
            return self._parsed_stream_chunks(c, out, lps)
        chunks = []
        if text or lps or (not c.started and not out.finished):
            if self.kind == "chat":
                delta: dict[str, Any] = {"content": text}
                if not c.started:
                    delta = {"role": "assistant", "content": text}
                entry: dict[str, Any] = {"index": c.index, "delta": delta,
                                         "logprobs": self.chat_logprobs(lps) if lps else None, "finish_reason": None}
            else:
                offset = sum(len(t) for t in c.text[:-1])
                entry = {"index": c.index, "text": text,
                         "logprobs": self.completion_logprobs(lps, offset) if lps else None, "finish_reason": None}
            c.started = True
            chunks.append(self.chunk([entry]))
        if out.finished and out.finish_reason in ("stop", "length"):
            if self.kind == "chat":
                delta = {} if c.started else {"role": "assistant", "content": ""}
                entry = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason}
            else:
                entry = {"index": c.index, "text": "", "logprobs": None, "finish_reason": out.finish_reason}
            c.started = True
            chunks.append(self.chunk([entry]))
        return chunks


    def _parsed_stream_chunks(self, c: _Choice, out: RequestOutput, lps: list[TokenLogprob]) -> list[dict]:
        """A chat answer read by its parser: each new piece is a delta (``content``,
        ``reasoning_content``, or a ``tool_calls`` entry: a call's head with id and name, then pieces of
        its arguments); text held back while undecided keeps its logprobs until it is sent."""
        ended = out.finished and out.finish_reason in ("stop", "length")
        if out.finished and not ended:
            return []  # abort / engine error: the caller ends the stream
        c.held_logprobs.extend(lps)
        entries: list[dict[str, Any]] = []
        for p in c.pieces[c.sent:]:
            if p.kind == "call":
                entries.append(self._delta(c, p.delta()))
            else:
                entries.append(self._delta(c, p.delta(), c.held_logprobs))
                c.held_logprobs = []
        c.sent = len(c.pieces)
        chunks = [self.chunk([e]) for e in entries]
        if ended:
            calls = any(p.kind == "call" for p in c.pieces)
            reason = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
            delta: dict[str, Any] = {} if c.started else {"role": "assistant", "content": ""}
            c.started = True
            chunks.append(self.chunk([{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": reason,
                                       "stop_reason": out.stop_reason}]))
        return chunks

    def _delta(self, c: _Choice, delta: dict[str, Any], lps: list[TokenLogprob] | None = None) -> dict[str, Any]:
        """One choice entry of a chunk; the choice's first also carries the role (and content
        null when it starts with tool calls, as OpenAI sends it)."""
        if not c.started:
            delta = {"role": "assistant", **({"content": None} if "tool_calls" in delta else {}), **delta}
            c.started = True
        return {"index": c.index, "delta": delta, "logprobs": self.chat_logprobs(lps) if lps else None,
                "finish_reason": None}


async def generate(request: web.Request, st: LaneState, kind: Literal["chat", "completion"],
                   req: ChatRequest | CompletionRequest, prompts: list[list[int]]) -> web.StreamResponse:
    engine = st.engine
    assert engine is not None
    n_ctx = engine.n_ctx
    mt_name, mt = req.max_tokens_param
    if mt is not None and mt < 1:
        raise APIError(400, f"{mt_name} must be at least 1, got {mt}", param=mt_name)
    if len(prompts) * (req.n or 1) > MAX_CHOICES:
        raise APIError(400, f"at most {MAX_CHOICES} completions per request (prompts x n), "
                       f"got {len(prompts) * (req.n or 1)}", param="n")
    prompt_param = "messages" if kind == "chat" else "prompt"
    n_vocab = engine.hparams.n_vocab
    for tid in req.engine_logit_bias():
        if tid >= n_vocab:
            raise APIError(400, f"invalid logit_bias: token id {tid} is out of range [0, {n_vocab})",
                           param="logit_bias")
    grammar, grammar_param = req.grammar()
    if grammar is not None:  # compiled off the loop: the first one also builds the vocabulary (~1 s)
        try:
            await asyncio.to_thread(GrammarCompiler.for_tokenizer(engine.tokenizer).check, grammar)
        except GrammarError as e:
            raise APIError(400, f"the schema cannot be used: {e}", param=grammar_param,
                           code="invalid_schema") from None
    params = []
    for ids in prompts:
        if not ids:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if len(ids) >= n_ctx or (mt is not None and len(ids) + mt > n_ctx):
            raise _context_error(len(ids), n_ctx, mt if len(ids) < n_ctx else None, mt_name, prompt_param)
        params.append(sampling_params(req, mt if mt is not None else n_ctx - len(ids)))
    run = Run(request, st, kind, req, prompts, params)
    if req.stream:
        return await _stream(request, st, run)
    return await _collect(request, st, run)


async def _collect(request: web.Request, st: LaneState, run: Run) -> web.StreamResponse:
    run.submit()
    gone = True  # until the loop ends normally: cancellation counts as a gone client
    try:
        while run.pending:
            if client_gone(request):
                break
            item = await run.next(_POLL_S)
            if item is not None:
                run.apply(*item)
        else:
            gone = False
    finally:
        run.close(gone)
    if gone:
        return web.Response(status=499, reason="Client Closed Request")
    failure = run.failure()
    if failure is not None:
        raise failure
    return json_response(run.response(), headers={"X-Request-Id": run.id})


async def _stream(request: web.Request, st: LaneState, run: Run) -> web.StreamResponse:
    run.submit()  # before the 200 goes out: overload and bad prompts still get their status
    resp = web.StreamResponse(status=200, headers={**SSE_HEADERS, "X-Request-Id": run.id})
    ping = st.config.ping_interval_s
    gone = True
    try:
        await resp.prepare(request)
        last_write = time.monotonic()
        while run.pending:
            if client_gone(request):
                break
            item = await run.next(min(_POLL_S, ping))
            now = time.monotonic()
            if item is None:
                if now - last_write >= ping:  # keeps proxies and the gateway from timing out a long prefill
                    await resp.write(b": ping\n\n")
                    last_write = now
                continue
            c, out = item
            text, lps = run.apply(c, out)
            for chunk in run.stream_chunks(c, out, text, lps):
                await resp.write(b"data: " + _dumps(chunk) + b"\n\n")
            last_write = now
        else:
            failure = run.failure()
            tail = b""
            if failure is not None:  # after a 200 the only way to say it is an SSE error event
                request_info().error = failure.code
                tail = b"data: " + _dumps(failure.body()) + b"\n\n"
            elif run.req.include_usage:
                usage = run.chunk([])
                usage["usage"] = run.usage()
                tail = b"data: " + _dumps(usage) + b"\n\n"
            # the last events and the body's end in one write (one segment): a proxy that stops reading at [DONE]
            # then finds the connection at its end and keeps it for the next request
            await resp.write_eof(tail + b"data: [DONE]\n\n")
            gone = False
    except ConnectionResetError:  # aiohttp's ClientConnectionResetError: the client hung up
        pass
    except Exception:  # after the 200 went out the middleware cannot answer: end the stream here
        log.exception("lane=%s id=%s stream failed", st.config.name, run.id)
        request_info().error = "internal_error"
        with contextlib.suppress(Exception):
            err = APIError(500, "internal server error", code="internal_error")
            await resp.write_eof(b"data: " + _dumps(err.body()) + b"\n\ndata: [DONE]\n\n")
            gone = False
    finally:
        run.close(gone)
    return resp
