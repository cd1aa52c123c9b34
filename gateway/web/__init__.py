"""The web chat page: static files served at ``/`` and ``/static/...``, and the operator overview.

The page is plain HTML/CSS/JavaScript (no build step, no CDN). Static files need no key: every
API call the page makes carries the key the user typed, from the browser's local storage.

    add_routes(app)   # GET /, GET /static/{name}, GET /v1/admin/overview
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import APIError
from gateway.state import GATEWAY

__all__ = ["CSP", "add_routes", "lane_figures"]

STATIC_DIR = Path(__file__).resolve().parent / "static"

# no inline script or style, nothing from another origin, no framing
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "font-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".ico": "image/x-icon"}
_LANE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class _Asset:
    body: bytes
    content_type: str
    etag: str


def _load_assets() -> dict[str, _Asset]:
    """Every servable file, read once at startup: a request can only name one of these."""
    out: dict[str, _Asset] = {}
    for p in sorted(STATIC_DIR.iterdir()):
        if p.is_file() and p.suffix in _TYPES:
            body = p.read_bytes()
            out[p.name] = _Asset(body, _TYPES[p.suffix], '"' + hashlib.sha256(body).hexdigest()[:20] + '"')
    return out


_ASSETS = web.AppKey("strata_web_assets", dict)


def _security_headers(h: dict[str, str]) -> dict[str, str]:
    h.update({"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
              "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
              "Cross-Origin-Opener-Policy": "same-origin"})
    return h


def _serve(request: web.Request, name: str, cache: str) -> web.Response:
    asset = request.app[_ASSETS].get(name)
    if asset is None:
        raise APIError(404, f"no static file {name!r}", code="not_found", type="invalid_request_error")
    headers = _security_headers({"Cache-Control": cache, "ETag": asset.etag})
    if asset.etag in (t.strip() for t in request.headers.get("If-None-Match", "").split(",")):
        return web.Response(status=304, headers=headers)
    headers["Content-Type"] = asset.content_type
    return web.Response(body=asset.body, headers=headers)


async def index(request: web.Request) -> web.Response:
    # revalidated every time: a new deployment is picked up at once
    return _serve(request, "index.html", "no-cache")


async def static(request: web.Request) -> web.Response:
    return _serve(request, request.match_info["name"], "public, max-age=300, must-revalidate")


# ---------------------------------------------------------------------------------------- operator view


def lane_figures(metrics_text: str) -> dict[str, Any]:
    """The figures the operator view shows, from one lane's Prometheus text."""
    out: dict[str, Any] = {"running": None, "waiting": None, "generation_tokens": None, "prompt_tokens": None,
                           "kv_usage": None, "last_step": {}, "last_step_tokens": None}
    names = {"strata_requests_running": "running", "strata_requests_waiting": "waiting",
             "strata_generation_tokens": "generation_tokens", "strata_prompt_tokens": "prompt_tokens",
             "strata_kv_usage_ratio": "kv_usage", "strata_last_step_tokens": "last_step_tokens"}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            name = s.name.removesuffix("_total")  # a counter's sample
            if name in names:
                out[names[name]] = s.value
            elif s.name == "strata_last_step_seconds" and "part" in s.labels:
                out["last_step"][s.labels["part"]] = s.value
    return out


async def _lane_view(session: aiohttp.ClientSession, base: dict[str, Any]) -> dict[str, Any]:
    view = dict(base, device=None, cores=None, gpu=None, gpu_info=None, threads=None, status=None,
                figures=None, error=None)
    timeout = aiohttp.ClientTimeout(total=_LANE_TIMEOUT_S)
    try:
        async with session.get(base["url"] + "/v1/lane", timeout=timeout) as r:
            if r.status == 200:
                info = await r.json()
                for k in ("device", "cores", "gpu", "gpu_info", "threads", "status"):
                    view[k] = info.get(k)
        async with session.get(base["url"] + "/metrics", timeout=timeout) as r:
            if r.status == 200:
                view["figures"] = lane_figures(await r.text())
    except (TimeoutError, aiohttp.ClientError, ValueError) as e:
        view["error"] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return view


async def admin_overview(request: web.Request) -> web.Response:
    """Every lane as the dispatcher sees it, plus its device, cores and live figures read from the lane."""
    gw = request.app[GATEWAY]
    assert gw.session is not None
    lanes = [lane.describe() for lane in gw.dispatcher.lanes.values()]
    views = await asyncio.gather(*(_lane_view(gw.session, d) for d in lanes))
    return web.json_response({"object": "overview", "time": round(time.time(), 3), "lanes": views})


def add_routes(app: web.Application) -> None:
    app[_ASSETS] = _load_assets()
    r = app.router
    r.add_get("/", index)
    r.add_get("/static/{name}", static)
    r.add_get("/v1/admin/overview", admin_overview)
