"""The window precheck: count the prompt with the chosen lane's own tokenizer, then fit ``max_tokens``.

The window ``n_ctx`` is the lane's ``max_model_len`` (read by the health poller from its
``/v1/models``; the ``/tokenize`` answer carries it too and wins, being fresher), never a
configured constant, so the gateway and the engine cannot disagree about it. The count is
``POST /tokenize`` on the same lane with the same messages (chat template, generation prompt)
or prompt, which is exactly what the lane bills as ``prompt_tokens``.

Rules, per prompt (a completion may carry several; the longest decides):

* ``max_tokens`` above the key's or the global cap -> lowered to the cap;
* prompt + ``max_tokens`` > ``n_ctx`` -> lowered to ``n_ctx - prompt`` when at least
  ``min_clamp_tokens`` remain, else 400 ``context_length_exceeded`` with ``n_prompt_tokens``
  and ``n_ctx``;
* no ``max_tokens``: the default (the key's ``default_max_tokens``, else the gateway's),
  bounded by the caps and by the rest of the window (not a clamp: the client asked for
  nothing); with no default at all it means "the rest of the window". It only fails when
  the prompt alone fills the window.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from common.token_limit import token_limit_field
from gateway.dispatch import LaneFailure, LaneRuntime, check_lane_status, connection_problem
from gateway.errors import APIError
from gateway.tokencount import count_inline, count_locally

__all__ = ["Clamp", "WindowPlan", "count_prompt", "max_tokens_field", "precheck", "precheck_inline",
           "prompt_payloads"]

Kind = Literal["chat", "completion"]


@dataclass
class Clamp:
    original: int
    new: int
    reason: Literal["window", "cap"]

    def header(self) -> str:
        return f"{self.original}->{self.new}"


@dataclass
class WindowPlan:
    prompt_tokens: int  # all prompts together (billing, tpm)
    longest_prompt: int
    n_ctx: int
    max_tokens: int | None  # the value sent to the lane (None: the lane's default, the rest of the window)
    clamp: Clamp | None
    n_prompts: int = 1

    @property
    def max_new_tokens(self) -> int:
        """The most tokens one choice may generate (what the lane will stop at)."""
        return self.max_tokens if self.max_tokens is not None else self.n_ctx - self.longest_prompt


def max_tokens_field(body: dict[str, Any], kind: Kind) -> str:
    """The client's own name for the limit (common.token_limit: the lane's rule)."""
    return token_limit_field(body, chat=kind == "chat")


async def _tokenize(session: aiohttp.ClientSession, lane: LaneRuntime, payload: dict[str, Any], timeout: float,
                    request_id: str) -> tuple[int, int | None]:
    """(count, max_model_len): counted here with the lane's own tokenizer when it is loaded (max_model_len None:
    the card's), else by the lane's /tokenize; lane 4xx -> Passthrough, other failures -> LaneFailure."""
    n = await count_locally(lane, payload)
    if n is not None:
        return n, None
    try:
        async with session.post(lane.url + "/tokenize", data=json.dumps(payload).encode(),
                                headers={"Content-Type": "application/json", "X-Request-Id": request_id},
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            raw = await r.read()
            headers = {k: v for k, v in r.headers.items() if k in ("Content-Type", "Retry-After")}
            status = r.status
    except TimeoutError:
        raise LaneFailure(lane.name, "timeout", f"/tokenize took longer than {timeout:.0f}s") from None
    except (aiohttp.ClientError, OSError) as e:
        raise LaneFailure(lane.name, "connect", f"lane {lane.name}: /tokenize: {connection_problem(e)}",
                          detail=f"{type(e).__name__}: {e}") from None
    check_lane_status(lane.name, "/tokenize", status, raw, headers)
    try:
        data = json.loads(raw)
        return int(data["count"]), data.get("max_model_len")
    except (ValueError, KeyError, TypeError):
        raise LaneFailure(lane.name, "status", "/tokenize gave an unreadable answer", 502) from None


def prompt_payloads(body: dict[str, Any], kind: Kind) -> tuple[list[dict[str, Any]], list[int]]:
    """What to count for each prompt of the request (``/tokenize`` bodies) and the counts already known (prompts
    given as token ids); a typed 400 for a prompt of no known shape."""
    model = body.get("model")
    base: dict[str, Any] = {"model": model} if isinstance(model, str) else {}
    if kind == "chat":
        payload = {**base, "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):  # tool definitions are rendered into the prompt: count them too
            payload.update(tools=body["tools"], tool_choice=body.get("tool_choice"))
        return [payload], []
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return [{**base, "prompt": prompt}], []
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [], [len(prompt)]
    if isinstance(prompt, list) and prompt:
        return [{**base, "prompt": p} for p in prompt if isinstance(p, str)], \
            [len(p) for p in prompt if isinstance(p, list)]
    raise APIError(400, "invalid prompt: expected a string, a list of token ids, or a list of strings or of "
                   "token-id lists", param="prompt")


async def count_prompt(session: aiohttp.ClientSession, lane: LaneRuntime, body: dict[str, Any], kind: Kind,
                       timeout: float, request_id: str) -> tuple[list[int], int | None]:
    """Token counts of every prompt of the request, and the lane's window as /tokenize reported it."""
    payloads, known = prompt_payloads(body, kind)
    if len(payloads) == 1:
        n, n_ctx = await _tokenize(session, lane, payloads[0], timeout, request_id)
        return [n, *known], n_ctx
    counts = await asyncio.gather(*(_tokenize(session, lane, p, timeout, request_id) for p in payloads))
    n_ctx = next((c[1] for c in counts), None)
    return [c[0] for c in counts] + known, n_ctx


def fit(counts: list[int], n_ctx: int, kind: Kind, field: str, requested: int | None, cap: int | None,
        min_clamp: int, default: int | None = None) -> WindowPlan:
    """Apply the cap and window rules; raises the 400 ``context_length_exceeded``."""
    longest = max(counts)
    prompt_param = "messages" if kind == "chat" else "prompt"
    room = n_ctx - longest
    if room < 1:
        raise APIError(400, f"this model's maximum context length is {n_ctx} tokens; the prompt has {longest} "
                       "tokens, leaving no room to generate", code="context_length_exceeded", param=prompt_param,
                       n_prompt_tokens=longest, n_ctx=n_ctx)
    clamp: Clamp | None = None
    n = len(counts)
    if requested is None:
        # the default, bounded by the cap and the window (not a clamp: the client asked for nothing)
        limits = [x for x in (default, cap) if x is not None]
        sent = min([*limits, room]) if limits else None
        return WindowPlan(sum(counts), longest, n_ctx, sent, None, n)
    sent = requested
    if requested < 1:
        return WindowPlan(sum(counts), longest, n_ctx, requested, None, n)  # the lane's own 400 names it
    if cap is not None and sent > cap:
        sent = cap
        clamp = Clamp(requested, sent, "cap")
    if longest + sent > n_ctx:
        if room < min_clamp:
            raise APIError(400, f"this model's maximum context length is {n_ctx} tokens; the prompt has {longest} "
                           f"tokens and {field}={sent} asks for {longest + sent}; only {room} would remain "
                           f"(fewer than {min_clamp}): shorten the prompt", code="context_length_exceeded",
                           param=field, n_prompt_tokens=longest, n_ctx=n_ctx)
        sent = room
        clamp = Clamp(requested, sent, "window")
    return WindowPlan(sum(counts), longest, n_ctx, sent, clamp, n)


def _requested(body: dict[str, Any], field: str) -> int | None:
    requested = body.get(field)
    if requested is not None and (not isinstance(requested, int) or isinstance(requested, bool)):
        raise APIError(400, f"invalid {field}: expected an integer, got {json.dumps(requested)[:40]}", param=field)
    return requested


def precheck_inline(lane: LaneRuntime, body: dict[str, Any], kind: Kind, *, cap: int | None, min_clamp: int,
                    default: int | None = None) -> WindowPlan | None:
    """:func:`precheck` without awaiting anything, when every prompt is counted here on the event loop (the lane's
    tokenizer loaded, short text: the common request): no task, no turn of the loop, no timeout to arm. None: use
    :func:`precheck` (it counts in a thread or asks the lane; a body the local count cannot judge is counted
    again there, which costs only requests the lane then refuses)."""
    field = max_tokens_field(body, kind)
    requested = _requested(body, field)
    if lane.counter is None or lane.n_ctx is None:
        return None
    payloads, known = prompt_payloads(body, kind)
    counts: list[int] = []
    for p in payloads:
        n = count_inline(lane, p)
        if n is None:
            return None
        counts.append(n)
    counts += known
    if not counts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return fit(counts, lane.n_ctx, kind, field, requested, cap, min_clamp, default)


async def precheck(session: aiohttp.ClientSession, lane: LaneRuntime, body: dict[str, Any], kind: Kind, *,
                   cap: int | None, min_clamp: int, timeout: float, request_id: str,
                   default: int | None = None) -> WindowPlan:
    field = max_tokens_field(body, kind)
    requested = _requested(body, field)
    counts, lane_n_ctx = await count_prompt(session, lane, body, kind, timeout, request_id)
    n_ctx = lane_n_ctx if isinstance(lane_n_ctx, int) and lane_n_ctx > 0 else lane.n_ctx
    if n_ctx is None:
        raise LaneFailure(lane.name, "status", "the lane's window (max_model_len) is unknown", 503)
    if not counts:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return fit(counts, n_ctx, kind, field, requested, cap, min_clamp, default)
