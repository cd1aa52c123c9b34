"""Retrieval quality and speed of the documents service on a generated corpus.

    PYTHONPATH=. .venv/bin/python -m bench.rag_eval                        # 200 documents, 1,000 facts
    PYTHONPATH=. .venv/bin/python -m bench.rag_eval --docs 40 --json var/bench/rag_eval.json

The corpus: ``--docs`` documents (PDF, DOCX, Markdown, HTML and text in turn; PDFs of 4 pages),
each about a few made-up projects, each project with facts ("The budget of Project Valdora is
4.7 million euros.") buried among filler sentences that name the same project, so a passage must
be told apart from its neighbours by meaning (which attribute) and by name (which project).
Every fact gets one paraphrased question that shares the project name but not the attribute's
wording ("How much money was set aside for Project Valdora?").

The documents go through the real pipeline (RagService: extraction child processes, chunking,
embedding, index versions, SQLite) as one collection. Reported: recall@5 (a question is a hit
when one of the top 5 passages holds the fact's value) for dense, BM25 and hybrid retrieval;
ingestion speed: pages per second of one generated ``--pdf-pages`` PDF (upload to ready) and
documents per second of the corpus;
search latency p50 / p99 (hybrid, in-process, query embedding included).
Targets: hybrid recall@5 >= 0.95 and above both others; search p50 <= 30 ms, p99 <= 100 ms;
ingestion >= 20 pages/s.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import machine_info, text_table, write_json

TARGETS = {"recall_hybrid": 0.95, "search_p50_ms": 30.0, "search_p99_ms": 100.0, "pages_per_s": 20.0}

# attribute, fact template, question template, value maker
ATTRS: list[tuple[str, str, str]] = [
    ("budget", "The approved budget of {e} is {v}.", "How much money was set aside for {e}?"),
    ("launch", "{e} is scheduled to launch on {v}.", "When does {e} go live?"),
    ("lead", "The project lead of {e} is {v}.", "Who is in charge of running {e}?"),
    ("city", "The headquarters of {e} are located in {v}.", "In which town is {e} based?"),
    ("staff", "{e} currently employs {v} people.", "How large is the workforce of {e}?"),
    ("supplier", "The main hardware supplier for {e} is {v}.", "Which vendor delivers equipment to {e}?"),
    ("clearance", "Access to {e} requires security clearance level {v}.", "What authorization tier is needed "
     "to enter {e}?"),
    ("warranty", "Equipment bought for {e} carries a warranty of {v}.", "How long is the guarantee on the "
     "gear purchased for {e}?"),
    ("colour", "The official colour of the {e} logo is {v}.", "What shade is used in the emblem of {e}?"),
    ("server", "The database of {e} runs on the server named {v}.", "Which machine hosts the data store of {e}?"),
]
FILLER = ["The team of {e} held its quarterly review in the main conference room.",
          "Several teams contributed to {e} over the past year.",
          "The steering committee of {e} meets on the first Monday of each month.",
          "Minutes of every meeting about {e} are archived in the shared drive.",
          "Feedback about {e} can be sent to the program office.",
          "The documentation of {e} was updated after the last audit."]
# project names share their words (many "North ... Bridge"s): the name alone does not single out a passage
NAME_A = ["North", "South", "East", "West", "Upper", "Lower", "Old", "New"]
NAME_B = ["Harbor", "River", "Valley", "Ridge", "Meadow", "Forest", "Canyon", "Lake", "Summit", "Delta"]
NAME_C = ["Bridge", "Tunnel", "Station", "Depot", "Plant", "Terminal", "Campus", "Tower"]
NAMES = ["Amara Okafor", "Björn Lindqvist", "Chen Wei", "Dolores Ruiz", "Emeka Obi", "Farah Haddad", "Goran Petrov",
         "Hana Sato", "Ivan Novak", "Julia Moreau", "Kofi Mensah", "Leila Nazari"]
CITIES = ["Tromsø", "Valparaíso", "Bergamo", "Kraków", "Tbilisi", "Da Nang", "Arequipa", "Ghent", "Tartu", "Nagoya"]
VENDORS = ["Northwind Systems", "Blue Heron Devices", "Kestrel Components", "Ironbark Supply", "Lumen Forge"]
COLOURS = ["teal", "amber", "crimson", "olive green", "navy blue", "saffron"]


def _value(attr: str, rng: random.Random) -> str:
    if attr == "budget":
        return f"{rng.randint(1, 99)}.{rng.randint(1, 9)} million euros"
    if attr == "launch":
        return f"{rng.randint(1, 28)} {rng.choice(['March', 'June', 'September', 'November'])} {rng.randint(2027, 2031)}"
    if attr == "lead":
        return rng.choice(NAMES)
    if attr == "city":
        return rng.choice(CITIES)
    if attr == "staff":
        return str(rng.randint(12, 4800))
    if attr == "supplier":
        return rng.choice(VENDORS)
    if attr == "clearance":
        return f"{rng.choice('ABCDE')}{rng.randint(1, 9)}"
    if attr == "warranty":
        return f"{rng.randint(2, 9)} years"
    if attr == "colour":
        return rng.choice(COLOURS)
    return f"{rng.choice(['atlas', 'borealis', 'cygnus', 'draco', 'eridanus'])}-{rng.randint(10, 99)}"


@dataclass
class Fact:
    doc: str
    entity: str
    value: str
    question: str


def make_corpus(out: Path, n_docs: int, facts_per_doc: int, seed: int = 7) -> tuple[list[Path], list[Fact], int]:
    """Documents in ``out`` and their facts; also the number of PDF pages."""
    from tests.gateway.documents.samples import make_docx, make_pdf

    rng = random.Random(seed)
    used: set[str] = set()
    files: list[Path] = []
    facts: list[Fact] = []
    pdf_pages = 0
    for d in range(n_docs):
        ents = []
        while len(ents) < 2:
            name = f"the {rng.choice(NAME_A)} {rng.choice(NAME_B)} {rng.choice(NAME_C)} project"
            if name not in used:
                used.add(name)
                ents.append(name)
        paras: list[str] = []
        attrs = {e: rng.sample(ATTRS, len(ATTRS)) for e in ents}  # no attribute twice for one project
        for i in range(facts_per_doc):
            e = ents[i % len(ents)]
            attr, fact_t, q_t = attrs[e].pop()
            v = _value(attr, rng)
            fill = " ".join(rng.choice(FILLER).format(e=e) for _ in range(3))
            fact = fact_t.format(e=e, v=v)
            paras.append(f"{fill} {fact[0].upper() + fact[1:]} {rng.choice(FILLER).format(e=e)}")
            facts.append(Fact(f"doc{d:04d}", e, v, q_t.format(e=e)))
        kind = ["pdf", "docx", "md", "html", "txt"][d % 5]
        base = out / f"doc{d:04d}"
        if kind == "pdf":
            per = max(1, len(paras) // 4)
            pages = ["\n\n".join(paras[i:i + per]) for i in range(0, len(paras), per)]
            files.append(make_pdf(base.with_suffix(".pdf"), pages))
            pdf_pages += len(pages)
        elif kind == "docx":
            files.append(make_docx(base.with_suffix(".docx"), f"Projects {d}", paras))
        elif kind == "md":
            p = base.with_suffix(".md")
            p.write_text(f"# Projects {d}\n\n" + "\n\n".join(paras))
            files.append(p)
        elif kind == "html":
            p = base.with_suffix(".html")
            p.write_text(f"<html><body><h1>Projects {d}</h1>" + "".join(f"<p>{x}</p>" for x in paras) +
                         "</body></html>")
            files.append(p)
        else:
            p = base.with_suffix(".txt")
            p.write_text("\n\n".join(paras))
            files.append(p)
    return files, facts, pdf_pages


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from gateway.db import open_db
    from gateway.documents.config import RagConfig
    from gateway.documents.extract import detect_format
    from gateway.documents.service import RagService

    info = machine_info()
    tmp = Path(tempfile.mkdtemp(prefix="rag_eval_"))
    t0 = time.perf_counter()
    (tmp / "corpus").mkdir()
    files, facts, pdf_pages = make_corpus(tmp / "corpus", args.docs, args.facts_per_doc)
    print(f"corpus: {len(files)} documents, {len(facts)} facts, {pdf_pages} PDF pages "
          f"({time.perf_counter() - t0:.1f} s to generate)", file=sys.stderr)

    cfg = RagConfig(data_dir=tmp / "rag", embed_threads=args.embed_threads, embed_batch=args.embed_batch,
                    embed_backend=args.backend, embed_precision=args.precision)
    svc = RagService(cfg, open_db(f"sqlite:///{tmp / 'gw.db'}"))
    await svc.embedder.warm()
    await svc.start()
    coll = svc.store.create_collection(1, "eval", svc.embedder.version_key, 10)
    t_start = time.perf_counter()
    ids = []
    for f in files:
        data = f.read_bytes()
        fmt = detect_format(f.name, data[:8192])
        doc, _ = svc.store.add_document(coll["id"], f.name, hashlib.sha256(data).hexdigest(), fmt, len(data))
        shutil.copyfile(f, svc.upload_path(doc["id"]))
        ids.append(doc["id"])
        await svc.submit(doc["id"])
    while True:
        docs = {d["id"]: d for d in svc.store.list_documents(coll["id"])}
        if all(d["status"] in ("ready", "failed") for d in docs.values()):
            break
        await asyncio.sleep(0.2)
    t_ingest = time.perf_counter() - t_start
    failed = [d for d in docs.values() if d["status"] == "failed"]
    chunks = sum(d["chunks"] or 0 for d in docs.values())
    print(f"ingested in {t_ingest:.1f} s: {chunks} chunks, {len(failed)} failed", file=sys.stderr)

    c = svc.store.get_collection(None, coll["id"])
    assert c is not None
    recalls: dict[str, float] = {}
    lat: list[float] = []
    cpu: list[float] = []
    for mode in ("dense", "bm25", "hybrid"):
        hits = 0
        svc.embedder.forget_queries()  # every timed search pays its query's forward pass
        for fact in facts:
            q0, c0 = time.perf_counter(), time.process_time()
            found = await svc.search([c], fact.question, 5, mode)  # type: ignore[arg-type]
            if mode == "hybrid":
                lat.append((time.perf_counter() - q0) * 1000)
                cpu.append((time.process_time() - c0) * 1000)  # all threads: less sensitive to other load
            hits += any(fact.value in " ".join(p.text.split()) for p in found)
        recalls[mode] = hits / len(facts)

    # ingestion speed on one long PDF (the corpus' documents are short: their figure is mostly per-document cost)
    from tests.gateway.documents.samples import make_pdf

    pages = [" ".join(f"Ledger page {p} line {i}: crate {p * 37 + i} of type {i % 9} left dock {p % 12} on the "
                      f"morning shift." for i in range(10)) for p in range(args.pdf_pages)]
    big = make_pdf(tmp / "ledger.pdf", pages)
    coll2 = svc.store.create_collection(1, "ledger", svc.embedder.version_key, 10)
    data = big.read_bytes()
    doc, _ = svc.store.add_document(coll2["id"], big.name, hashlib.sha256(data).hexdigest(), "pdf", len(data))
    shutil.copyfile(big, svc.upload_path(doc["id"]))
    t_pdf = time.perf_counter()
    await svc.submit(doc["id"])
    while (d := svc.store.get_document(doc["id"])) is not None and d["status"] not in ("ready", "failed"):
        await asyncio.sleep(0.1)
    t_pdf = time.perf_counter() - t_pdf
    assert d is not None and d["status"] == "ready", d
    pages_per_s = args.pdf_pages / t_pdf
    await svc.stop()
    lat.sort()
    p50 = statistics.median(lat)
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    report = {
        "machine": info, "docs": len(files), "facts": len(facts), "pdf_pages": pdf_pages, "chunks": chunks,
        "failed": len(failed), "embed_threads": args.embed_threads, "backend": svc.embedder.backend,
        "precision": svc.embedder.precision, "ingest_s": round(t_ingest, 2),
        "docs_per_s": round(len(files) / t_ingest, 2), "pdf_pages_timed": args.pdf_pages,
        "pdf_ingest_s": round(t_pdf, 2), "pages_per_s": round(pages_per_s, 2),
        "recall_at_5": {k: round(v, 4) for k, v in recalls.items()},
        "search_ms": {"p50": round(p50, 2), "p99": round(p99, 2), "n": len(lat),
                      "cpu_p50": round(statistics.median(cpu), 2)}, "targets": TARGETS,
    }
    shutil.rmtree(tmp, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--facts-per-doc", type=int, default=5)
    ap.add_argument("--embed-threads", type=int, default=1)
    ap.add_argument("--embed-batch", type=int, default=32)
    ap.add_argument("--backend", choices=["auto", "onnx", "torch"], default="auto",
                    help="the embedding forward pass (auto: ONNX Runtime when setup exported the model)")
    ap.add_argument("--precision", choices=["fp32", "int8"], default="fp32",
                    help="int8: the quantised export")
    ap.add_argument("--pdf-pages", type=int, default=200, help="pages of the PDF whose ingestion is timed")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    r = asyncio.run(run(args))
    rows = [[m, f"{r['recall_at_5'][m]:.3f}"] for m in ("dense", "bm25", "hybrid")]
    print(text_table(["retrieval", "recall@5"], rows))
    print(f"ingestion: a {r['pdf_pages_timed']}-page PDF at {r['pages_per_s']:.1f} pages/s ({r['pdf_ingest_s']:.1f} s); "
          f"the corpus at {r['docs_per_s']:.2f} documents/s ({r['docs']} documents, {r['chunks']} chunks, "
          f"{r['ingest_s']:.1f} s); embed_threads={r['embed_threads']}, backend={r['backend']} {r['precision']}")
    print(f"search (hybrid, k=5, {r['facts']} queries): p50 {r['search_ms']['p50']:.1f} ms, "
          f"p99 {r['search_ms']['p99']:.1f} ms; CPU time p50 {r['search_ms']['cpu_p50']:.1f} ms")
    print(f"machine: {r['machine']['cpu_model']}, {r['machine']['affinity_cores']} cores, "
          f"load {r['machine']['loadavg']}, commit {r['machine']['git_commit']}")
    if args.json:
        write_json(args.json, r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
