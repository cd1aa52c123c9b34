"""The window precheck's count without a round trip: the lane's own tokenizer, run in the gateway.

A ``POST /tokenize`` to the lane before every dispatch cost ~3.3 ms of the gateway's added TTFT
(docs/benchmarks.md "What the gateway costs"). Instead the gateway builds the lane's tokenizer
and chat template once from the lane's ``tokenizer.*`` metadata (``GET /v1/lane/tokenizer``,
checked against the ``tokenizer_digest`` of its model card, cached per digest) and counts with
the same functions the lane counts with (common/prompt.py), so the number is the lane's exactly.

Whenever it cannot say what the lane would (no tokenizer yet or a lane that serves none, a body
the lane would refuse, a template that fails, another model name) :meth:`LocalCounter.count`
returns None and the precheck asks ``/tokenize`` as before, so the lane still answers every
error itself. ``count_locally = false`` in the gateway config turns this off.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import aiohttp

from common.chat_template import ChatTemplate, ChatTemplateError
from common.prompt import chat_ids, check_messages, check_text, normalize_messages, text_ids
from common.tokenizer import Tokenizer

if TYPE_CHECKING:
    from gateway.dispatch import LaneRuntime

__all__ = ["INLINE_CHARS", "LocalCounter", "TokenizerCache", "count_inline", "count_locally"]

log = logging.getLogger("strata.gateway")

INLINE_CHARS = 8192  # longer prompts are counted in a worker thread, not on the event loop
_RETRY_S = 30.0  # a tokenizer that failed to load is tried again after this long
_KEEP = 4  # tokenizers kept, newest last (a lane switching models back and forth)
# Built tokenizers by digest, shared by every app of the process: the same digest is the same tokenizer,
# so a process that starts several gateway apps (the test suite) builds each once.
_BUILT: dict[str, LocalCounter] = {}


class LocalCounter:
    """A lane's tokenizer and chat template, built from its ``tokenizer.*`` metadata."""

    def __init__(self, digest: str, metadata: Mapping[str, Any]) -> None:
        self.digest = digest
        self.tokenizer = Tokenizer.from_metadata(metadata)
        try:
            self.template: Any = ChatTemplate.from_metadata(metadata, self.tokenizer)
        except ChatTemplateError:
            self.template = None  # the lane refuses chat (400): /tokenize says so

    def count(self, payload: Mapping[str, Any], served_model: str | None) -> int | None:
        """What the lane's ``/tokenize`` would answer as ``count`` for ``payload``, or None when only the
        lane can say (it would refuse the body, or the local rendering failed)."""
        try:
            return self._count(payload, served_model)
        except Exception as e:  # the lane answers this one (its own typed 400, or a count)
            log.debug("local count fell back to /tokenize: %s: %s", type(e).__name__, e)
            return None

    def _count(self, payload: Mapping[str, Any], served_model: str | None) -> int | None:
        # the same checks, in the same order, as lanes.server.tokenize and its TokenizeRequest (strict types)
        model = payload.get("model")
        if model is not None and (not isinstance(model, str) or (model and model != served_model)):
            return None
        prompt, messages = payload.get("prompt"), payload.get("messages")
        if (prompt is None) == (messages is None):
            return None
        if messages is not None:
            tools = payload.get("tools")
            agp = payload.get("add_generation_prompt", True)
            if self.template is None or not isinstance(messages, list) or not isinstance(agp, bool) or \
                    (tools is not None and not isinstance(tools, list)):
                return None
            check_text(tools, "tools", "tools")
            tools = tools if tools and payload.get("tool_choice") != "none" else None
            check_messages(messages)
            return len(chat_ids(self.tokenizer, self.template, normalize_messages(messages), tools, agp))
        if not isinstance(prompt, str):
            return None
        return len(text_ids(self.tokenizer, prompt))


def text_size(value: Any, limit: int = INLINE_CHARS) -> int:
    """Characters of text in a JSON value, counted up to just past ``limit`` (cheap for small bodies)."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return total


def count_inline(lane: LaneRuntime, payload: Mapping[str, Any]) -> int | None:
    """The lane's count, counted here on the event loop when its tokenizer is loaded and the text is short (~0.1
    ms: less than handing it to a thread); None: :func:`count_locally` or ``/tokenize`` decides."""
    counter = lane.counter
    if counter is None or text_size(payload) > INLINE_CHARS:
        return None
    return counter.count(payload, lane.model)


async def count_locally(lane: LaneRuntime, payload: Mapping[str, Any]) -> int | None:
    """The lane's count from its tokenizer in this process, or None (ask ``/tokenize``)."""
    counter = lane.counter
    if counter is None:
        return None
    if text_size(payload) <= INLINE_CHARS:
        return counter.count(payload, lane.model)
    return await asyncio.to_thread(counter.count, payload, lane.model)


class TokenizerCache:
    """Lane tokenizers by digest, each fetched and built once (in the background: until it is ready the
    precheck uses ``/tokenize``)."""

    def __init__(self) -> None:
        self.counters = _BUILT
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._failed: dict[str, float] = {}  # digest -> monotonic time of the last failure

    def attach(self, lane: LaneRuntime, session: aiohttp.ClientSession | None) -> None:
        """Point the lane at the tokenizer its card names (``lane.tokenizer_digest``), loading it when new;
        called after every health poll (cheap when nothing changed)."""
        d = lane.tokenizer_digest
        if d is None:
            lane.counter = None
            return
        if lane.counter is not None and lane.counter.digest == d:
            return
        lane.counter = self.counters.get(d)
        if lane.counter is not None or session is None or d in self._loading:
            return
        failed = self._failed.get(d)
        if failed is not None and time.monotonic() - failed < _RETRY_S:
            return
        self._loading[d] = asyncio.create_task(self._load(session, lane, d), name=f"tokenizer-{d[:12]}")

    async def _load(self, session: aiohttp.ClientSession, lane: LaneRuntime, digest: str) -> None:
        t0 = time.monotonic()
        try:
            async with session.get(lane.url + "/v1/lane/tokenizer", timeout=aiohttp.ClientTimeout(total=120)) as r:
                raw = await r.read()
                if r.status != 200:
                    raise ValueError(f"GET /v1/lane/tokenizer answered {r.status}")
            if hashlib.sha256(raw).hexdigest() != digest:
                raise ValueError("the tokenizer it served does not match its card's tokenizer_digest")
            counter = await asyncio.to_thread(lambda: LocalCounter(digest, json.loads(raw)))
        except Exception as e:  # the precheck keeps asking /tokenize; a later poll tries again
            self._failed[digest] = time.monotonic()
            log.warning("lane=%s tokenizer %s not loaded (prompts are counted by /tokenize): %s: %s", lane.name,
                        digest[:12], type(e).__name__, e)
            return
        finally:
            self._loading.pop(digest, None)
        self.counters[digest] = counter
        self._failed.pop(digest, None)
        log.info("lane=%s tokenizer %s loaded in %.2fs: the window precheck counts prompts in the gateway",
                 lane.name, digest[:12], time.monotonic() - t0)
        if lane.tokenizer_digest == digest:
            lane.counter = counter
        while len(self.counters) > _KEEP:  # the oldest first (dicts keep insertion order)
            del self.counters[next(iter(self.counters))]

    async def close(self) -> None:
        for task in list(self._loading.values()):
            task.cancel()
        for task in list(self._loading.values()):
            try:
                await task
            except asyncio.CancelledError:
                pass
