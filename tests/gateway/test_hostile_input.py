"""Hostile values in every field of every route: a typed 4xx, never a 500, never a traceback in the log.

The routes are read from the app's router, so a new route without an entry in :data:`BODIES` (body routes) fails
the coverage test. Each body route's fields are its request model's (the lanes' own models for the generation
routes, plus the gateway's extras); each field is replaced in turn by every value of :data:`HOSTILE`, the rest of
the body staying valid. Path parameters, query strings and headers get invalid text through a raw socket (a client
library would refuse to send it). Real lanes with the default model answer what passes the gateway's checks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from pydantic import BaseModel

from gateway.app import LanePatch
from gateway.config import KEY_LIMITS
from gateway.documents.api import CollectionSpec, EmbeddingSpec, SearchSpec
from gateway.keys import KeySpec
from gateway.sessions import RenameSpec, SessionSpec
from lanes.protocol import ChatRequest, CompletionRequest
from tests.gateway.conftest import ADMIN_KEY, GW, Lane, auth, gateway_config, lane_entries, running_gateway

pytestmark = pytest.mark.asyncio(loop_scope="module")

SURROGATE = "a\ud800b"
# every kind of bad value: invalid text (alone, nested, as a key), NUL, too long, wrong types, out of range
HOSTILE: list[Any] = [SURROGATE, "\udc00", [SURROGATE], {"\ud800": 1}, {"k": SURROGATE}, "nul\x00byte", "x" * 20_000,
                      2**64, -1, 1e308, True, None, {}, []]
EXTRAS = {"session_id": str, "collections": list, "citations": bool}  # the gateway's additive generation fields


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


# route (method, path) -> (valid base body, its fields); {cid} / {sid} / {name} are filled in by the fixture
BODIES: dict[tuple[str, str], tuple[dict[str, Any], list[str]]] = {
    ("POST", "/v1/chat/completions"): ({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
                                       [*_fields(ChatRequest), *EXTRAS]),
    ("POST", "/v1/completions"): ({"prompt": "Hi", "max_tokens": 1}, [*_fields(CompletionRequest), *EXTRAS]),
    ("POST", "/v1/embeddings"): ({"input": "hello"}, _fields(EmbeddingSpec)),
    ("POST", "/v1/collections"): ({"name": "hostile"}, _fields(CollectionSpec)),
    ("POST", "/v1/collections/{cid}/search"): ({"query": "hello"}, _fields(SearchSpec)),
    ("POST", "/v1/sessions"): ({"title": "t"}, _fields(SessionSpec)),
    ("PATCH", "/v1/sessions/{sid}"): ({"title": "t"}, _fields(RenameSpec)),
    ("POST", "/v1/admin/keys"): ({"name": "hostile"}, _fields(KeySpec)),
    ("PUT", "/v1/admin/lanes/{name}"): ({"weight": 1.0}, _fields(LanePatch)),
    # the Responses and Messages APIs translate plain dicts (gateway/responses.py, gateway/messages.py)
    ("POST", "/v1/responses"): ({"input": "Hi", "max_output_tokens": 16},
                                ["input", "instructions", "model", "temperature", "top_p", "max_output_tokens", "tools",
                                 "tool_choice", "text", "previous_response_id", "store", "stream", "user",
                                 "parallel_tool_calls", "truncation", "metadata", *EXTRAS]),
    ("POST", "/v1/messages"): ({"model": "strata", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
                               ["model", "messages", "system", "max_tokens", "stop_sequences", "stream", "temperature",
                                "top_p", "top_k", "tools", "tool_choice", "metadata", *EXTRAS]),
    ("POST", "/v1/messages/count_tokens"): ({"model": "strata", "messages": [{"role": "user", "content": "Hi"}]},
                                            ["model", "messages", "system", "tools", "tool_choice"]),
}
MULTIPART = {("POST", "/v1/collections/{cid}/documents")}  # uploads: hostile file names, field names, bodies
# values a path parameter or a query value gets as raw (percent-encoded) bytes
RAW_TEXT = ["%ED%A0%80", "%00", "%FF%FE", "a" * 3000, "..%2F..%2Fetc%2Fpasswd", "%C0%AF"]


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gw(lanes: dict[str, Lane], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[GW]:
    tmp = tmp_path_factory.mktemp("hostile")
    cfg = gateway_config(tmp, lane_entries(lanes), default_max_tokens=1,
                         rag={"data_dir": str(tmp / "rag")})
    async with running_gateway(cfg) as g:
        yield g


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        yield s


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def ids(gw: GW, http: aiohttp.ClientSession) -> dict[str, str]:
    """A key, and a collection and a session of that key, for the routes that name one."""
    key = gw.key("hostile", limits=dict.fromkeys(KEY_LIMITS))  # hundreds of requests a minute: no rate limits
    async with http.post(gw.url + "/v1/collections", json={"name": "docs"}, headers=auth(key)) as r:
        assert r.status == 201, await r.text()
        cid = (await r.json())["id"]
    async with http.post(gw.url + "/v1/sessions", json={"title": "s"}, headers=auth(key)) as r:
        assert r.status == 201, await r.text()
        sid = (await r.json())["id"]
    return {"key": key, "cid": cid, "sid": sid, "name": "a"}


def _path(template: str, ids: dict[str, str]) -> str:
    """The template with its parameters filled: the fixture's ids, else a name that exists nowhere."""
    return template.format_map({"did": "doc_none", "id": "999", "model": "none", "response_id": "resp_none", **ids})


def _key_for(path: str, ids: dict[str, str]) -> str:
    return ADMIN_KEY if path.startswith("/v1/admin/") else ids["key"]


async def _send(http: aiohttp.ClientSession, method: str, url: str, key: str, body: Any) -> tuple[int, Any]:
    # ensure_ascii: a lone surrogate travels as its JSON escape, the way a client that cannot encode it sends it
    data = json.dumps(body, ensure_ascii=True).encode()
    async with http.request(method, url, data=data, headers={**auth(key), "Content-Type": "application/json"}) as r:
        raw = await r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw


def _check(status: int, payload: Any, what: str, *, surrogate: bool) -> None:
    assert status < 500, f"{what}: {status} {payload!r}"[:600]
    if status >= 400:
        assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), f"{what}: {payload!r}"[:600]
        assert "Traceback" not in payload["error"]["message"]
    if surrogate:
        assert status == 400, f"{what}: invalid text must be a 400, got {status} {payload!r}"[:600]


def _has_surrogate(value: Any) -> bool:
    return "\\ud" in json.dumps(value, ensure_ascii=True)


def _no_unhandled(caplog: pytest.LogCaptureFixture) -> None:
    bad = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "unhandled" in r.getMessage()]
    assert not bad, bad


async def test_every_route_is_walked(gw: GW) -> None:
    """A body route the walk does not know fails here: add its base body and fields to BODIES."""
    missing = []
    for route in gw.app.router.routes():
        info = route.resource.canonical if route.resource is not None else ""
        key = (route.method, info)
        if route.method in ("POST", "PUT", "PATCH") and key not in BODIES and key not in MULTIPART:
            missing.append(key)
    assert not missing, f"routes with a body that the hostile walk does not cover: {missing}"


async def test_hostile_values_in_every_body_field(gw: GW, http: aiohttp.ClientSession, ids: dict[str, str],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    cases: list[tuple[str, str, str, dict[str, Any], str]] = []
    for (method, template), (base, fields) in BODIES.items():
        path = _path(template, ids)
        for field in dict.fromkeys(fields):
            for value in HOSTILE:
                body = {**base, field: value}
                if field == "name" and template == "/v1/collections" and value is None:
                    continue
                cases.append((method, path, field, body, f"{method} {template} {field}={value!r:.40}"))
        # nested: inside the messages, a key of its own, the whole body not an object
        if "messages" in base:
            for value in (SURROGATE, "nul\x00", 12, None, ["x"]):
                for part in ("role", "content", "name"):
                    msg = {**base["messages"][0], part: value}
                    cases.append((method, path, "messages", {**base, "messages": [msg]},
                                  f"{method} {template} messages[0].{part}={value!r}"))
        cases.append((method, path, "-", {**base, "\ud800": 1}, f"{method} {template} a surrogate key"))
    sem = asyncio.Semaphore(6)

    async def one(method: str, path: str, field: str, body: Any, what: str) -> None:
        async with sem:
            status, payload = await _send(http, method, gw.url + path, _key_for(path, ids), body)
        _check(status, payload, what, surrogate=_has_surrogate(body))

    await asyncio.gather(*(one(*c) for c in cases))
    for method, template in BODIES:  # a body that is not an object, or not JSON at all
        for raw in ('"\\ud800"', "[1, 2]", "null", "{", "\xff"):
            url = gw.url + _path(template, ids)
            async with http.request(method, url, data=raw.encode("utf-8", "surrogateescape"),
                                    headers={**auth(_key_for(template, ids)), "Content-Type": "application/json"}) as r:
                payload = await r.json(content_type=None)
                _check(r.status, payload, f"{method} {template} body {raw!r}", surrogate="ud800" in raw)
    _no_unhandled(caplog)
    async with http.put(gw.url + "/v1/admin/lanes/a", json={"weight": 1.0, "drain": False},
                        headers=auth(ADMIN_KEY)) as r:  # hostile `drain: true` was valid
        assert r.status == 200


async def _raw(gw: GW, request: bytes) -> tuple[int, Any]:
    """One request over a raw socket (bytes no client library sends): the status and the body."""
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 60)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)
    except ValueError:  # the HTTP parser's own 400 (a request line or header no request may hold): plain text
        assert status == 400, (status, body)
        return status, {"error": {"message": body.decode("utf-8", "replace")}}


async def test_hostile_paths_queries_and_headers(gw: GW, ids: dict[str, str],
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    key = ids["key"].encode()
    targets: list[tuple[str, bytes]] = []
    for route in gw.app.router.routes():
        template = route.resource.canonical if route.resource is not None else ""
        if not template.startswith("/v1/") or route.method not in ("GET", "DELETE"):
            continue
        admin = template.startswith("/v1/admin/")
        for raw in RAW_TEXT:
            path = template
            for name in ("cid", "sid", "did", "id", "model", "name"):
                path = path.replace("{" + name + "}", raw)
            if path != template:
                targets.append((route.method, path.encode() + (b"?admin" if admin else b"")))
        targets.append((route.method, _path(template, ids).encode() +
                        b"?limit=%ED%A0%80&lane=%00&status=%FF&since=nan&key_id=99999999999999999999"))
    for method, target in targets:
        k = ADMIN_KEY.encode() if b"?admin" in target or target.startswith(b"/v1/admin/") else key
        status, body = await _raw(gw, method.encode() + b" " + target + b" HTTP/1.1\r\nHost: x\r\n"
                                  b"Authorization: Bearer " + k + b"\r\nConnection: close\r\n\r\n")
        _check(status, body, f"{method} {target!r}", surrogate=False)
    # headers whose bytes are not UTF-8: the session header, the key, a forwarded address, a request id
    chat = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()
    for header in (b"X-Session-Id: sess_\xed\xa0\x80", b"X-Session-Id: \xff\xfe", b"X-Session-Id: sess_a\x01b",
                   b"Authorization: Bearer sk-strata-\xed\xa0\x80", b"Authorization: \xff",
                   b"X-Forwarded-For: \xed\xa0\x80, 1.2.3.4", b"X-Request-Id: \xff"):
        auth_line = b"" if header.startswith(b"Authorization") else b"Authorization: Bearer " + key + b"\r\n"
        status, body = await _raw(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth_line + header +
                                  b"\r\nContent-Type: application/json\r\nContent-Length: " +
                                  str(len(chat)).encode() + b"\r\nConnection: close\r\n\r\n" + chat)
        _check(status, body, f"header {header!r}", surrogate=b"\xed\xa0\x80" in header and
               b"Session" in header)
    _no_unhandled(caplog)


async def test_hostile_uploads(gw: GW, http: aiohttp.ClientSession, ids: dict[str, str],
                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    url = gw.url + f"/v1/collections/{ids['cid']}/documents"
    names = [b"a\xed\xa0\x80.txt", b"nul\x00.txt", b"\xff\xfe.txt", b"../../etc/passwd.txt", b"x" * 5000 + b".txt",
             b".txt", b"a.exe", "\u202e.txt".encode()]
    for name in names:  # built by hand: a client library refuses to send these names
        body = (b'--b\r\nContent-Disposition: form-data; name="file"; filename="' + name +
                b'"\r\nContent-Type: text/plain\r\n\r\nhello world\r\n--b--\r\n')
        async with http.post(url, data=body, headers={**auth(ids["key"]),
                                                      "Content-Type": "multipart/form-data; boundary=b"}) as r:
            _check(r.status, await r.json(content_type=None), f"upload named {name[:30]!r}", surrogate=False)
    for body, ctype in ((b"--b\r\nContent-Disposition: form-data; name=\"\xed\xa0\x80\"\r\n\r\nx\r\n--b--\r\n",
                         "multipart/form-data; boundary=b"), (b"garbage", "multipart/form-data"),
                        (b"x", "multipart/form-data; boundary=\xff")):
        async with http.post(url, data=body, headers={**auth(ids["key"]), "Content-Type": ctype}) as r:
            _check(r.status, await r.json(content_type=None), f"multipart {body[:20]!r} {ctype!r}", surrogate=False)
    _no_unhandled(caplog)

