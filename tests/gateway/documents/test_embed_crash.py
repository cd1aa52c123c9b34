"""The embedding model's process dying under the documents service: an ingestion encodes the cut-off slice again
with the new process (a second failure fails the document and leaves nothing behind), and a search or a chat's
retrieval whose query encode fails is served from BM25 alone with a note, as while the model loads (dense: a
typed 503)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from gateway.documents.api import RAG
from gateway.documents.chat import prepare
from gateway.documents.embed import Embedder, EmbedError, _Child
from gateway.documents.service import BM25_DOWN, RagService
from tests.gateway.conftest import GW, gateway_config, running_gateway
from tests.gateway.documents.helpers import auth, create_collection, search, upload, wait_done

NO_LANE = [{"name": "a", "url": "http://127.0.0.1:9"}]  # nothing listens: these tests need no lane
# ~200-token paragraphs (one chunk each): 20 chunks, two slices (16 + 5 with the fact)
LEDGER = "\n\n".join(f"Ledger {i}: " + " ".join(f"crate {i}-{j} of type {j % 7} left dock {j % 9} on shift {i}."
                                                for j in range(18)) for i in range(20))
FACT = "\n\nThe fire assembly point of the warehouse is the north parking lot beside the flagpole.\n"


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[GW]:
    cfg = gateway_config(tmp_path, NO_LANE, rag={"extract_timeout_s": 30})
    async with running_gateway(cfg) as g:
        yield g


class _Failing:
    """The real model, but the next ``encodes`` slice encodes / ``queries`` query encodes fail as when its
    process dies."""

    def __init__(self, real: Embedder, encodes: int = 0, queries: int = 0) -> None:
        self.real, self.encodes, self.queries = real, encodes, queries

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def aencode(self, texts: Sequence[str], progress: Any = None) -> np.ndarray:
        if self.encodes:
            self.encodes -= 1
            raise EmbedError("the embedding model's process died during this request (signal 9)")
        return await self.real.aencode(texts, progress)

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self.encodes:
            self.encodes -= 1
            raise EmbedError("the embedding model's process died during this request (signal 9)")
        return self.real.encode(texts)

    async def aencode_query(self, text: str) -> np.ndarray:
        if self.queries:
            self.queries -= 1
            raise EmbedError("the embedding model's process died during this request (signal 9)")
        return await self.real.aencode_query(text)


async def test_ingestion_survives_a_kill_of_the_embedding_process(gw: GW, embedder: Embedder,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    svc: RagService = gw.app[RAG]
    own = Embedder()  # its own process (forked from the warm forkserver), killed below
    svc.embedder = own
    try:
        await own.warm()
        pid = own.child_pid
        assert pid is not None
        # The process is SIGKILLed as the first slice's encode goes to it (after the Embedder found it alive):
        # the request is in flight on a dead process on every machine, however fast its encodes are.
        real_encode = _Child.encode
        killed: list[int] = []

        def kill_then_encode(child: _Child, texts: Sequence[str]) -> np.ndarray:
            if not killed and child.pid == pid:
                os.kill(pid, signal.SIGKILL)
                child.proc.join(10)
                killed.append(pid)
            return real_encode(child, texts)

        monkeypatch.setattr(_Child, "encode", kill_then_encode)
        key = gw.key()
        async with aiohttp.ClientSession() as s:
            cid = (await create_collection(s, gw.url, key, "ledger"))["id"]
            _, doc = await upload(s, gw.url, key, cid, "ledger.md", (LEDGER + FACT).encode())
            done = await wait_done(s, gw.url, key, cid, doc["id"])
            assert killed == [pid]
            assert done["status"] == "ready", done
            assert svc.embed_retries == 1 and own.child_pid not in (None, pid)
            n = done["chunks"]
            assert n >= 20
            # every chunk has its vector: the index holds them all and a dense search finds the fact
            vecs = np.load(svc._vectors_path(cid, doc["id"]))
            assert vecs.shape == (n, own.dim) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-4)
            hits = await search(s, gw.url, key, cid, "where do we gather if there is a fire?", top_k=1, mode="dense")
            assert "flagpole" in hits[0]["text"]
            # the same vectors as an undisturbed model's (the retried slice too)
            rows = await asyncio.to_thread(svc.store.chunk_rows, document_ids=[doc["id"]])
            ref = await embedder.aencode([r.embed_text() for r in rows])
            assert float(np.abs(vecs - ref).max()) <= 1e-5
    finally:
        svc.embedder = embedder
        own.close()


async def test_a_second_failure_fails_the_document_and_leaves_nothing(gw: GW, embedder: Embedder) -> None:
    svc: RagService = gw.app[RAG]
    key = gw.key()
    async with aiohttp.ClientSession() as s:
        cid = (await create_collection(s, gw.url, key, "ledger"))["id"]
        svc.embedder = _Failing(embedder, encodes=1)  # type: ignore[assignment]
        try:  # one failure: retried, ready
            _, doc = await upload(s, gw.url, key, cid, "fire.md", FACT.encode())
            assert (await wait_done(s, gw.url, key, cid, doc["id"]))["status"] == "ready"
            assert svc.embed_retries == 1
            svc.embedder = _Failing(embedder, encodes=2)  # type: ignore[assignment]
            _, doc2 = await upload(s, gw.url, key, cid, "ledger.md", LEDGER.encode())
            failed = await wait_done(s, gw.url, key, cid, doc2["id"])
        finally:
            svc.embedder = embedder
        assert failed["status"] == "failed" and "failed twice" in failed["reason"], failed
        assert svc.embed_retries == 2
        assert not svc._vectors_path(cid, doc2["id"]).exists()
        assert await asyncio.to_thread(svc.store.chunk_rows, document_ids=[doc2["id"]]) == []
        coll = await asyncio.to_thread(svc.store.get_collection, None, cid)
        assert coll is not None and coll["version"] == 1  # the first document's version only
        # a publish that re-embeds a document whose vectors file is gone retries once as well
        path = svc._vectors_path(cid, doc["id"])
        before = np.load(path)
        path.unlink()
        svc.embedder = _Failing(embedder, encodes=1)  # type: ignore[assignment]
        try:
            await svc.publish(cid)
        finally:
            svc.embedder = embedder
        assert svc.embed_retries == 3 and float(np.abs(np.load(path) - before).max()) <= 1e-5


async def test_a_failed_query_encode_is_served_from_bm25(gw: GW, embedder: Embedder) -> None:
    svc: RagService = gw.app[RAG]
    key = gw.key()
    async with aiohttp.ClientSession() as s:
        cid = (await create_collection(s, gw.url, key, "fire"))["id"]
        _, doc = await upload(s, gw.url, key, cid, "fire.md", FACT.encode())
        assert (await wait_done(s, gw.url, key, cid, doc["id"]))["status"] == "ready"
        q = "where is the fire assembly point?"
        svc.embedder = _Failing(embedder, queries=3)  # type: ignore[assignment]
        try:
            async with s.post(f"{gw.url}/v1/collections/{cid}/search", json={"query": q}, headers=auth(key)) as r:
                found = await r.json()
                assert r.status == 200 and r.headers["X-Strata-Retrieval"] == BM25_DOWN, found
            assert found["mode"] == "bm25" and "flagpole" in found["data"][0]["text"]
            async with s.post(f"{gw.url}/v1/collections/{cid}/search", json={"query": q, "mode": "dense"},
                              headers=auth(key)) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "embedding_model_unavailable", body
            ctx = await prepare(svc, None, [cid], [{"role": "user", "content": q}], 3)  # type: ignore[arg-type]
            assert ctx.note == BM25_DOWN and "flagpole" in ctx.passages[0].text
            assert ctx.header().endswith("; " + BM25_DOWN)
        finally:
            svc.embedder = embedder
        async with s.post(f"{gw.url}/v1/collections/{cid}/search", json={"query": q}, headers=auth(key)) as r:
            assert "X-Strata-Retrieval" not in r.headers and (await r.json())["mode"] == "hybrid"
