"""Documents and retrieval through the whole stack (supervisord, the real gateway process, two real lanes
with the default model): upload -> search -> chat with citations; chats keep the gateway's usual added
latency while a 200-page PDF is ingested; the gateway SIGKILLed mid-ingestion comes back serving the
previous version and resumes the document.

The tests share one stack and run in file order.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.gateway.documents.helpers import auth, create_collection, document, search, upload, wait_done
from tests.gateway.documents.samples import make_docx, make_pdf
from tests.http_helpers import eventually, sse
from tests.integration.conftest import ADMIN_KEY, Stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FIRE_Q = "Where do warehouse workers assemble if there is a fire?"
BIG_PAGES = 200


def _admin_key(stack: Stack, name: str) -> str:
    req = urllib.request.Request(stack.gateway_url + "/v1/admin/keys", data=json.dumps({"name": name}).encode(),
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(json.loads(r.read())["key"])


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def env(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("rag")
    async with aiohttp.ClientSession() as s:
        key = _admin_key(stack, "rag-user")
        cid = (await create_collection(s, stack.gateway_url, key, "handbook"))["id"]
        yield {"s": s, "key": key, "cid": cid, "tmp": tmp, "url": stack.gateway_url}


async def test_upload_search_chat_with_citations(env: dict[str, Any]) -> None:
    s, url, key, cid, tmp = env["s"], env["url"], env["key"], env["cid"], env["tmp"]
    pdf = make_pdf(tmp / "safety.pdf", ["Site safety handbook for contractors.", "Visitors sign in at the desk.",
                                        "In case of fire, warehouse staff gather at the north parking lot beside "
                                        "the flagpole."])
    docx = make_docx(tmp / "boiler.docx", "Boiler rules", ["Limits of the heating plant."],
                     [["Setting", "Limit"], ["maximum boiler pressure", "42 bar"]])
    for name, path in (("safety.pdf", pdf), ("boiler.docx", docx)):
        status, doc = await upload(s, url, key, cid, name, path)
        assert status == 202, doc
        assert (await wait_done(s, url, key, cid, doc["id"]))["status"] == "ready"
    hits = await search(s, url, key, cid, FIRE_Q, top_k=3)
    assert hits[0]["document"] == "safety.pdf" and hits[0]["page"] == 3 and "flagpole" in hits[0]["text"]
    hits = await search(s, url, key, cid, "How high may the boiler pressure go?", top_k=3)
    assert hits[0]["document"] == "boiler.docx" and "42 bar" in hits[0]["text"]

    body = {"messages": [{"role": "user", "content": FIRE_Q}], "collections": ["handbook"], "max_tokens": 16,
            "temperature": 0}
    async with s.post(f"{url}/v1/chat/completions", json=body, headers=auth(key)) as r:
        data = await r.json()
        assert r.status == 200, data
        assert r.headers["X-Strata-Rag-Passages"].startswith(str(len(data["citations"])))
    assert data["citations"][0]["document"] == "safety.pdf" and data["citations"][0]["page"] == 3
    assert data["choices"][0]["message"]["content"]
    async with s.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, headers=auth(key)) as r:
        events = [ln[6:] for ln in await sse(r) if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["citations"][0]["page"] == 3


async def _timed(s: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> float:
    body = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "temperature": 0}
    t0 = time.perf_counter()
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        await r.read()
        assert r.status == 200
    return time.perf_counter() - t0


async def _added_latency(stack: Stack, s: aiohttp.ClientSession, key: str, n: int,
                         until: Any = None) -> tuple[float, float, int]:
    """(median over pairs of gateway - direct lane time of the same 1-token chat, p90 of a lane-free gateway
    request, pairs); stops early when ``until()``. Pairs cancel the lanes' own slowdown under load."""
    added, probe = [], []
    lane_urls = [stack.url("lane_a"), stack.url("lane_b")]
    for i in range(n):
        lane = await _timed(s, lane_urls[i % 2], {})
        added.append(await _timed(s, stack.gateway_url, auth(key)) - lane)
        t0 = time.perf_counter()
        async with s.get(stack.gateway_url + "/v1/models", headers=auth(key)) as r:
            assert r.status == 200
        probe.append(time.perf_counter() - t0)
        if until is not None and i % 4 == 3 and await until():
            break
    probe.sort()
    return statistics.median(added), probe[int(0.9 * (len(probe) - 1))], len(added)


def _big_pages(tag: str) -> list[str]:
    return [" ".join(f"Ledger {tag} page {p} line {i}: crate {p * 37 + i} of type {i % 9} left dock {p % 12}."
                     for i in range(10)) for p in range(BIG_PAGES)]


async def test_ingesting_200_pages_leaves_chat_latency_alone_then_kill_and_resume(stack: Stack,
                                                                                 env: dict[str, Any]) -> None:
    s, url, key, cid, tmp = env["s"], env["url"], env["key"], env["cid"], env["tmp"]
    pages = _big_pages("A")
    pages[149] += " The vault combination is written on the blue card in drawer nine."
    big = make_pdf(tmp / "ledger.pdf", pages)
    async with s.get(f"{url}/v1/collections/{cid}", headers=auth(key)) as r:
        version = (await r.json())["version"]

    before, probe_before, n_before = await _added_latency(stack, s, key, 16)
    status, doc = await upload(s, url, key, cid, "ledger.pdf", big)
    assert status == 202
    did = doc["id"]

    async def finished() -> bool:
        return (await document(s, url, key, cid, did))["status"] in ("ready", "failed")

    during, probe_during, n_during = await _added_latency(stack, s, key, 24, finished)
    print(f"gateway added latency, median of paired 1-token chats: {before * 1000:.1f} ms without ingestion "
          f"({n_before} pairs), {during * 1000:.1f} ms while a {BIG_PAGES}-page PDF is ingested ({n_during} pairs); "
          f"GET /v1/models p90: {probe_before * 1000:.1f} ms / {probe_during * 1000:.1f} ms")
    assert n_during >= 8, "ingestion finished before enough samples were taken"

    def calm(before: float, probe_before: float) -> bool:
        # extraction or embedding on the event loop would add a slice's forward pass or more to most requests;
        # the slack is the noise of a shared box
        return during <= max(2 * before, before + 0.075) and probe_during <= max(3 * probe_before, 0.050)

    # judged at the end: a baseline that missed a burst of load on the shared box is measured again there
    calm_at_first = calm(before, probe_before)

    # SIGKILL the gateway while the document is embedding: supervisord restarts it
    d = await eventually(lambda: document(s, url, key, cid, did), lambda d: d["status"] != "extracting"
                         and d["status"] != "queued", 120, "extraction of the big PDF")
    assert d["status"] == "embedding", d
    pid = int(stack.ctl("pid", "gateway").stdout.strip())
    os.kill(pid, signal.SIGKILL)
    stack.wait_gateway()
    assert int(stack.ctl("pid", "gateway").stdout.strip()) != pid
    # the previous version is served at once, without the half-ingested document
    async with s.get(f"{url}/v1/collections/{cid}", headers=auth(key)) as r:
        assert (await r.json())["version"] == version
    hits = await search(s, url, key, cid, FIRE_Q, top_k=3)
    assert hits[0]["document"] == "safety.pdf"
    assert not any(h["document"] == "ledger.pdf" for h in await search(s, url, key, cid, "vault combination", 10))
    # the document was resumed (a second attempt), not lost
    d = await wait_done(s, url, key, cid, did, within=300)
    assert d["status"] == "ready" and d["pages"] == BIG_PAGES and d["job"]["attempts"] == 2, d
    hits = await search(s, url, key, cid, "Where can I find the vault combination?", top_k=3)
    assert hits[0]["document"] == "ledger.pdf" and hits[0]["page"] == 150, hits[0]
    assert not list(Path(stack.dir / "var" / "rag" / "uploads").iterdir())  # the upload is gone once ingested

    if not calm_at_first:
        # nothing is being ingested now: the figure without ingestion once more, the higher of the two counts
        after, probe_after, n_after = await _added_latency(stack, s, key, 16)
        print(f"baseline again after ingestion: {after * 1000:.1f} ms added ({n_after} pairs), GET /v1/models p90 "
              f"{probe_after * 1000:.1f} ms")
        before, probe_before = max(before, after), max(probe_before, probe_after)
    assert calm(before, probe_before), (before, during, probe_before, probe_during)
