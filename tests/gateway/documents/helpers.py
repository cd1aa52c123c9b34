"""HTTP helpers of the documents tests: upload, wait for ingestion, search."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp

from tests.http_helpers import eventually


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def create_collection(s: aiohttp.ClientSession, url: str, key: str, name: str) -> dict[str, Any]:
    async with s.post(f"{url}/v1/collections", json={"name": name}, headers=auth(key)) as r:
        body = await r.json()
        assert r.status == 201, body
        return body


async def upload(s: aiohttp.ClientSession, url: str, key: str, cid: str, filename: str,
                 data: bytes | Path) -> tuple[int, dict[str, Any]]:
    raw = data.read_bytes() if isinstance(data, Path) else data
    form = aiohttp.FormData()
    form.add_field("file", raw, filename=filename, content_type="application/octet-stream")
    async with s.post(f"{url}/v1/collections/{cid}/documents", data=form, headers=auth(key)) as r:
        return r.status, await r.json()


async def document(s: aiohttp.ClientSession, url: str, key: str, cid: str, did: str) -> dict[str, Any]:
    async with s.get(f"{url}/v1/collections/{cid}/documents/{did}", headers=auth(key)) as r:
        body = await r.json()
        assert r.status == 200, body
        return body


async def wait_done(s: aiohttp.ClientSession, url: str, key: str, cid: str, did: str,
                    within: float = 120.0) -> dict[str, Any]:
    return await eventually(lambda: document(s, url, key, cid, did), lambda d: d["status"] in ("ready", "failed"),
                            within, f"ingestion of {did}", interval=0.1)


async def search(s: aiohttp.ClientSession, url: str, key: str, cid: str, query: str, top_k: int = 5,
                 **kw: Any) -> list[dict[str, Any]]:
    async with s.post(f"{url}/v1/collections/{cid}/search", json={"query": query, "top_k": top_k, **kw},
                      headers=auth(key)) as r:
        body = await r.json()
        assert r.status == 200, body
        return body["data"]
