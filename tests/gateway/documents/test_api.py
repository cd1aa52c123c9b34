"""The documents API on a real gateway (in-process, real SQLite, real embedding model; no lane needed)."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from sqlalchemy import update

from gateway.documents.api import RAG, default_data_dir
from gateway.documents.service import MAX_ATTEMPTS
from gateway.documents.store import documents, jobs
from tests.gateway.conftest import GW, gateway_config, running_gateway
from tests.gateway.documents.helpers import auth, create_collection, search, upload, wait_done
from tests.gateway.documents.samples import billion_laughs_docx, make_docx, make_pdf, pdf_bomb, zip_bomb_docx
from tests.http_helpers import eventually

NO_LANE = [{"name": "a", "url": "http://127.0.0.1:9"}]  # nothing listens: these tests need no lane


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[GW]:
    cfg = gateway_config(tmp_path, NO_LANE, rag={"max_upload_bytes": 8 << 20, "extract_timeout_s": 30})
    async with running_gateway(cfg) as g:
        yield g


def corpus(tmp: Path) -> dict[str, tuple[Path, str, str, int | None]]:
    """filename -> (file, paraphrased question, fact word that must be in the top passage, page)."""
    pages = ["Chapter one covers the history of the company and its founders in 1987.",
             "Chapter two lists the regional offices: Oslo, Lisbon and Kraków.",
             "Chapter three: the emergency assembly point for the warehouse is the north parking lot, "
             "next to the flagpole."]
    docx = make_docx(tmp / "boiler.docx", "Boiler handbook", ["Operating rules for the heating plant."],
                     [["Setting", "Value"], ["maximum boiler pressure", "42 bar"], ["flue temperature", "180 C"]])
    md = tmp / "travel.md"
    md.write_text("# Travel policy\n\nEmployees book trains for trips under 500 km.\n\n## Meals\n\n"
                  "The daily meal allowance abroad is 65 euros.\n")
    html = tmp / "it.html"
    html.write_text("<html><body><h1>IT rules</h1><p>Passwords are rotated every 90 days.</p>"
                    "<script>var secret='do not index';</script><p>The Wi-Fi guest network is called "
                    "Lighthouse.</p></body></html>")
    txt = tmp / "canteen.txt"
    txt.write_text("The canteen serves vegetarian lasagna every Thursday.\n\nCoffee is free before 9 am.\n")
    return {
        "handbook.pdf": (make_pdf(tmp / "handbook.pdf", pages), "where do warehouse staff gather in an "
                         "emergency?", "flagpole", 3),
        "boiler.docx": (docx, "how high can the boiler pressure go?", "42 bar", None),
        "travel.md": (md, "how much money do I get for food per day on a trip abroad?", "65 euros", None),
        "it.html": (html, "what is the name of the visitor wireless network?", "Lighthouse", None),
        "canteen.txt": (txt, "what weekday is the meat-free lasagna on the menu?", "Thursday", None),
    }


async def test_collections_are_per_key(gw: GW) -> None:
    a, b = gw.key("a"), gw.key("b")
    async with aiohttp.ClientSession() as s:
        coll = await create_collection(s, gw.url, a, "handbook")
        assert coll["id"].startswith("col_") and coll["name"] == "handbook" and coll["version"] == 0
        async with s.post(f"{gw.url}/v1/collections", json={"name": "handbook"}, headers=auth(a)) as r:
            assert r.status == 409 and (await r.json())["error"]["code"] == "collection_exists"
        async with s.post(f"{gw.url}/v1/collections", json={"name": "../x"}, headers=auth(a)) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "name"
        async with s.post(f"{gw.url}/v1/collections", json={"name": "x", "bad": 1}, headers=auth(a)) as r:
            assert r.status == 400
        other = await create_collection(s, gw.url, b, "handbook")  # the same name under another key
        assert other["id"] != coll["id"]
        async with s.get(f"{gw.url}/v1/collections", headers=auth(a)) as r:
            assert [c["id"] for c in (await r.json())["data"]] == [coll["id"]]
        status, doc = await upload(s, gw.url, a, coll["id"], "n.txt", b"key A's private note about zebras")
        assert status == 202
        await wait_done(s, gw.url, a, coll["id"], doc["id"])
        cid, did = coll["id"], doc["id"]
        for method, path, body in [("GET", f"/v1/collections/{cid}", None), ("DELETE", f"/v1/collections/{cid}", None),
                                   ("GET", f"/v1/collections/{cid}/documents", None),
                                   ("GET", f"/v1/collections/{cid}/documents/{did}", None),
                                   ("DELETE", f"/v1/collections/{cid}/documents/{did}", None),
                                   ("POST", f"/v1/collections/{cid}/search", {"query": "zebras"}),
                                   ("GET", f"/v1/collections/{other['id']}/documents/{did}", None)]:
            async with s.request(method, gw.url + path, json=body, headers=auth(b)) as r:
                err = (await r.json())["error"]
                assert r.status == 404, (method, path)
                assert err["code"] in ("collection_not_found", "document_not_found")
        status, _ = await upload(s, gw.url, b, cid, "x.txt", b"intruder")
        assert status == 404
        assert [p["document_id"] for p in await search(s, gw.url, a, cid, "zebras")] == [did]
        async with s.get(f"{gw.url}/v1/collections/handbook", headers=auth(a)) as r:  # by name, per key
            assert (await r.json())["id"] == cid
        async with s.delete(f"{gw.url}/v1/collections/{cid}", headers=auth(a)) as r:
            assert r.status == 200
        async with s.get(f"{gw.url}/v1/collections/{cid}", headers=auth(a)) as r:
            assert r.status == 404
        assert not (default_data_dir(gw.state.config.db_url) / "collections" / cid).exists()
        async with s.get(f"{gw.url}/v1/collections", headers={}) as r:
            assert r.status == 401


async def test_every_format_found_by_paraphrase_then_versions_and_delete(gw: GW, tmp_path: Path) -> None:
    key = gw.key("k")
    docs = corpus(tmp_path)
    async with aiohttp.ClientSession() as s:
        coll = await create_collection(s, gw.url, key, "handbook")
        cid = coll["id"]
        ids: dict[str, str] = {}
        for name, (path, *_rest) in docs.items():
            status, doc = await upload(s, gw.url, key, cid, name, path)
            assert status == 202 and doc["status"] == "queued" and doc["job"]["status"] == "queued", doc
            ids[name] = doc["id"]
        done = {name: await wait_done(s, gw.url, key, cid, did) for name, did in ids.items()}
        for d in done.values():
            assert d["status"] == "ready" and d["progress"] == 100 and d["chunks"] >= 1, d
            assert d["job"]["status"] == "ready" and d["job"]["attempts"] == 1
        assert done["handbook.pdf"]["pages"] == 3
        for name, (_p, question, fact, page) in docs.items():
            hits = await search(s, gw.url, key, cid, question, top_k=3)
            top = hits[0]
            assert top["document"] == name and fact in top["text"], (name, question, hits)
            assert top["page"] == page
            assert top["collection_id"] == cid and top["chunk_id"].startswith(ids[name])
            assert top["char_end"] > top["char_start"] >= 0
        # the same bytes again: the same document, nothing re-ingested
        status, again = await upload(s, gw.url, key, cid, "boiler.docx", docs["boiler.docx"][0])
        assert status == 200 and again["id"] == ids["boiler.docx"] and again["chunks"] == done["boiler.docx"]["chunks"]
        # a new version (same name, new content) replaces the old one atomically
        v2 = make_docx(tmp_path / "boiler2.docx", "Boiler handbook", ["Operating rules for the heating plant."],
                       [["Setting", "Value"], ["maximum boiler pressure", "37 bar"]])
        status, new = await upload(s, gw.url, key, cid, "boiler.docx", v2)
        assert status == 202 and new["id"] != ids["boiler.docx"]
        assert (await wait_done(s, gw.url, key, cid, new["id"]))["status"] == "ready"
        hits = await search(s, gw.url, key, cid, "how high can the boiler pressure go?", top_k=10)
        assert "37 bar" in hits[0]["text"]
        assert not any("42 bar" in h["text"] for h in hits)
        async with s.get(f"{gw.url}/v1/collections/{cid}/documents/{ids['boiler.docx']}", headers=auth(key)) as r:
            assert r.status == 404  # the old version is gone
        # delete: no passage from it any more
        async with s.delete(f"{gw.url}/v1/collections/{cid}/documents/{ids['travel.md']}", headers=auth(key)) as r:
            assert r.status == 200
        hits = await search(s, gw.url, key, cid, "how much money do I get for food per day on a trip abroad?",
                            top_k=20)
        assert hits and not any(h["document"] == "travel.md" for h in hits)
        async with s.get(f"{gw.url}/v1/collections/{cid}/documents", headers=auth(key)) as r:
            names = sorted(d["name"] for d in (await r.json())["data"])
        assert names == ["boiler.docx", "canteen.txt", "handbook.pdf", "it.html"]
        for mode in ("dense", "bm25"):
            hits = await search(s, gw.url, key, cid, "Lighthouse guest network", top_k=2, mode=mode)
            assert hits[0]["document"] == "it.html"


async def test_hostile_uploads_fail_cleanly_while_serving(gw: GW, tmp_path: Path) -> None:
    key = gw.key("k")
    base = make_docx(tmp_path / "base.docx", "H", ["text"])
    good = make_pdf(tmp_path / "good.pdf", ["The launch code word is PELICAN."]).read_bytes()
    async with aiohttp.ClientSession() as s:
        coll = await create_collection(s, gw.url, key, "c")
        cid = coll["id"]
        status, doc = await upload(s, gw.url, key, cid, "good.pdf", good)
        assert (await wait_done(s, gw.url, key, cid, doc["id"]))["status"] == "ready"
        async with s.get(f"{gw.url}/v1/collections/{cid}", headers=auth(key)) as r:
            version = (await r.json())["version"]

        # refused at the door
        for name, data, code, status_want in [
                ("empty.txt", b"", "empty_file", 400),
                ("tool.exe", b"MZ\x90\x00" * 10, "unsupported_file_type", 415),
                ("fake.pdf", b"PK\x03\x04" + b"\x00" * 64, "unsupported_file_type", 415),
                ("big.txt", b"a" * ((8 << 20) + 1), "request_too_large", 413)]:
            st, body = await upload(s, gw.url, key, cid, name, data)
            assert st == status_want and body["error"]["code"] == code, (name, body)
        st, body = await upload(s, gw.url, key, cid, "tool.exe", b"MZ")
        assert "supported: PDF (.pdf), Word (.docx)" in body["error"]["message"]
        async with s.post(f"{gw.url}/v1/collections/{cid}/documents", json={"file": "x"}, headers=auth(key)) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_upload"

        # accepted, then failed with a reason, one after another on the ingestion worker
        hostile = {"bomb.pdf": (pdf_bomb(tmp_path / "bomb.pdf", 2.0), "too large when decompressed"),
                   "zip.docx": (zip_bomb_docx(tmp_path / "zip.docx", base, 0.3), "unpacks to"),
                   "lol.docx": (billion_laughs_docx(tmp_path / "lol.docx", base), "DTD or entities"),
                   "cut.pdf": (good[: len(good) // 2], "not a readable PDF|no text"),
                   "bin.txt": (b"\x00\x01binary" * 100, "not text|binary")}
        started: dict[str, str] = {}
        for name, (data, _why) in hostile.items():
            st, body = await upload(s, gw.url, key, cid, name, data)
            if st == 415:  # detected at the door: also a clean refusal
                started[name] = ""
                continue
            assert st == 202, (name, body)
            started[name] = body["id"]
        # the gateway keeps answering while they are processed
        slowest = 0.0
        pending = {n for n, d in started.items() if d}
        deadline = time.monotonic() + 120
        while pending and time.monotonic() < deadline:
            t0 = time.monotonic()
            async with s.get(f"{gw.url}/healthz") as r:
                assert r.status == 200
            slowest = max(slowest, time.monotonic() - t0)
            for name in list(pending):
                async with s.get(f"{gw.url}/v1/collections/{cid}/documents/{started[name]}", headers=auth(key)) as r:
                    d = await r.json()
                if d["status"] in ("ready", "failed"):
                    pending.discard(name)
                    assert d["status"] == "failed", (name, d)
                    assert re.search(hostile[name][1], d["reason"]), (name, d["reason"])
                    assert d["job"]["status"] == "failed"
            await asyncio.sleep(0.05)
        assert not pending, pending
        assert slowest < 1.0, f"/healthz took {slowest:.2f}s during hostile ingestion"
        async with s.get(f"{gw.url}/v1/collections/{cid}", headers=auth(key)) as r:
            assert (await r.json())["version"] == version  # failures never touched the collection
        hits = await search(s, gw.url, key, cid, "what is the launch code word?")
        assert "PELICAN" in hits[0]["text"]


async def test_restart_resumes_or_fails_unfinished_jobs(tmp_path: Path) -> None:
    cfg = gateway_config(tmp_path, NO_LANE)
    async with running_gateway(cfg) as g:
        key = g.key("k")
        async with aiohttp.ClientSession() as s:
            cid = (await create_collection(s, g.url, key, "c"))["id"]
            _, first = await upload(s, g.url, key, cid, "a.txt", b"The old fact: the gate code is 1234.")
            await wait_done(s, g.url, key, cid, first["id"])
            svc = g.app[RAG]
            svc._worker.cancel()  # type: ignore[union-attr]  # stands for a gateway stopped mid-ingestion
            _, second = await upload(s, g.url, key, cid, "b.txt", b"The new fact: the lobby opens at 7.")
            _, third = await upload(s, g.url, key, cid, "c.txt", b"A third fact: the roof is green.")
            # the second looks cut off mid-embedding; the third was interrupted too often
            db = g.state.db
            assert db is not None
            with db.begin() as conn:
                conn.execute(update(documents).where(documents.c.id == second["id"]).values(status="embedding",
                                                                                           progress=40.0))
                conn.execute(update(jobs).where(jobs.c.document_id == third["id"]).values(attempts=MAX_ATTEMPTS))
            before = await search(s, g.url, key, cid, "gate code")
            assert before and before[0]["document"] == "a.txt"
    async with running_gateway(cfg) as g:
        async with aiohttp.ClientSession() as s:
            # the previous version is served at once
            assert (await search(s, g.url, key, cid, "gate code"))[0]["document"] == "a.txt"
            d2 = await wait_done(s, g.url, key, cid, second["id"])
            assert d2["status"] == "ready" and d2["job"]["attempts"] == 1
            d3 = await wait_done(s, g.url, key, cid, third["id"])
            assert d3["status"] == "failed" and "interrupted" in d3["reason"]
            hits = await search(s, g.url, key, cid, "when does the lobby open?")
            assert hits[0]["document"] == "b.txt"
            assert not any(h["document"] == "c.txt" for h in await search(s, g.url, key, cid, "roof colour", 10))


async def test_embeddings_endpoint(gw: GW) -> None:
    key = gw.key("k")
    async with aiohttp.ClientSession() as s:
        async def post(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with s.post(f"{gw.url}/v1/embeddings", json=body, headers=auth(key)) as r:
                return r.status, await r.json()

        st, body = await post({"input": ["the cat sat", "a feline was sitting"], "model": "all-MiniLM-L6-v2"})
        assert st == 200, body
        assert body["object"] == "list" and body["model"] == "all-MiniLM-L6-v2"
        assert [d["index"] for d in body["data"]] == [0, 1] and len(body["data"][0]["embedding"]) == 384
        a, b = body["data"][0]["embedding"], body["data"][1]["embedding"]
        assert sum(x * y for x, y in zip(a, b, strict=True)) > 0.5
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
        st, body = await post({"input": "hello", "encoding_format": "base64"})
        assert st == 200 and isinstance(body["data"][0]["embedding"], str)
        assert (await post({"input": "x", "model": "text-embedding-3-small"}))[0] == 404
        assert (await post({"input": []}))[0] == 400
        assert (await post({"input": [""]}))[0] == 400
        assert (await post({"input": "x", "dimensions": 99}))[0] == 400
        assert (await post({"nope": 1}))[0] == 400


async def test_delete_during_ingestion_stops_it(gw: GW) -> None:
    key = gw.key("k")
    big = "\n\n".join(" ".join(f"Paragraph {i} sentence {j} about shipping crates." for j in range(12))
                      for i in range(300)).encode()
    async with aiohttp.ClientSession() as s:
        cid = (await create_collection(s, gw.url, key, "c"))["id"]
        _, doc = await upload(s, gw.url, key, cid, "big.txt", big)
        url = f"{gw.url}/v1/collections/{cid}/documents/{doc['id']}"

        async def status() -> str:
            async with s.get(url, headers=auth(key)) as r:
                return str((await r.json())["status"])

        await eventually(status, lambda st: st == "embedding", 60, "embedding to start", interval=0.02)
        async with s.delete(url, headers=auth(key)) as r:
            assert r.status == 200
        async with s.get(url, headers=auth(key)) as r:
            assert r.status == 404
        svc = gw.app[RAG]
        await eventually(lambda: svc.current, lambda cur: cur is None, 30, "the worker to let go of it")
        _, small = await upload(s, gw.url, key, cid, "small.txt", b"The next document still gets ingested.")
        assert (await wait_done(s, gw.url, key, cid, small["id"]))["status"] == "ready"
        hits = await search(s, gw.url, key, cid, "shipping crates paragraph", 10)
        assert all(h["document"] == "small.txt" for h in hits)


@pytest.mark.parametrize("rag,why", [({"enabled": False}, "disabled in this gateway's config"),
                                     ({"embed_model": "/nonexistent/model"}, "unavailable on this gateway (its log")])
async def test_documents_unavailable_is_a_typed_503(tmp_path: Path, rag: dict[str, Any], why: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    async with running_gateway(gateway_config(tmp_path, NO_LANE, rag=rag)) as g, aiohttp.ClientSession() as s:
        key = g.key("k")
        for method, path in (("POST", "/v1/collections"), ("GET", "/v1/collections"), ("POST", "/v1/embeddings")):
            async with s.request(method, g.url + path, json={"name": "x", "input": "x"}, headers=auth(key)) as r:
                err = (await r.json())["error"]
                assert r.status == 503 and err["code"] == "documents_unavailable" and why in err["message"]
                assert "/nonexistent" not in err["message"]  # the server's paths stay in its log
        if "embed_model" in rag:
            assert any("no sentence-transformers model" in r.getMessage() for r in caplog.records)
        async with s.get(g.url + "/healthz") as r:
            assert r.status == 200  # the rest of the gateway serves


async def test_index_cache_stays_bounded(tmp_path: Path) -> None:
    """Issue 31: the service keeps at most `index_cache_size` collections' indexes loaded (least recently searched
    dropped first), and a collection whose index was dropped is loaded again on its next search."""
    cfg = gateway_config(tmp_path, NO_LANE, rag={"index_cache_size": 2})
    async with running_gateway(cfg) as g, aiohttp.ClientSession() as s:
        key = g.key("k")
        svc = g.app[RAG]
        cids = []
        for i, word in enumerate(("amber", "cobalt", "saffron")):
            cid = (await create_collection(s, g.url, key, f"c{i}"))["id"]
            _, doc = await upload(s, g.url, key, cid, f"{word}.txt", f"The {word} crate is on shelf {i}.".encode())
            assert (await wait_done(s, g.url, key, cid, doc["id"]))["status"] == "ready"
            cids.append(cid)
        for cid, word in zip(cids, ("amber", "cobalt", "saffron"), strict=True):
            hits = await search(s, g.url, key, cid, f"{word} crate", 3, mode="bm25")
            assert hits and word in hits[0]["text"]
            assert len(svc._cache) <= 2
        assert list(svc._cache) == cids[1:]  # the least recently searched one went first
        hits = await search(s, g.url, key, cids[0], "amber crate", 3, mode="bm25")
        assert hits and "amber" in hits[0]["text"]
        assert list(svc._cache) == [cids[2], cids[0]]
