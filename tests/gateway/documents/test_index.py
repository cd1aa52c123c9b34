"""Embeddings and the hybrid index: normalised vectors, dense / BM25 / fused ranking, versions on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gateway.documents.embed import Embedder
from gateway.documents.index import bm25_tokens, build_version, load_version, prune_versions

FACTS = [
    "The boiler in building C runs at a pressure of 42 bar during the winter season.",
    "Employees may carry over at most five unused vacation days into the next calendar year.",
    "The cafeteria serves vegetarian lasagna every Thursday at noon.",
    "Parking permits for the east garage are renewed each March through the facilities office.",
    "Server room access requires a badge and a second factor since the 2024 audit.",
    "Invoice ZX-9917 was paid to Northwind Traders on 3 June.",
]


def test_embeddings_are_normalised_and_semantic(embedder: Embedder) -> None:
    v = embedder.encode(["How much pressure does the boiler run at?", *FACTS])
    assert v.shape == (7, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    sims = v[1:] @ v[0]
    assert int(np.argmax(sims)) == 0


def test_bm25_tokens() -> None:
    assert bm25_tokens("The Boilers are running, and the PARTIES ended!") == ["boiler", "runn", "party", "end"]


def test_hybrid_search_finds_paraphrases_and_exact_codes(tmp_path: Path, embedder: Embedder) -> None:
    ids = [f"c{i}" for i in range(len(FACTS))]
    name = build_version(tmp_path, "col", 1, ids, embedder.encode(FACTS), FACTS, embedder.version_key)
    idx = load_version(tmp_path, "col", name)
    assert len(idx) == len(FACTS) and idx.model == embedder.version_key

    q = "how many leftover holiday days can staff keep for next year?"
    for mode in ("hybrid", "dense"):
        hits = idx.search(embedder.encode([q])[0], q, 3, mode)  # type: ignore[arg-type]
        assert hits[0].chunk_id == "c1", (mode, hits)
    q = "ZX-9917"  # an identifier: BM25's strength
    hits = idx.search(embedder.encode([q])[0], q, 3, "bm25")
    assert hits[0].chunk_id == "c5"
    hits = idx.search(embedder.encode([q])[0], q, 3, "hybrid")
    assert hits[0].chunk_id == "c5" and hits[0].bm25_rank == 1
    assert idx.search(None, "zzzz qqqq", 3, "bm25") == []


def test_versions_are_separate_and_pruned(tmp_path: Path, embedder: Embedder) -> None:
    vec = embedder.encode(FACTS[:2])
    a = build_version(tmp_path, "col", 1, ["x", "y"], vec, FACTS[:2], "m")
    b = build_version(tmp_path, "col", 2, ["y"], vec[1:], FACTS[1:2], "m")
    empty = build_version(tmp_path, "col", 3, [], np.zeros((0, 384), np.float32), [], "m")
    assert load_version(tmp_path, "col", a).ids == ["x", "y"]
    assert load_version(tmp_path, "col", b).ids == ["y"]
    assert load_version(tmp_path, "col", empty).search(vec[0], "anything", 5) == []
    (tmp_path / "collections" / "col" / "v2-00ff.tmp").mkdir()  # a build cut off by a crash
    prune_versions(tmp_path, "col", {empty, b}, below=3)
    left = sorted(p.name for p in (tmp_path / "collections" / "col").iterdir())
    assert left == sorted([b, empty])


def test_hnsw_above_threshold(tmp_path: Path, embedder: Embedder) -> None:
    rng = np.random.default_rng(0)
    vec = rng.standard_normal((300, 384)).astype(np.float32)
    vec /= np.linalg.norm(vec, axis=1, keepdims=True)
    ids = [f"r{i}" for i in range(300)]
    name = build_version(tmp_path, "col", 1, ids, vec, ids, "m", hnsw_above=100)
    idx = load_version(tmp_path, "col", name)
    assert "HNSW" in type(idx.dense).__name__
    hits = idx.search(vec[123], "nothing", 1, "dense")
    assert hits[0].chunk_id == "r123"


async def test_aencode_reports_progress(embedder: Embedder) -> None:
    seen: list[tuple[int, int]] = []
    v = await embedder.aencode([f"text {i}" for i in range(70)], lambda d, t: seen.append((d, t)))
    assert v.shape == (70, 384)
    assert seen == [(16, 70), (32, 70), (48, 70), (64, 70), (70, 70)]
