"""rag: the RAG evaluator's corpus (bench/rag_eval.py's generator: made-up projects, facts buried in
filler, PDF/DOCX/MD/HTML/TXT) uploaded through the gateway's documents API; each fact's paraphrased
question is searched (recall@5: a top-5 passage holds the fact's value) and asked in a chat over the
collection (the answer contains the value; the citations name the fact's document)."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.harness.client import TargetError
from bench.harness.context import Context
from bench.harness.result import ScenarioResult

NAME = "rag"
CORRECTNESS = True
KINDS = ("gateway",)
RECALL_THRESHOLD = 0.9
CITATION_THRESHOLD = 0.9


async def _upload(s: aiohttp.ClientSession, url: str, headers: dict[str, str], cid: str, path: Path) -> str:
    form = aiohttp.FormData()
    form.add_field("file", path.read_bytes(), filename=path.name, content_type="application/octet-stream")
    async with s.post(f"{url}/v1/collections/{cid}/documents", data=form, headers=headers) as r:
        body = await r.json(content_type=None)
        if r.status not in (200, 201, 202):
            raise TargetError(f"upload {path.name}: HTTP {r.status}: {body}")
        return str(body["id"])


async def run(ctx: Context, res: ScenarioResult) -> None:
    from bench.rag_eval import make_corpus

    t = ctx.target
    s, url, headers = t.session, t.url, t.headers()
    docs, per_doc = ctx.q((5, 2), (40, 5))
    with tempfile.TemporaryDirectory(prefix="bench-rag-") as tmp:
        files, facts, _ = await asyncio.to_thread(make_corpus, Path(tmp), docs, per_doc, ctx.seed)
        name = f"bench-rag-{int(time.time())}"
        async with s.post(f"{url}/v1/collections", json={"name": name}, headers=headers) as r:
            coll = await r.json(content_type=None)
            if r.status != 201:
                raise TargetError(f"create collection: HTTP {r.status}: {coll}")
        cid = coll["id"]
        t0 = time.monotonic()
        ids = [await _upload(s, url, headers, cid, f) for f in files]
    bar = ctx.bar(len(ids) + 2 * len(facts), "rag")
    pending = set(ids)
    failed_docs = 0
    while pending:
        for did in list(pending):
            async with s.get(f"{url}/v1/collections/{cid}/documents/{did}", headers=headers) as r:
                d = await r.json(content_type=None)
            if d.get("status") in ("ready", "failed"):
                pending.discard(did)
                failed_docs += d["status"] == "failed"
                bar.update(1)
        if time.monotonic() - t0 > ctx.q(120, 1200):
            raise TargetError(f"ingestion not done after {time.monotonic() - t0:.0f}s ({len(pending)} pending)")
        if pending:
            await asyncio.sleep(0.2)
    ingest_s = time.monotonic() - t0

    async def one(fact: Any) -> tuple[bool, bool, bool, float | None]:
        async with s.post(f"{url}/v1/collections/{cid}/search", json={"query": fact.question, "top_k": 5},
                          headers=headers) as r:
            hits = (await r.json(content_type=None)).get("data") or []
        bar.update(1)
        recall = any(fact.value in " ".join(str(h.get("text", "")).split()) for h in hits)
        ans = await t.chat([{"role": "user", "content": fact.question + " Answer in one short sentence."}],
                           max_tokens=32, stream=False, collections=[name])
        bar.update(1)
        cites = ans.body.get("citations") or []
        cited = any(Path(str(c.get("document", ""))).stem == fact.doc for c in cites)
        contains = ans.ok and fact.value.lower() in " ".join(ans.text.split()).lower()
        return recall, contains, cited, ans.ttft_s

    sem = asyncio.Semaphore(2)

    async def guarded(fact: Any) -> tuple[bool, bool, bool, float | None]:
        async with sem:
            return await one(fact)

    out = await asyncio.gather(*(guarded(f) for f in facts))
    bar.close()
    n = len(out)
    recall = sum(o[0] for o in out) / n
    contains = sum(o[1] for o in out) / n
    cited = sum(o[2] for o in out) / n
    res.metric("recall_at_5", recall, "", "higher")
    res.metric("answer_contains_fact", contains, "", "higher")
    res.metric("citations_right", cited, "", "higher")
    res.metric("ingest_s", ingest_s, "s", "lower")
    res.table(f"RAG through the gateway ({len(ids)} documents, {n} questions, hybrid search, k=5)",
              ["figure", "value"], [["documents failed", failed_docs], ["ingestion s (upload to ready)", f"{ingest_s:.1f}"],
                                    ["recall@5", f"{recall:.0%}"], ["answer contains the fact", f"{contains:.0%}"],
                                    ["citations name the fact's document", f"{cited:.0%}"]])
    res.check("documents failed", failed_docs, "==", 0)
    res.check("recall@5", recall, ">=", RECALL_THRESHOLD)
    res.check("citations right", cited, ">=", CITATION_THRESHOLD)
    res.notes.append("'answer contains the fact' is the default model's reading, reported and not gated")
    async with s.delete(f"{url}/v1/collections/{cid}", headers=headers):
        pass
