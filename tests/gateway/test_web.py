"""The web page's static serving (CSP, cache headers, no key needed), the operator overview and the
session rename the page uses: a real lane with the default model behind the real gateway."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from gateway.web import CSP, STATIC_DIR
from tests.gateway.conftest import ADMIN_KEY, GW, auth, gateway_config, running_gateway
from tests.lanes.conftest import Lane

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(lane: Lane, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    cfg = gateway_config(tmp_path_factory.mktemp("gw"), [{"name": "a", "url": lane.url}],
                         default_max_tokens=16, rag={"enabled": False})
    async with running_gateway(cfg) as g:
        yield g


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------- static serving


async def test_page_served_without_key_with_strict_csp(gw: GW, http: aiohttp.ClientSession) -> None:
    async with http.get(gw.url + "/") as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/html")
        assert r.headers["Content-Security-Policy"] == CSP
        assert "script-src 'self'" in CSP and "unsafe-inline" not in CSP and "unsafe-eval" not in CSP
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert r.headers["Cache-Control"] == "no-cache"
        etag = r.headers["ETag"]
        html = await r.text()
    assert html == (STATIC_DIR / "index.html").read_text()
    async with http.get(gw.url + "/", headers={"If-None-Match": etag}) as r:
        assert r.status == 304 and await r.read() == b""
    async with http.get(gw.url + "/static/app.js") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/javascript")
        assert r.headers["Cache-Control"].startswith("public, max-age=")
        assert (await r.read()) == (STATIC_DIR / "app.js").read_bytes()
    async with http.get(gw.url + "/static/style.css") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/css")


@pytest.mark.parametrize("path", ["/static/nope.js", "/static/..%2F__init__.py", "/static/%2e%2e%2fapp.py",
                                  "/static/__init__.py"])
async def test_only_the_page_files_are_served(gw: GW, http: aiohttp.ClientSession, path: str) -> None:
    async with http.get(gw.url + path) as r:
        assert r.status == 404
        body = await r.json()
    assert set(body["error"]) >= {"message", "type", "code"}


# ---------------------------------------------------------------------------------------- operator overview


async def test_overview_is_admin_only_and_reads_the_lanes(gw: GW, http: aiohttp.ClientSession) -> None:
    user = gw.key("web-user")
    async with http.get(gw.url + "/v1/admin/overview", headers=auth(user)) as r:
        assert r.status == 403
    async with http.get(gw.url + "/v1/admin/overview") as r:
        assert r.status == 401
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}
    async with http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(user)) as r:
        assert r.status == 200, await r.text()
        n = (await r.json())["usage"]["completion_tokens"]
    async with http.get(gw.url + "/v1/admin/overview", headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200
        view = await r.json()
    (a,) = view["lanes"]
    assert a["name"] == "a" and a["ready"] is True and a["error"] is None
    assert a["device"] == "cpu" and a["cores"]
    f = a["figures"]
    assert f["running"] == 0 and f["waiting"] == 0 and f["generation_tokens"] >= n > 0
    assert f["last_step"]["wall"] > 0 and f["last_step"]["total"] > 0 and f["last_step_tokens"] >= 1
    assert set(f["last_step"]) >= {"attn", "experts", "dense", "output"}


async def test_overview_reports_an_unreachable_lane(tmp_path: Path, http: aiohttp.ClientSession,
                                                    lane: Lane) -> None:
    cfg = gateway_config(tmp_path, [{"name": "a", "url": lane.url},
                                    {"name": "dead", "url": f"http://127.0.0.1:{_dead_port()}"}],
                         rag={"enabled": False}, memory={"enabled": False})
    async with running_gateway(cfg) as g:
        async with http.get(g.url + "/v1/admin/overview", headers=auth(ADMIN_KEY)) as r:
            assert r.status == 200
            lanes = {x["name"]: x for x in (await r.json())["lanes"]}
    assert lanes["a"]["error"] is None and lanes["a"]["figures"] is not None
    assert lanes["dead"]["ready"] is False and lanes["dead"]["error"] and lanes["dead"]["figures"] is None


# ---------------------------------------------------------------------------------------- session rename


async def test_rename_session(gw: GW, http: aiohttp.ClientSession) -> None:
    k1, k2 = gw.key("renamer"), gw.key("other")
    async with http.post(gw.url + "/v1/sessions", json={"title": "first"}, headers=auth(k1)) as r:
        assert r.status == 201
        sid = (await r.json())["id"]
    url = gw.url + f"/v1/sessions/{sid}"
    async with http.patch(url, json={"title": "renamed <b>"}, headers=auth(k1)) as r:
        assert r.status == 200 and (await r.json())["title"] == "renamed <b>"
    async with http.get(gw.url + f"/v1/sessions/{sid}", headers=auth(k1)) as r:
        assert (await r.json())["title"] == "renamed <b>"
    async with http.patch(gw.url + f"/v1/sessions/{sid}", json={"title": "stolen"}, headers=auth(k2)) as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "session_not_found"
    for bad in ({"title": 5}, {"title": "x" * 300}, {"name": "x"}, {}):
        async with http.patch(gw.url + f"/v1/sessions/{sid}", json=bad, headers=auth(k1)) as r:
            assert r.status == 400, bad
            assert (await r.json())["error"]["type"] == "invalid_request_error"
    async with http.patch(gw.url + f"/v1/sessions/{sid}", json={"title": None}, headers=auth(k1)) as r:
        assert r.status == 200 and (await r.json())["title"] is None
