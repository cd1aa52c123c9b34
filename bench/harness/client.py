"""HTTP client of the harness: one OpenAI-compatible target (the gateway, a plain lane or a llama.cpp
server), streamed chat with client-side timing, token counts with the lane's own tokenizer, the
gateway's admin API and Prometheus scrapes.

Every request is timed from the moment it is sent: TTFT is the first content delta, inter-token
latency the gaps between content deltas, and the token counts come from the server's ``usage``
(``stream_options.include_usage``), falling back to the number of content deltas.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

Kind = Literal["gateway", "lane", "llama"]

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


class TargetError(RuntimeError):
    """The target does not answer as an OpenAI-compatible server (or the harness lacks what a scenario needs)."""


@dataclass
class ChatResult:
    """One request as the client saw it."""

    ok: bool
    status: int
    sent: float  # time.monotonic() at send
    total_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    text: str = ""
    finish_reason: str | None = None
    request_id: str | None = None
    lane: str | None = None
    error: str | None = None
    body: dict[str, Any] = field(default_factory=dict)  # the non-streamed answer (citations, usage ...)

    @property
    def decode_tok_s(self) -> float | None:
        """Generated tokens after the first over the time after the first (single-stream decode speed)."""
        if self.ttft_s is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        dt = self.total_s - self.ttft_s
        return (self.completion_tokens - 1) / dt if dt > 0 else None


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


class Target:
    """One server under test. ``kind`` is found by probing: a lane answers ``/v1/lane``, the gateway
    ``/readyz`` (and ``/v1/admin/lanes`` with an admin key), anything else is taken as a llama.cpp server."""

    def __init__(self, url: str, key: str | None = None, admin_key: str | None = None, label: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.key = key
        self.admin_key = admin_key
        self.label = label or url
        self.kind: Kind = "gateway"
        self.n_ctx: int | None = None
        self.lanes: list[dict[str, Any]] = []  # the gateway's lanes (admin API), or this lane
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=10)
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Target:
        self._session = aiohttp.ClientSession(timeout=self._timeout,
                                              connector=aiohttp.TCPConnector(limit=256, force_close=False))
        try:
            await self.probe()
        except BaseException:
            await self._session.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise TargetError("the target is not open (use `async with Target(...)`)")
        return self._session

    def headers(self, key: str | None = None) -> dict[str, str]:
        k = key or self.key
        return {"Authorization": f"Bearer {k}"} if k else {}

    async def get_json(self, url: str, key: str | None = None, timeout: float = 10.0) -> tuple[int, Any]:
        try:
            async with self.session.get(url, headers=self.headers(key), timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                try:
                    return r.status, await r.json(content_type=None)
                except (ValueError, aiohttp.ContentTypeError):
                    return r.status, None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return 0, None

    async def probe(self) -> None:
        """Find what the target is, its window and (for the gateway, with an admin key) its lanes."""
        status, info = await self.get_json(self.url + "/v1/lane")
        if status == 200 and isinstance(info, dict) and "n_ctx" in info:
            self.kind = "lane"
            self.n_ctx = info.get("n_ctx")
            self.lanes = [{"name": info.get("lane") or info.get("name"), "url": self.url, "n_ctx": self.n_ctx,
                           "pid": info.get("pid")}]
            return
        status, _ = await self.get_json(self.url + "/readyz")
        if status in (200, 503):
            self.kind = "gateway"
            if self.admin_key:
                await self.refresh_lanes()
            return
        status, models = await self.get_json(self.url + "/v1/models")
        if status != 200:
            raise TargetError(f"{self.url}: neither a lane (/v1/lane), the gateway (/readyz) nor an OpenAI "
                              f"server (/v1/models answered {status or 'nothing'})")
        self.kind = "llama"
        data = (models or {}).get("data") or [{}]
        meta = data[0].get("meta") or {}
        self.n_ctx = meta.get("n_ctx_train") or None

    async def refresh_lanes(self) -> list[dict[str, Any]]:
        if self.kind == "lane":
            return self.lanes
        status, body = await self.get_json(self.url + "/v1/admin/lanes", key=self.admin_key)
        if status != 200 or not isinstance(body, dict):
            raise TargetError(f"{self.url}/v1/admin/lanes answered {status}: an admin key is needed")
        self.lanes = list(body["data"])
        ctxs = [int(x["n_ctx"]) for x in self.lanes if x.get("n_ctx")]
        self.n_ctx = min(ctxs) if ctxs else self.n_ctx
        return self.lanes

    @property
    def lane_urls(self) -> list[str]:
        return [str(x["url"]) for x in self.lanes if x.get("url")]

    # ------------------------------------------------------------------ tokens

    async def count_tokens(self, messages: list[dict[str, Any]]) -> int:
        """Prompt tokens of a chat as the lane renders and tokenizes it (its ``/tokenize``); with no lane
        reachable, the ``usage.prompt_tokens`` of a one-token request."""
        for url in self.lane_urls:
            try:
                async with self.session.post(url + "/tokenize", json={"messages": messages,
                                                                      "add_generation_prompt": True}) as r:
                    if r.status == 200:
                        return int((await r.json())["count"])
            except (TimeoutError, aiohttp.ClientError, OSError, KeyError, ValueError):
                continue
        res = await self.chat(messages, max_tokens=1, stream=False)
        if not res.ok or res.prompt_tokens is None:
            raise TargetError(f"cannot count tokens: {res.error}")
        return res.prompt_tokens

    # ------------------------------------------------------------------ requests

    async def chat(self, messages: list[dict[str, Any]], max_tokens: int, stream: bool = True,
                   ignore_eos: bool = False, key: str | None = None, temperature: float = 0.0,
                   url: str | None = None, **extra: Any) -> ChatResult:
        """One chat completion; never raises for an HTTP or connection failure (it is the result)."""
        body: dict[str, Any] = {"model": "strata-default", "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": stream, **extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if ignore_eos:
            if self.kind == "llama":  # llama-cpp-python's server ignores ignore_eos; min_tokens holds EOS back
                body["min_tokens"] = max_tokens
            else:
                body["ignore_eos"] = True
        sent = time.monotonic()
        res = ChatResult(ok=False, status=0, sent=sent, total_s=0.0)
        try:
            async with self.session.post((url or self.url) + "/v1/chat/completions", json=body,
                                         headers=self.headers(key)) as r:
                res.status = r.status
                res.request_id = r.headers.get("X-Request-Id")
                res.lane = r.headers.get("X-Strata-Lane")
                if r.status != 200:
                    detail = await r.text()
                    res.error = f"HTTP {r.status}: {detail[:300]}"
                elif stream:
                    await self._read_stream(r, res)
                else:
                    data = await r.json(content_type=None)
                    res.body = data
                    res.ttft_s = time.monotonic() - sent
                    choice = (data.get("choices") or [{}])[0]
                    res.text = (choice.get("message") or {}).get("content") or ""
                    res.finish_reason = choice.get("finish_reason")
                    usage = data.get("usage") or {}
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    res.ok = True
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"
            res.ok = False
        res.total_s = time.monotonic() - sent
        return res

    async def _read_stream(self, r: aiohttp.ClientResponse, res: ChatResult) -> None:
        last: float | None = None
        chunks = 0
        parts: list[str] = []
        done = False
        async for raw in r.content:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                obj = json.loads(payload)
            except ValueError:
                continue
            if "error" in obj:
                res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                continue
            if obj.get("citations") is not None:
                res.body["citations"] = obj["citations"]
            usage = obj.get("usage")
            if isinstance(usage, dict):
                res.prompt_tokens = usage.get("prompt_tokens")
                res.completion_tokens = usage.get("completion_tokens")
            for choice in obj.get("choices") or []:
                delta = (choice.get("delta") or {}).get("content")
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
                if delta:
                    now = time.monotonic()
                    if last is None:
                        res.ttft_s = now - res.sent
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
                    parts.append(delta)
        res.text = "".join(parts)
        if res.completion_tokens is None:
            res.completion_tokens = chunks
        res.ok = done and res.error is None and res.finish_reason is not None

    # ------------------------------------------------------------------ admin API and metrics

    async def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        if not self.admin_key:
            raise TargetError(f"{method} {path}: the scenario needs the gateway's admin key (--admin-key-file)")
        async with self.session.request(method, self.url + path, json=body, headers=self.headers(self.admin_key),
                                        timeout=aiohttp.ClientTimeout(total=60)) as r:
            data = await r.json(content_type=None)
            if r.status >= 300:
                raise TargetError(f"{method} {path}: HTTP {r.status}: {json.dumps(data)[:300]}")
            return data

    async def create_key(self, name: str, log_prompts: bool = False) -> str:
        """A key without per-key limits (the benchmarks measure the stack, not its [limits] defaults)."""
        from gateway.config import KEY_LIMITS

        data = await self.admin("POST", "/v1/admin/keys", {"name": name, "log_prompts": log_prompts,
                                                           "limits": dict.fromkeys(KEY_LIMITS)})
        return str(data["key"])

    async def request_log(self, since: float, limit: int = 1000) -> list[dict[str, Any]]:
        data = await self.admin("GET", f"/v1/admin/requests?since={since:.3f}&limit={limit}")
        return list(data["data"])

    async def scrape(self, url: str) -> dict[str, float]:
        try:
            # the gateway's /metrics needs the admin key (lanes ignore it)
            async with self.session.get(url + "/metrics", headers=self.headers(self.admin_key) if self.admin_key else None,
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                return parse_metrics(await r.text()) if r.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError, OSError):
            return {}
