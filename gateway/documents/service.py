"""The documents service: ingestion jobs, index versions and search, for the API and the chat path.

Ingestion of one document (one at a time on a background task; the keys' queues are served in
turn, each in upload order, so one key's hundred uploads do not stall another key's one):

    queued -> extracting (child process) -> embedding (chunks, then vectors on the embed thread, while the
           child extracts the next pages of a PDF)
           -> a new collection version is built (worker thread) and published (one SQL transaction)
           -> ready;   any error on the way -> failed with the reason, the collection untouched.

A slice whose encode fails with EmbedError (the embedding model's process died; a new one is started) is
encoded again once per document, by the new process; a second failure fails the document. Nothing is saved
before every chunk has its vector, so a failed document leaves no vectors, chunks or index behind.

A restarted gateway re-queues every document whose job never finished (its upload is kept
until then) and fails one that was interrupted ``MAX_ATTEMPTS`` times or whose upload is gone.
The served version is whatever the collection row names: a half-built directory is never named.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import re
import shutil
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy import Engine

from gateway.documents.chunk import Chunk, chunk_blocks, text_length
from gateway.documents.config import RagConfig
from gateway.documents.embed import SLICE, Embedder, EmbedError, get_embedder, single_threaded_blas
from gateway.documents.extract import Block, Extracted, ExtractionError, ExtractLimits, extract_stream
from gateway.documents.index import IndexVersion, Mode, build_version, load_version, prune_versions
from gateway.documents.store import ChunkRow, Conflict, DocStore

__all__ = ["BM25_DOWN", "BM25_ONLY", "MAX_ATTEMPTS", "Passage", "RagService"]

log = logging.getLogger("strata.gateway.documents")

MAX_ATTEMPTS = 3
BM25_ONLY = "retrieval=bm25 (embedding model not loaded)"  # the note of a hybrid search served by BM25 alone
BM25_DOWN = "retrieval=bm25 (embedding model failed; restarting)"  # ... because the query's encode failed
_BATCH_DOCS = 32  # documents published together at most
_BATCH_S = 10.0  # how long the first of them may wait for the others


class FairQueue:
    """Documents waiting for ingestion: a FIFO per key, the keys served in turn (round robin)."""

    def __init__(self) -> None:
        self._queues: OrderedDict[int, deque[str]] = OrderedDict()  # key -> its documents; the next key first
        self._ready = asyncio.Event()

    def put_nowait(self, did: str, key_id: int) -> None:
        self._queues.setdefault(key_id, deque()).append(did)
        self._ready.set()

    def empty(self) -> bool:
        return not self._queues

    def qsize(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def get_nowait(self) -> str:
        if not self._queues:
            raise asyncio.QueueEmpty
        key_id, q = next(iter(self._queues.items()))
        did = q.popleft()
        del self._queues[key_id]
        if q:
            self._queues[key_id] = q  # to the back: the other keys go first
        if not self._queues:
            self._ready.clear()
        return did

    async def get(self) -> str:
        while not self._queues:
            await self._ready.wait()
        return self.get_nowait()


@dataclass
class Passage:
    chunk_id: str
    document_id: str
    document: str
    collection_id: str
    page: int | None
    heading: list[str]
    char_start: int
    char_end: int
    text: str
    score: float
    dense_score: float | None = None
    bm25_score: float | None = None

    def public(self) -> dict[str, Any]:
        return asdict(self)

    def citation(self, n: int) -> dict[str, Any]:
        return {"index": n, "document": self.document, "document_id": self.document_id, "page": self.page,
                "chunk_id": self.chunk_id, "collection_id": self.collection_id, "score": round(self.score, 6),
                "heading": self.heading, "char_start": self.char_start, "char_end": self.char_end}


def _model_tag(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class RagService:
    def __init__(self, cfg: RagConfig, db: Engine, embedder: Embedder | None = None) -> None:
        self.cfg = cfg
        self.root = cfg.resolved_data_dir()
        self.uploads = self.root / "uploads"
        self.uploads.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.store = DocStore(db)
        single_threaded_blas()
        self.embedder = embedder or get_embedder(cfg.embed_model, threads=cfg.embed_threads, batch=cfg.embed_batch,
                                                   backend=cfg.embed_backend, precision=cfg.embed_precision)
        self.limits = ExtractLimits(max_pages=cfg.max_pdf_pages, max_chars=cfg.max_extracted_chars,
                                    max_uncompressed_bytes=cfg.max_uncompressed_bytes,
                                    max_ratio=cfg.max_compression_ratio, max_stream_bytes=cfg.max_stream_bytes,
                                    timeout_s=cfg.extract_timeout_s, memory_mb=cfg.extract_memory_mb)
        self.queue = FairQueue()
        self.current: str | None = None  # the document being ingested
        self._task: asyncio.Task[None] | None = None  # its ingestion
        # the indexes of recently searched collections (least recently used first, at most index_cache_size) and
        # the locks of collections being changed (gone with their last user): neither grows with every collection
        self._cache: OrderedDict[str, IndexVersion] = OrderedDict()
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()
        self._worker: asyncio.Task[None] | None = None
        self.embed_retries = 0  # slices encoded again after an EmbedError (the model's process died)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for doc in await asyncio.to_thread(self.store.unfinished):
            did = doc["id"]
            if doc["attempts"] >= MAX_ATTEMPTS:
                await asyncio.to_thread(self.store.set_status, did, "failed", reason=(
                    f"ingestion was interrupted {doc['attempts']} times (the gateway stopped while working on it)"))
                self._drop_upload(did)
            elif not self.upload_path(did).is_file():
                await asyncio.to_thread(self.store.set_status, did, "failed",
                                        reason="the upload was lost when the gateway stopped; upload it again")
            else:
                log.info("documents: resuming ingestion of %s (%s, attempt %d)", did, doc["name"], doc["attempts"] + 1)
                await asyncio.to_thread(self.store.set_status, did, "queued", progress=0.0)
                key = await asyncio.to_thread(self.store.key_of, doc["collection_id"])
                self.queue.put_nowait(did, key if key is not None else -1)
        for tmp in self.uploads.glob("upload-*"):  # a request cut off mid-upload
            tmp.unlink(missing_ok=True)
        self._worker = asyncio.create_task(self._run(), name="documents-ingest")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        # the embedder is shared by the process (get_embedder): it outlives this service

    def upload_path(self, did: str) -> Path:
        return self.uploads / did

    def _drop_upload(self, did: str) -> None:
        self.upload_path(did).unlink(missing_ok=True)

    def _vectors_path(self, cid: str, did: str) -> Path:
        return self.root / "collections" / cid / "vectors" / f"{did}.{_model_tag(self.embedder.version_key)}.npy"

    def _lock(self, cid: str) -> asyncio.Lock:
        lock = self._locks.get(cid)
        if lock is None:
            lock = self._locks[cid] = asyncio.Lock()
        return lock

    # ------------------------------------------------------------------ ingestion
    async def submit(self, did: str, key_id: int) -> None:
        self.queue.put_nowait(did, key_id)

    async def _run(self) -> None:
        """Ingest queued documents one by one; documents of one collection that were queued together are
        published as one new version (a version per document would rebuild the index once per upload)."""
        while True:
            did = await self.queue.get()
            batch: list[tuple[str, str, int]] = []
            t0 = time.monotonic()
            while True:
                prepared = await self._prepare(did)
                if prepared is not None:
                    if batch and batch[0][0] != prepared[0]:
                        await self._publish_batch(batch)
                        batch = []
                    batch.append(prepared)
                if self.queue.empty() or len(batch) >= _BATCH_DOCS or time.monotonic() - t0 > _BATCH_S:
                    break
                did = self.queue.get_nowait()
            if batch:
                await self._publish_batch(batch)

    async def _prepare(self, did: str) -> tuple[str, str, int] | None:
        """Extract, chunk and embed one document: (collection, document, chunks), or None when it failed or
        is gone. Never raises (but for its own cancellation)."""
        self.current = did
        self._task = asyncio.create_task(self._ingest(did), name=f"ingest-{did}")
        try:
            return await asyncio.shield(self._task)
        except asyncio.CancelledError:
            if not self._task.cancelled():  # the worker itself is being stopped
                self._task.cancel()
                raise
            log.info("documents: ingestion of %s stopped (the document was deleted)", did)
        except Exception as e:  # never kill the worker: the document fails, the next one goes on
            log.exception("documents: ingestion of %s failed: %s", did, type(e).__name__)
            await self._fail(did, "internal error while ingesting the document (the gateway's log has the details)")
        finally:
            self.current = None
            self._task = None
        return None

    async def _fail(self, did: str, reason: str) -> None:
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.store.set_status, did, "failed", reason=reason)
        self._drop_upload(did)

    async def _publish_batch(self, batch: list[tuple[str, str, int]]) -> None:
        cid = batch[0][0]
        try:
            published = await self.publish(cid, ready={did: n for _, did, n in batch})
        except Conflict as e:  # the collection was deleted meanwhile
            log.info("documents: %d document(s) not published: %s", len(batch), e)
            return
        except Exception as e:
            log.exception("documents: publishing %d document(s) to %s failed", len(batch), cid)
            for _, did, _n in batch:
                await self._fail(did, f"internal error while indexing the document ({type(e).__name__}; the "
                                      "gateway's log has the details)")
            return
        for did in published:
            self._drop_upload(did)
        log.info("documents: collection %s: %d document(s) ready", cid, len(published))

    async def _ingest(self, did: str) -> tuple[str, str, int] | None:
        """Extract, chunk and embed one document, pipelined: the child process reads a PDF's next pages while
        this process chunks and embeds the pages it has sent (a chunk never spans two pages, so the parts chunk
        exactly as the whole would). Nothing is saved until the extraction has succeeded."""
        st = self.store
        doc = await asyncio.to_thread(st.get_document, did)
        if doc is None or doc["status"] not in ("queued", "extracting", "embedding"):
            return None
        cid = doc["collection_id"]
        if not await asyncio.to_thread(st.set_status, did, "extracting", progress=2.0, start=True):
            return None
        loop = asyncio.get_running_loop()
        parts: asyncio.Queue[tuple[list[Block], int, int] | None] = asyncio.Queue()
        stop = threading.Event()

        def on_part(blocks: list[Block], done: int, total: int) -> None:  # the extraction thread
            loop.call_soon_threadsafe(parts.put_nowait, (blocks, done, total))

        extraction = asyncio.ensure_future(asyncio.to_thread(extract_stream, self.upload_path(did), doc["format"],
                                                             self.limits, on_part, stop))
        def finished(f: asyncio.Future[Extracted]) -> None:
            # after the thread's last part (both reach the loop in the order the thread scheduled them)
            parts.put_nowait(None)
            if not f.cancelled():
                f.exception()  # retrieved here too: an ingestion that stopped early never awaits it

        extraction.add_done_callback(finished)
        chunks: list[Chunk] = []
        vectors: list[np.ndarray] = []
        offset = 0
        embedded = 0.0  # share of the document's pages embedded
        shown = [0.0]  # the progress last written
        retry = [True]  # one slice of the document may be encoded again after an EmbedError

        async def progress(n: int, of: int, lo: float, hi: float) -> None:
            pct = 10.0 + 85.0 * (lo + (hi - lo) * n / max(1, of))  # 95 embedded, 97 saved, 100 published
            if pct - shown[0] >= 5:
                shown[0] = pct
                await asyncio.to_thread(st.set_status, did, "embedding", progress=pct)

        try:
            while (item := await parts.get()) is not None:
                blocks, done, total = item
                while not parts.empty() and len(blocks) < 4 * SLICE:  # take what queued up meanwhile: fuller batches
                    more = parts.get_nowait()
                    if more is None:
                        parts.put_nowait(None)
                        break
                    blocks, done, total = blocks + more[0], more[1], more[2]
                new = await asyncio.to_thread(chunk_blocks, blocks, self.embedder.count_tokens, self.cfg.chunk_tokens,
                                              self.cfg.chunk_overlap, offset=offset, ordinal=len(chunks))
                offset += text_length(blocks)
                if not shown[0]:
                    if not await asyncio.to_thread(st.set_status, did, "embedding", progress=10.0, pages=total or None):
                        return None
                    shown[0] = 10.0
                share = done / total if total else 1.0
                vectors.append(await self._encode(did, [c.embed_text() for c in new], retry,
                                                  functools.partial(progress, lo=embedded, hi=share)))
                embedded = share
                chunks += new
            extracted = await extraction
        except ExtractionError as e:
            log.info("documents: %s (%s) failed extraction: %s", did, doc["name"], e)
            await self._fail(did, str(e))
            return None
        except EmbedError as e:
            log.error("documents: %s (%s): embedding failed again after a retry: %s", did, doc["name"], e)
            await self._fail(did, "the embedding model failed twice while embedding this document, the second "
                                  "time on a retry; upload it again")
            return None
        finally:
            stop.set()  # a cancelled ingestion (the document was deleted) stops the child at its next part
        if not chunks:
            await self._fail(did, "no text found in the document")
            return None
        rows = [{"id": f"{did}-{c.ordinal}", "ordinal": c.ordinal, "page": c.page, "heading": c.heading,
                 "char_start": c.char_start, "char_end": c.char_end, "tokens": c.tokens, "text": c.text}
                for c in chunks]
        await asyncio.to_thread(self._save_vectors, cid, did, np.concatenate(vectors))
        await asyncio.to_thread(st.save_chunks, did, cid, rows)
        if not await asyncio.to_thread(st.set_status, did, "embedding", progress=97.0, pages=extracted.pages,
                                       n_chunks=len(chunks)):
            return None
        log.info("documents: %s (%s) embedded: %s pages, %d chunks", did, doc["name"], extracted.pages, len(chunks))
        return cid, did, len(chunks)

    async def _encode(self, did: str, texts: list[str], retry: list[bool],
                      progress: Callable[[int, int], Awaitable[None]]) -> np.ndarray:
        """``texts``' vectors, a slice at a time as Embedder.aencode batches them (longest first), so a slice
        cut off by the model's process dying is encoded again alone (once per document: ``retry[0]``), after
        the new process has loaded; EmbedError when that retry fails too (or the model cannot load)."""
        total = len(texts)
        order = sorted(range(total), key=lambda i: -len(texts[i]))
        out = np.zeros((total, self.embedder.dim), dtype=np.float32)
        for i in range(0, total, SLICE):
            part = order[i:i + SLICE]
            batch = [texts[j] for j in part]
            try:
                out[part] = await self.embedder.aencode(batch)
            except EmbedError as e:
                if not retry[0]:
                    raise
                retry[0] = False
                self.embed_retries += 1
                log.warning("documents: %s: a slice of %d chunks failed to embed (%s); encoding it again", did,
                            len(batch), e)
                out[part] = await self.embedder.aencode(batch)  # waits for the new process's load
            await progress(min(total, i + SLICE), total)
        return out

    def _save_vectors(self, cid: str, did: str, vectors: np.ndarray) -> None:
        path = self._vectors_path(cid, did)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            np.save(f, vectors)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _vectors(self, cid: str, did: str, rows: list[ChunkRow]) -> np.ndarray:
        """A document's chunk vectors; re-embedded from the stored chunk text when missing or of another model."""
        path = self._vectors_path(cid, did)
        if path.is_file():
            v = np.load(path)
            if v.shape == (len(rows), self.embedder.dim):
                return v
        texts = [r.embed_text() for r in rows]
        try:
            v = self.embedder.encode(texts)
        except EmbedError as e:  # the model's process died: once more, with the new one
            self.embed_retries += 1
            log.warning("documents: re-embedding %s failed (%s); trying again", did, e)
            v = self.embedder.encode(texts)
        self._save_vectors(cid, did, v)
        return v

    def _build(self, cid: str, version: int, docs: list[str]) -> tuple[str, int]:
        rows = self.store.chunk_rows(document_ids=docs) if docs else []
        by_doc: dict[str, list[ChunkRow]] = {}
        for r in rows:
            by_doc.setdefault(r.document_id, []).append(r)
        ids: list[str] = []
        texts: list[str] = []
        vecs: list[np.ndarray] = []
        for did in docs:
            rs = by_doc.get(did, [])
            if not rs:
                continue
            vecs.append(self._vectors(cid, did, rs))
            ids += [r.id for r in rs]
            texts += [r.embed_text() for r in rs]
        matrix = np.concatenate(vecs) if vecs else np.zeros((0, self.embedder.dim), dtype=np.float32)
        name = build_version(self.root, cid, version, ids, matrix, texts, self.embedder.version_key,
                             hnsw_above=self.cfg.hnsw_above)
        return name, len(ids)

    async def publish(self, cid: str, *, ready: dict[str, int] | None = None,
                      remove: list[str] | None = None) -> list[str]:
        """Build and serve a new version of ``cid``: its ready documents, plus ``ready`` (document id -> chunks),
        minus ``remove`` and minus older documents with the name of a ``ready`` one. Returns the ``ready``
        documents published (those deleted meanwhile are left out). Raises Conflict when the collection is gone."""
        remove = list(remove or [])
        async with self._lock(cid):
            for _attempt in range(5):
                coll = await asyncio.to_thread(self.store.get_collection, None, cid)
                if coll is None:
                    raise Conflict("the collection was deleted")
                docs = await asyncio.to_thread(self.store.ready_documents, cid)
                new = []
                for did in ready or {}:
                    d = await asyncio.to_thread(self.store.get_document, did, cid)
                    if d is not None:
                        new.append(d)
                new.sort(key=lambda d: (d["created"], d["id"]))
                latest = {d["name"]: d["id"] for d in new}  # two versions of one name in a batch: the newer wins
                drop = set(remove) | {d["id"] for d in new if latest[d["name"]] != d["id"]}
                drop |= {d["id"] for d in docs if d["name"] in latest and d["id"] not in latest.values()}
                adding = [d["id"] for d in new if d["id"] not in drop]
                keep = [d["id"] for d in docs if d["id"] not in drop and d["id"] not in adding] + adding
                if ready and not adding and not remove:
                    return []  # everything it was asked to add is gone: no new version
                version = coll["version"] + 1
                name, _ = await asyncio.to_thread(self._build, cid, version, keep)
                try:
                    await asyncio.to_thread(self.store.publish, cid, coll["version"], version, name,
                                            self.embedder.version_key, ready={d: (ready or {})[d] for d in adding},
                                            remove=sorted(drop))
                except Conflict:
                    shutil.rmtree(self.root / "collections" / cid / name, ignore_errors=True)
                    continue  # another gateway published first, or a document went away: build again
                for did in drop:
                    self._forget_vectors(cid, did)
                    self._drop_upload(did)
                self._cache.pop(cid, None)
                keep_dirs = {name} | ({coll["index_dir"]} if coll["index_dir"] else set())
                await asyncio.to_thread(prune_versions, self.root, cid, keep_dirs, below=version)
                return adding
            raise Conflict("the collection kept changing while its index was being built; try again")

    def _forget_vectors(self, cid: str, did: str) -> None:
        base = self.root / "collections" / cid / "vectors"
        for p in base.glob(f"{did}.*.npy"):
            p.unlink(missing_ok=True)

    # ------------------------------------------------------------------ deletes
    async def delete_document(self, cid: str, did: str) -> None:
        doc = await asyncio.to_thread(self.store.get_document, did, cid)
        if doc is None:
            return
        if doc["status"] == "ready":
            await self.publish(cid, remove=[did])  # the version without it, and its rows, in one step
        else:
            if self.current == did and self._task is not None:
                self._task.cancel()  # stops between embedding batches; an extraction child ends on its own limits
            await asyncio.to_thread(self.store.delete_document, did)
            self._forget_vectors(cid, did)
        self._drop_upload(did)

    async def delete_collection(self, cid: str) -> None:
        async with self._lock(cid):
            dids = await asyncio.to_thread(self.store.delete_collection, cid)
            self._cache.pop(cid, None)
            for did in dids:
                self._drop_upload(did)
            await asyncio.to_thread(shutil.rmtree, self.root / "collections" / cid, True)

    # ------------------------------------------------------------------ search
    async def _index(self, coll: dict[str, Any]) -> IndexVersion | None:
        name = coll.get("index_dir")
        if not name:
            return None
        cached = self._cache.get(coll["id"])
        if cached is not None and cached.path.name == name:
            self._cache.move_to_end(coll["id"])
            return cached
        try:
            idx = await asyncio.to_thread(load_version, self.root, coll["id"], name)
        except FileNotFoundError:
            log.error("documents: collection %s names index %s, which is missing under %s (is the data "
                      "directory shared by every gateway?)", coll["id"], name, self.root)
            return None
        self._cache[coll["id"]] = idx
        self._cache.move_to_end(coll["id"])
        while len(self._cache) > self.cfg.index_cache_size:
            self._cache.popitem(last=False)
        return idx

    def serving_mode(self, mode: Mode) -> tuple[Mode, str]:
        """The mode a search runs in now and, when that is not the one asked for, why (for a response header).
        A new gateway's embedding model takes tens of seconds to load; the chunks' BM25 index needs no model,
        so ``hybrid`` is served from BM25 alone until then instead of stalling the request. ``dense`` cannot
        be served without the model and waits for it."""
        if mode == "hybrid" and not self.embedder.ready:
            return "bm25", BM25_ONLY
        return mode, ""

    async def retrieve(self, colls: list[dict[str, Any]], query: str, k: int,
                       mode: Mode = "hybrid") -> tuple[list[Passage], Mode, str]:
        """:meth:`search` in the mode :meth:`serving_mode` gives: (passages, mode served, note). A hybrid search
        whose query encode fails (EmbedError: the model's process died and is being restarted) is served from
        BM25 alone with the note ``BM25_DOWN``, as while the model loads; ``dense`` raises it."""
        served, note = self.serving_mode(mode)
        try:
            return await self.search(colls, query, k, served), served, note
        except EmbedError as e:
            if served != "hybrid":
                raise
            log.warning("documents: a query's embedding failed (%s); served from BM25 alone", e)
            return await self.search(colls, query, k, "bm25"), "bm25", BM25_DOWN

    async def search(self, colls: list[dict[str, Any]], query: str, k: int, mode: Mode = "hybrid") -> list[Passage]:
        """The best ``k`` passages over ``colls`` (collection rows), best first. Callers that must not wait for
        the embedding model pass the mode :meth:`serving_mode` gives."""
        indexes = [(c, await self._index(c)) for c in colls]
        indexes = [(c, i) for c, i in indexes if i is not None and len(i)]
        if not indexes or k < 1 or not query.strip():
            return []
        qvec = None
        if mode != "bm25":
            qvec = await self.embedder.aencode_query(query)
        hits = []
        for c, idx in indexes:
            m: Mode = mode if idx.model == self.embedder.version_key else "bm25"  # other model: not comparable
            for h in await asyncio.to_thread(idx.search, qvec, query, k, m):
                hits.append((c, h))
        hits.sort(key=lambda ch: -ch[1].score)
        hits = hits[:k]
        rows = {r.id: r for r in await asyncio.to_thread(self.store.chunk_rows, ids=[h.chunk_id for _, h in hits])}
        out = []
        for c, h in hits:
            r = rows.get(h.chunk_id)
            if r is None:  # published away between the index load and now
                continue
            out.append(Passage(r.id, r.document_id, r.document, c["id"], r.page, r.heading, r.char_start, r.char_end,
                               r.text, h.score, h.dense_score, h.bm25_score))
        return out

    async def reindex_stale(self) -> None:
        """Rebuild collections whose served version was built with another embedding model."""
        # kept small: collections are listed per key, so walk the rows directly
        from sqlalchemy import select

        from gateway.documents.store import collections

        def stale() -> list[str]:
            with self.store.db.connect() as conn:
                return list(conn.execute(select(collections.c.id).where(
                    collections.c.version > 0, collections.c.model != self.embedder.version_key)).scalars())

        for cid in await asyncio.to_thread(stale):
            log.info("documents: collection %s was indexed with another embedding model; re-embedding", cid)
            with contextlib.suppress(Conflict):
                await self.publish(cid)


def safe_filename(name: str) -> str:
    """A display name for an upload: the last path component, printable, at most 255 characters."""
    base = re.split(r"[\\/]", name)[-1]
    base = "".join(ch for ch in base if ch.isprintable()).strip()
    return base[:255] or "upload"
