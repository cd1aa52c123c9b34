"""The documents tables and the whole ingestion pipeline on a real PostgreSQL server (``STRATA_TEST_PG_URL``,
as tests/gateway/test_postgres.py: skipped without it, failed without it in CI)."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest

from gateway.db import open_db
from gateway.documents.config import RagConfig
from gateway.documents.service import RagService
from gateway.documents.store import Conflict
from tests.gateway.test_postgres import PG, pg, pg_url  # noqa: F401  (fixtures)
from tests.http_helpers import eventually


async def _ingest(svc: RagService, cid: str, name: str, data: bytes) -> str:
    doc, created = svc.store.add_document(cid, name, hashlib.sha256(data).hexdigest(), "txt", len(data))
    assert created
    svc.upload_path(doc["id"]).write_bytes(data)
    await svc.submit(doc["id"], svc.store.key_of(cid) or 0)
    d = await eventually(lambda: svc.store.get_document(doc["id"]), lambda d: d["status"] in ("ready", "failed"),
                         60, f"ingestion of {name}")
    assert d["status"] == "ready", d
    return str(doc["id"])


async def test_documents_on_postgresql(pg: PG, tmp_path: Path) -> None:  # noqa: F811
    engine = open_db(pg.url)
    svc = RagService(RagConfig(data_dir=tmp_path / "rag"), engine)
    await svc.start()
    try:
        coll = svc.store.create_collection(7, "pg", svc.embedder.version_key, 10)
        with pytest.raises(Conflict):
            svc.store.create_collection(7, "pg", svc.embedder.version_key, 10)
        assert svc.store.get_collection(8, coll["id"]) is None  # another key
        cid = coll["id"]
        first = await _ingest(svc, cid, "gate.txt", b"The gate code of the loading dock is 4711.")
        again, created = svc.store.add_document(cid, "gate.txt", hashlib.sha256(
            b"The gate code of the loading dock is 4711.").hexdigest(), "txt", 42)
        assert not created and again["id"] == first
        c = svc.store.get_collection(7, cid)
        assert c is not None and c["version"] == 1
        hits = await svc.search([c], "loading dock gate code", 3)
        assert hits[0].document_id == first and "4711" in hits[0].text

        second = await _ingest(svc, cid, "gate.txt", b"The gate code of the loading dock is now 9182.")
        c = svc.store.get_collection(7, cid)
        assert c is not None and c["version"] == 2
        texts = [h.text for h in await svc.search([c], "loading dock gate code", 5)]
        assert any("9182" in t for t in texts) and not any("4711" in t for t in texts)
        assert svc.store.get_document(first) is None

        with pytest.raises(Conflict):  # a publish built on a stale version never lands
            svc.store.publish(cid, 1, 2, "v2-stale", svc.embedder.version_key, ready={}, remove=[second])
        await svc.delete_document(cid, second)
        c = svc.store.get_collection(7, cid)
        assert c is not None and await svc.search([c], "loading dock gate code", 5) == []
        await svc.delete_collection(cid)
        assert svc.store.get_collection(7, cid) is None
        assert pg.tables() >= {"rag_collections", "rag_documents", "rag_jobs", "rag_chunks"}
    finally:
        await svc.stop()
        await asyncio.to_thread(engine.dispose)
