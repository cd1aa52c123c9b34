"""Documents metadata in the gateway's SQL database (SQLite or PostgreSQL): collections, documents,
ingestion jobs and chunks with their provenance.

Every call is blocking (the API runs them in worker threads). A collection's served index is
named by its row (``version`` and ``index_dir``); publishing a new one is one transaction that
compares-and-sets the version, so two gateways sharing the database never both win, and the
documents that the new version drops (deleted, or replaced by a new version of the same name)
disappear in that same transaction.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Column,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    case,
    delete,
    func,
    insert,
    select,
    text,
    update,
)
from sqlalchemy.exc import IntegrityError

__all__ = ["ACTIVE", "Conflict", "DocStore", "chunks", "collections", "documents", "jobs", "rag_metadata"]

_SCHEMA_LOCK = 0x5374726174610011  # pg_advisory_xact_lock key for creating these tables
ACTIVE = ("queued", "extracting", "embedding")  # a job in one of these is not finished

rag_metadata = MetaData()

collections = Table(
    "rag_collections", rag_metadata,
    Column("id", String(40), primary_key=True),
    Column("key_id", Integer, nullable=False),
    Column("name", String(128), nullable=False),
    Column("created", Float, nullable=False),
    Column("version", Integer, nullable=False, default=0),  # 0: no index yet (nothing ready)
    Column("index_dir", String(64), nullable=True),  # the served version's directory name
    Column("model", String(160), nullable=False),  # model key the index was built with (name:dim)
    UniqueConstraint("key_id", "name", name="uq_rag_collections_key_name"),
)

documents = Table(
    "rag_documents", rag_metadata,
    Column("id", String(40), primary_key=True),
    Column("collection_id", String(40), nullable=False),
    Column("name", String(512), nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("format", String(16), nullable=False),
    Column("bytes", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("reason", Text, nullable=True),
    Column("progress", Float, nullable=False, default=0.0),
    Column("pages", Integer, nullable=True),
    Column("chunks", Integer, nullable=True),
    Column("created", Float, nullable=False),
    Column("updated", Float, nullable=False),
    Index("ix_rag_documents_collection", "collection_id", "sha256"),
)

jobs = Table(
    "rag_jobs", rag_metadata,
    Column("id", String(40), primary_key=True),
    Column("document_id", String(40), nullable=False, index=True),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, default=0),
    Column("created", Float, nullable=False),
    Column("started", Float, nullable=True),
    Column("finished", Float, nullable=True),
    Column("error", Text, nullable=True),
)

chunks = Table(
    "rag_chunks", rag_metadata,
    Column("id", String(64), primary_key=True),  # <document id>-<ordinal>
    Column("document_id", String(40), nullable=False, index=True),
    Column("collection_id", String(40), nullable=False, index=True),
    Column("ordinal", Integer, nullable=False),
    Column("page", Integer, nullable=True),
    Column("heading", Text, nullable=False),  # JSON list: the heading path
    Column("char_start", Integer, nullable=False),
    Column("char_end", Integer, nullable=False),
    Column("tokens", Integer, nullable=False),
    Column("text", Text, nullable=False),
)


class Conflict(Exception):
    """A unique name taken, or a version published by someone else first."""


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _clip(s: str, n: int) -> str:
    return s.replace("\x00", "")[:n]


@dataclass
class ChunkRow:
    id: str
    document_id: str
    document: str  # the document's name
    ordinal: int
    page: int | None
    heading: list[str]
    char_start: int
    char_end: int
    text: str

    def embed_text(self) -> str:
        return (" > ".join(self.heading) + "\n" + self.text) if self.heading else self.text


class DocStore:
    def __init__(self, engine: Engine) -> None:
        self.db = engine
        with engine.begin() as conn:
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK})
            rag_metadata.create_all(conn)

    # ------------------------------------------------------------------ collections
    def create_collection(self, key_id: int, name: str, model: str, limit: int) -> dict[str, Any]:
        row = {"id": _id("col"), "key_id": key_id, "name": name, "created": time.time(), "version": 0,
               "index_dir": None, "model": model}
        with self.db.begin() as conn:
            n = conn.execute(select(func.count()).select_from(collections).where(collections.c.key_id == key_id)).scalar()
            if n is not None and n >= limit:
                raise Conflict(f"this key already has {n} collections (the limit is {limit})")
            try:
                conn.execute(insert(collections).values(**row))
            except IntegrityError:
                raise Conflict(f"a collection named {name!r} already exists") from None
        return row

    def list_collections(self, key_id: int) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            rows = conn.execute(select(collections).where(collections.c.key_id == key_id)
                                .order_by(collections.c.created)).mappings().all()
            counts = dict(conn.execute(
                select(documents.c.collection_id, func.count()).where(
                    documents.c.collection_id.in_([r["id"] for r in rows])).group_by(documents.c.collection_id)).all())
        return [dict(r, documents=counts.get(r["id"], 0)) for r in rows]

    def get_collection(self, key_id: int | None, ref: str) -> dict[str, Any] | None:
        """By id, or by name within the key; ``key_id`` None: any key (internal use)."""
        q = select(collections).where((collections.c.id == ref) | (collections.c.name == ref))
        if key_id is not None:
            q = q.where(collections.c.key_id == key_id)
        with self.db.connect() as conn:
            rows = conn.execute(q).mappings().all()
        by_id = [r for r in rows if r["id"] == ref]
        r = by_id[0] if by_id else (rows[0] if rows else None)
        return dict(r) if r is not None else None

    def delete_collection(self, cid: str) -> list[str]:
        """Remove the collection and everything in it; returns its document ids."""
        with self.db.begin() as conn:
            dids = list(conn.execute(select(documents.c.id).where(documents.c.collection_id == cid)).scalars())
            conn.execute(delete(chunks).where(chunks.c.collection_id == cid))
            if dids:
                conn.execute(delete(jobs).where(jobs.c.document_id.in_(dids)))
            conn.execute(delete(documents).where(documents.c.collection_id == cid))
            conn.execute(delete(collections).where(collections.c.id == cid))
        return dids

    # ------------------------------------------------------------------ documents and jobs
    def add_document(self, cid: str, name: str, sha256: str, fmt: str, size: int) -> tuple[dict[str, Any], bool]:
        """(document with its job, created). The same bytes already in the collection (and not failed) are
        the same document: nothing new is made."""
        now = time.time()
        with self.db.begin() as conn:
            same = conn.execute(select(documents.c.id).where(
                documents.c.collection_id == cid, documents.c.sha256 == sha256,
                documents.c.status != "failed")).scalars().first()
            if same is not None:
                existing = self._document(conn, same)
                assert existing is not None
                return existing, False
            did = _id("doc")
            conn.execute(insert(documents).values(
                id=did, collection_id=cid, name=_clip(name, 512), sha256=sha256, format=fmt, bytes=size,
                status="queued", reason=None, progress=0.0, pages=None, chunks=None, created=now, updated=now))
            conn.execute(insert(jobs).values(id=_id("job"), document_id=did, status="queued", attempts=0,
                                             created=now))
            doc = self._document(conn, did)
        assert doc is not None
        return doc, True

    def _document(self, conn: Any, did: str) -> dict[str, Any] | None:
        r = conn.execute(select(documents).where(documents.c.id == did)).mappings().first()
        if r is None:
            return None
        job = conn.execute(select(jobs).where(jobs.c.document_id == did).order_by(jobs.c.created.desc())
                           ).mappings().first()
        return dict(r, job=dict(job) if job is not None else None)

    def get_document(self, did: str, cid: str | None = None) -> dict[str, Any] | None:
        with self.db.connect() as conn:
            d = self._document(conn, did)
        if d is None or (cid is not None and d["collection_id"] != cid):
            return None
        return d

    def list_documents(self, cid: str) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            rows = conn.execute(select(documents).where(documents.c.collection_id == cid)
                                .order_by(documents.c.created)).mappings().all()
        return [dict(r) for r in rows]

    def set_status(self, did: str, status: str, *, progress: float | None = None, reason: str | None = None,
                   pages: int | None = None, n_chunks: int | None = None, start: bool = False) -> bool:
        """False when the document is gone (deleted while it was being ingested)."""
        now = time.time()
        values: dict[str, Any] = {"status": status, "updated": now}
        if progress is not None:
            values["progress"] = round(float(progress), 1)
        if reason is not None:
            values["reason"] = _clip(reason, 2000)
        if pages is not None:
            values["pages"] = pages
        if n_chunks is not None:
            values["chunks"] = n_chunks
        with self.db.begin() as conn:
            n = conn.execute(update(documents).where(documents.c.id == did).values(**values)).rowcount
            jv: dict[str, Any] = {"status": status}
            if start:
                jv["attempts"] = jobs.c.attempts + 1
                jv["started"] = now
            if status in ("ready", "failed"):
                jv["finished"] = now
            if reason is not None:
                jv["error"] = _clip(reason, 2000)
            conn.execute(update(jobs).where(jobs.c.document_id == did, jobs.c.status.notin_(("ready", "failed")))
                         .values(**jv))
        return bool(n)

    def key_usage(self, key_id: int) -> tuple[int, int, int]:
        """(documents, their upload bytes, those waiting for or in ingestion) in all of a key's collections."""
        with self.db.connect() as conn:
            row = conn.execute(
                select(func.count(documents.c.id), func.coalesce(func.sum(documents.c.bytes), 0),
                       func.coalesce(func.sum(case((documents.c.status.in_(ACTIVE), 1), else_=0)), 0))
                .select_from(documents.join(collections, collections.c.id == documents.c.collection_id))
                .where(collections.c.key_id == key_id)).one()
        return int(row[0]), int(row[1]), int(row[2])

    def key_of(self, cid: str) -> int | None:
        with self.db.connect() as conn:
            return conn.execute(select(collections.c.key_id).where(collections.c.id == cid)).scalar()

    def unfinished(self) -> list[dict[str, Any]]:
        """Documents whose job never finished (queued, or cut off by a stop), oldest first, with attempts."""
        with self.db.connect() as conn:
            rows = conn.execute(select(documents, jobs.c.attempts).join(jobs, jobs.c.document_id == documents.c.id)
                                .where(documents.c.status.in_(ACTIVE)).order_by(documents.c.created)).mappings().all()
        return [dict(r) for r in rows]

    def save_chunks(self, did: str, cid: str, rows: Iterable[dict[str, Any]]) -> None:
        with self.db.begin() as conn:
            conn.execute(delete(chunks).where(chunks.c.document_id == did))
            batch = [dict(r, document_id=did, collection_id=cid, heading=json.dumps(r["heading"], ensure_ascii=False),
                          text=r["text"].replace("\x00", "")) for r in rows]
            if batch:
                conn.execute(insert(chunks), batch)

    # ------------------------------------------------------------------ versions
    def ready_documents(self, cid: str) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            return [dict(r) for r in conn.execute(
                select(documents).where(documents.c.collection_id == cid, documents.c.status == "ready")
                .order_by(documents.c.created, documents.c.id)).mappings().all()]

    def chunk_rows(self, *, document_ids: list[str] | None = None, ids: list[str] | None = None) -> list[ChunkRow]:
        q = select(chunks, documents.c.name).join(documents, documents.c.id == chunks.c.document_id)
        if document_ids is not None:
            q = q.where(chunks.c.document_id.in_(document_ids))
        if ids is not None:
            q = q.where(chunks.c.id.in_(ids))
        with self.db.connect() as conn:
            rows = conn.execute(q.order_by(chunks.c.document_id, chunks.c.ordinal)).mappings().all()
        return [ChunkRow(r["id"], r["document_id"], r["name"], r["ordinal"], r["page"], json.loads(r["heading"]),
                         r["char_start"], r["char_end"], r["text"]) for r in rows]

    def publish(self, cid: str, expected_version: int, version: int, index_dir: str, model: str, *,
                ready: dict[str, int], remove: list[str]) -> None:
        """Make ``index_dir`` the served version, mark ``ready`` (document id -> chunks) ready and drop
        ``remove``, atomically. Raises Conflict when the collection moved on, or it or a ``ready`` document
        was deleted meanwhile (then nothing changes)."""
        now = time.time()
        with self.db.begin() as conn:
            n = conn.execute(update(collections).where(collections.c.id == cid,
                                                       collections.c.version == expected_version)
                             .values(version=version, index_dir=index_dir, model=model)).rowcount
            if n != 1:
                raise Conflict("the collection changed while its index was being built")
            for did, n_chunks in ready.items():
                m = conn.execute(update(documents).where(documents.c.id == did).values(
                    status="ready", progress=100.0, updated=now, chunks=n_chunks, reason=None)).rowcount
                if m != 1:  # deleted meanwhile: undo the whole publish
                    raise Conflict("a document was deleted while it was being ingested")
                conn.execute(update(jobs).where(jobs.c.document_id == did, jobs.c.status.notin_(("ready", "failed")))
                             .values(status="ready", finished=now))
            if remove:
                conn.execute(delete(chunks).where(chunks.c.document_id.in_(remove)))
                conn.execute(delete(jobs).where(jobs.c.document_id.in_(remove)))
                conn.execute(delete(documents).where(documents.c.id.in_(remove)))

    def delete_document(self, did: str) -> None:
        """Remove a document that no served version contains (failed, or still being ingested)."""
        with self.db.begin() as conn:
            conn.execute(delete(chunks).where(chunks.c.document_id == did))
            conn.execute(delete(jobs).where(jobs.c.document_id == did))
            conn.execute(delete(documents).where(documents.c.id == did))
