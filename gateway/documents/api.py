"""HTTP API of documents and retrieval (every route per key: another key's collection is a 404).

    POST   /v1/collections                          {"name"}            -> 201 the collection
    GET    /v1/collections                                              -> the key's collections
    GET    /v1/collections/{id}                                         -> one (id or name)
    DELETE /v1/collections/{id}                                         -> it and its documents gone
    POST   /v1/collections/{id}/documents           multipart "file"    -> 202 the document + job (200: same bytes)
    GET    /v1/collections/{id}/documents                               -> its documents
    GET    /v1/collections/{id}/documents/{doc}                         -> status, progress, pages, chunks
    DELETE /v1/collections/{id}/documents/{doc}                         -> gone from every index
    POST   /v1/collections/{id}/search              {"query", "top_k"}  -> ranked passages with provenance
    POST   /v1/embeddings                           OpenAI-compatible
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Literal

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy.engine import make_url

from gateway.documents.config import RagConfig
from gateway.documents.embed import EmbedError
from gateway.documents.extract import FileTypeError, detect_format
from gateway.documents.service import RagService, safe_filename
from gateway.documents.store import Conflict
from gateway.errors import APIError
from gateway.state import GATEWAY, PRINCIPAL, body_timeout, json_body

__all__ = ["RAG", "add_routes", "get_rag", "rag_context"]

log = logging.getLogger("strata.gateway.documents")

RAG = web.AppKey("strata_rag", RagService)
_DISABLED = web.AppKey("strata_rag_disabled", str)


def rag_context(cfg: RagConfig) -> Any:
    """A cleanup_ctx: the service starts after the gateway's database (append it after the gateway's own)."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        if not cfg.enabled:
            app[_DISABLED] = "documents and retrieval are disabled in this gateway's config ([rag] enabled = false)"
            yield
            return
        gw = app[GATEWAY]
        assert gw.db is not None
        svc_cfg = cfg if cfg.data_dir is not None else cfg.model_copy(
            update={"data_dir": default_data_dir(gw.config.db_url)})
        try:
            svc = await asyncio.to_thread(RagService, svc_cfg, gw.db)
        except Exception as e:  # e.g. the embedding model's package is not installed
            log.error("documents and retrieval are off: %s: %s", type(e).__name__, e)
            app[_DISABLED] = "documents and retrieval are unavailable on this gateway (its log says why)"
            yield
            return
        app[RAG] = svc
        await svc.start()
        loop = asyncio.get_running_loop()
        # searches are BM25-only until the model is loaded: load it now, not on the first upload (a no-op
        # when session memory has already started loading the same shared model)
        tasks = [loop.create_task(svc.embedder.warm(), name="documents-embed-warm"),
                 loop.create_task(svc.reindex_stale(), name="documents-reindex")]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await svc.stop()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    return ctx


def default_data_dir(db_url: str) -> Path:
    """Beside a SQLite database file (``<dir>/rag``), else ``var/rag`` in the repository."""
    try:
        u = make_url(db_url)
        if u.get_backend_name() == "sqlite" and u.database and u.database != ":memory:" and \
                not u.database.startswith("file:"):
            return Path(u.database).resolve().parent / "rag"
    except Exception:
        pass
    return Path(__file__).resolve().parents[2] / "var" / "rag"


def get_rag(request: web.Request) -> RagService:
    svc = request.app.get(RAG)
    if svc is None:
        raise APIError(503, request.app.get(_DISABLED) or "documents and retrieval are not ready",
                       code="documents_unavailable")
    return svc


def add_routes(app: web.Application) -> None:
    r = app.router
    r.add_post("/v1/collections", create_collection)
    r.add_get("/v1/collections", list_collections)
    r.add_get("/v1/collections/{cid}", get_collection)
    r.add_delete("/v1/collections/{cid}", delete_collection)
    r.add_post("/v1/collections/{cid}/documents", upload_document)
    r.add_get("/v1/collections/{cid}/documents", list_documents)
    r.add_get("/v1/collections/{cid}/documents/{did}", get_document)
    r.add_delete("/v1/collections/{cid}/documents/{did}", delete_document)
    r.add_post("/v1/collections/{cid}/search", search)
    r.add_post("/v1/embeddings", embeddings)


# ---------------------------------------------------------------------------------------- helpers


class CollectionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._-]{0,127}$")


class SearchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    query: str = Field(min_length=1, max_length=8000)
    top_k: int = Field(5, ge=1, le=1000)
    mode: Literal["hybrid", "dense", "bm25"] = "hybrid"


class EmbeddingSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def _key_id(request: web.Request) -> int:
    return request[PRINCIPAL].id


def _coll_public(c: dict[str, Any]) -> dict[str, Any]:
    out = {"id": c["id"], "object": "collection", "name": c["name"], "created": int(c["created"]),
           "version": c["version"], "embedding_model": c["model"]}
    if "documents" in c:
        out["documents"] = c["documents"]
    return out


def _doc_public(d: dict[str, Any]) -> dict[str, Any]:
    job = d.get("job")
    out = {"id": d["id"], "object": "document", "collection_id": d["collection_id"], "name": d["name"],
           "format": d["format"], "bytes": d["bytes"], "sha256": d["sha256"], "status": d["status"],
           "reason": d["reason"], "progress": d["progress"], "pages": d["pages"], "chunks": d["chunks"],
           "created": int(d["created"]), "updated": d["updated"]}
    if job is not None:
        out["job"] = {"id": job["id"], "status": job["status"], "attempts": job["attempts"]}
    return out


async def _collection(request: web.Request, svc: RagService) -> dict[str, Any]:
    ref = request.match_info["cid"]
    coll = await asyncio.to_thread(svc.store.get_collection, _key_id(request), ref)
    if coll is None:  # another key's collection looks exactly like a missing one
        raise APIError(404, f"no collection {ref!r}", code="collection_not_found", param="collection")
    return coll


async def _document(request: web.Request, svc: RagService, coll: dict[str, Any]) -> dict[str, Any]:
    did = request.match_info["did"]
    doc = await asyncio.to_thread(svc.store.get_document, did, coll["id"])
    if doc is None:
        raise APIError(404, f"no document {did!r} in collection {coll['id']!r}", code="document_not_found")
    return doc


# ---------------------------------------------------------------------------------------- collections


async def create_collection(request: web.Request) -> web.Response:
    svc = get_rag(request)
    spec = await json_body(request, CollectionSpec)
    try:
        coll = await asyncio.to_thread(svc.store.create_collection, _key_id(request), spec.name,
                                       svc.embedder.version_key, svc.cfg.max_collections_per_key)
    except Conflict as e:
        raise APIError(409, str(e), code="collection_exists", param="name") from None
    return web.json_response(_coll_public(dict(coll, documents=0)), status=201)


async def list_collections(request: web.Request) -> web.Response:
    svc = get_rag(request)
    rows = await asyncio.to_thread(svc.store.list_collections, _key_id(request))
    return web.json_response({"object": "list", "data": [_coll_public(c) for c in rows]})


async def get_collection(request: web.Request) -> web.Response:
    svc = get_rag(request)
    coll = await _collection(request, svc)
    docs = await asyncio.to_thread(svc.store.list_documents, coll["id"])
    return web.json_response(_coll_public(dict(coll, documents=len(docs))))


async def delete_collection(request: web.Request) -> web.Response:
    svc = get_rag(request)
    coll = await _collection(request, svc)
    await svc.delete_collection(coll["id"])
    return web.json_response({"id": coll["id"], "object": "collection", "deleted": True})


# ---------------------------------------------------------------------------------------- documents


async def upload_document(request: web.Request) -> web.Response:
    svc = get_rag(request)
    gw = request.app[GATEWAY]
    key = request[PRINCIPAL]
    coll = await _collection(request, svc)
    cap = svc.cfg.max_upload_bytes
    if request.content_length is not None and request.content_length > cap + 64 * 1024:
        raise APIError(413, f"the upload is {request.content_length} bytes; the limit is {cap}",
                       code="request_too_large")
    with _admitted(request):
        gw.limiter.rate(key, "uploads_per_minute", 1, "uploads")
        await _check_room(request, svc, request.content_length or 0)
        timeout_s = gw.config.upload_timeout_s
        try:  # a slow sender costs a connection for a bounded time: the whole body within upload_timeout_s
            async with asyncio.timeout(timeout_s):
                return await _receive(request, svc, coll, cap)
        except TimeoutError:
            raise body_timeout(request, timeout_s) from None


async def _check_room(request: web.Request, svc: RagService, size: int) -> None:
    """Before an upload is read (and again with its size): the disk, the key's queue and its quotas."""
    gw = request.app[GATEWAY]
    key = request[PRINCIPAL]
    free = (await asyncio.to_thread(shutil.disk_usage, svc.root)).free
    if free < gw.config.limits.min_free_disk_bytes + size:
        log.error("documents: an upload refused: %d bytes free on the data directory's disk (min_free_disk_bytes "
                  "%d)", free, gw.config.limits.min_free_disk_bytes)
        raise APIError(507, "the server is low on disk space and cannot take uploads now; retry later",
                       code="insufficient_storage", retry_after=60)
    docs, nbytes, queued = await asyncio.to_thread(svc.store.key_usage, key.id)
    queue_cap = gw.limiter.value(key, "queued_documents_per_key")
    if queue_cap is not None and queued >= queue_cap:
        gw.metrics.rate_limited.labels(limit="queued_documents_per_key").inc()
        raise APIError(429, f"this key already has {queued} document(s) waiting for ingestion (the limit is "
                       f"{queue_cap}); retry when some are ready", code="rate_limit_exceeded", retry_after=10,
                       limit="queued_documents_per_key")
    for name, have, what in (("documents_per_key", docs + 1, "documents"),
                             ("document_bytes_per_key", nbytes + size, "bytes of documents")):
        quota = gw.limiter.value(key, name)
        if quota is not None and have > quota:
            gw.metrics.rate_limited.labels(limit=name).inc()
            raise APIError(429, f"this key's quota of {quota} {what} is used up ({name}); delete documents to make "
                           "room", code="quota_exceeded", limit=name)


async def _receive(request: web.Request, svc: RagService, coll: dict[str, Any], cap: int) -> web.Response:
    try:
        reader = await request.multipart()
    except (AssertionError, ValueError, KeyError):
        raise APIError(400, "expected a multipart/form-data body with a field 'file'", param="file",
                       code="invalid_upload") from None
    part: Any = None
    try:
        while True:
            part = await reader.next()
            if part is None:
                break
            if isinstance(part, BodyPartReader) and part.name == "file":
                break
            if isinstance(part, BodyPartReader):
                await part.release()
    except ValueError as e:
        raise APIError(400, f"malformed multipart body: {e}", code="invalid_upload") from None
    except HttpProcessingError:  # a part's headers aiohttp refuses (e.g. a NUL in the file name)
        raise APIError(400, "malformed multipart body: a part's headers are invalid", code="invalid_upload") from None
    if part is None:
        raise APIError(400, "the multipart body has no field 'file'", param="file", code="invalid_upload")
    name = safe_filename(part.filename or "")
    if not part.filename:
        raise APIError(400, "the field 'file' needs a filename (its extension names the type)", param="file",
                       code="invalid_upload")
    tmp = svc.uploads / f"upload-{secrets.token_hex(8)}"
    sha = hashlib.sha256()
    size = 0
    head = b""
    try:
        with open(tmp, "wb") as f:
            while chunk := await part.read_chunk(1 << 16):
                size += len(chunk)
                if size > cap:
                    raise APIError(413, f"the upload is larger than the limit of {cap} bytes", code="request_too_large")
                if len(head) < 8192:
                    head += chunk[:8192 - len(head)]
                sha.update(chunk)
                f.write(chunk)
        if size == 0:
            raise APIError(400, f"{name!r} is empty (0 bytes)", param="file", code="empty_file")
        try:
            fmt = detect_format(name, head)
        except FileTypeError as e:
            raise APIError(415, str(e), param="file", code="unsupported_file_type") from None
        await _check_room(request, svc, size)
        doc, created = await asyncio.to_thread(svc.store.add_document, coll["id"], name, sha.hexdigest(), fmt, size)
        if created:
            os.replace(tmp, svc.upload_path(doc["id"]))
            await svc.submit(doc["id"], _key_id(request))
            log.info("documents: key=%d uploaded %s (%s, %d bytes) to %s as %s", _key_id(request), name, fmt, size,
                     coll["id"], doc["id"])
    finally:
        tmp.unlink(missing_ok=True)
    return web.json_response(_doc_public(doc), status=202 if created else 200)


async def list_documents(request: web.Request) -> web.Response:
    svc = get_rag(request)
    coll = await _collection(request, svc)
    docs = await asyncio.to_thread(svc.store.list_documents, coll["id"])
    return web.json_response({"object": "list", "data": [_doc_public(d) for d in docs]})


async def get_document(request: web.Request) -> web.Response:
    svc = get_rag(request)
    coll = await _collection(request, svc)
    return web.json_response(_doc_public(await _document(request, svc, coll)))


async def delete_document(request: web.Request) -> web.Response:
    svc = get_rag(request)
    coll = await _collection(request, svc)
    doc = await _document(request, svc, coll)
    try:
        await svc.delete_document(coll["id"], doc["id"])
    except Conflict as e:
        raise APIError(409, str(e), code="conflict") from None
    return web.json_response({"id": doc["id"], "object": "document", "deleted": True})


@contextlib.contextmanager
def _admitted(request: web.Request) -> Iterator[None]:
    """A request that costs work holds one of its key's max_concurrent slots while it runs."""
    limiter = request.app[GATEWAY].limiter
    ticket = limiter.admit(request[PRINCIPAL], generation=False)
    try:
        yield
    finally:
        limiter.release(ticket)


async def search(request: web.Request) -> web.Response:
    svc = get_rag(request)
    with _admitted(request):
        request.app[GATEWAY].limiter.rate(request[PRINCIPAL], "searches_per_minute", 1, "searches")
        return await _search(request, svc)


async def _search(request: web.Request, svc: RagService) -> web.Response:
    coll = await _collection(request, svc)
    spec = await json_body(request, SearchSpec)
    t0 = time.monotonic()
    try:  # hybrid from BM25 alone while the embedding model loads or after its process died
        passages, mode, note = await svc.retrieve([coll], spec.query, min(spec.top_k, svc.cfg.max_top_k), spec.mode)
    except EmbedError as e:  # dense: nothing to serve it without the model
        raise _embed_unavailable(e) from None
    body = {"object": "list", "collection_id": coll["id"], "version": coll["version"], "mode": mode,
            "data": [p.public() for p in passages], "took_ms": round((time.monotonic() - t0) * 1000, 2)}
    return web.json_response(body, headers={"X-Strata-Retrieval": note} if note else None)


def _embed_unavailable(e: EmbedError) -> APIError:
    """A request that needs the embedding model when its encode failed (its process died: a new one is
    loading): a typed 503 the client may retry, not a 500."""
    log.warning("documents: the embedding model is unavailable: %s", e)
    return APIError(503, "the embedding model is unavailable; retry shortly", code="embedding_model_unavailable",
                    retry_after=5)


# ---------------------------------------------------------------------------------------- embeddings


async def embeddings(request: web.Request) -> web.Response:
    svc = get_rag(request)
    with _admitted(request):
        return await _embeddings(request, svc)


async def _embeddings(request: web.Request, svc: RagService) -> web.Response:
    gw = request.app[GATEWAY]
    max_inputs = gw.config.limits.embedding_inputs_per_call
    spec = await json_body(request, EmbeddingSpec)
    emb = svc.embedder
    names = {emb.name, f"sentence-transformers/{emb.name}"}
    if spec.model is not None and spec.model not in names:
        raise APIError(404, f"the embedding model {spec.model!r} is not served here (served: {emb.name})",
                       code="model_not_found", param="model")
    texts = [spec.input] if isinstance(spec.input, str) else spec.input
    if not texts or len(texts) > max_inputs:
        raise APIError(400, f"input must hold 1 to {max_inputs} strings", param="input")
    if any(not t for t in texts):
        raise APIError(400, "input must not contain empty strings", param="input")
    gw.limiter.rate(request[PRINCIPAL], "embedding_inputs_per_minute", len(texts), "embedding inputs")
    if spec.dimensions is not None and spec.dimensions != emb.dim:
        raise APIError(400, f"this model only makes {emb.dim}-dimensional embeddings", param="dimensions")
    counts = await emb.acount_tokens(texts)
    try:
        vecs = await emb.aencode(texts)
    except EmbedError as e:
        raise _embed_unavailable(e) from None
    data = []
    for i, v in enumerate(vecs):
        value: Any = base64.b64encode(v.astype("<f4").tobytes()).decode() if spec.encoding_format == "base64" \
            else [float(x) for x in v]
        data.append({"object": "embedding", "index": i, "embedding": value})
    n = sum(min(c, emb.max_seq_length) for c in counts)
    return web.json_response({"object": "list", "data": data, "model": emb.name,
                              "usage": {"prompt_tokens": n, "total_tokens": n}})
