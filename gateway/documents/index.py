"""Per-collection search indexes: FAISS (dense) + BM25 (bm25s), one immutable directory per version.

Layout under the data directory::

    collections/<collection id>/v<N>-<random>/   one version, complete (manifest.json written last)
        ids.json                           chunk ids in row order
        dense.faiss                        inner product over L2-normalised vectors (flat, or HNSW when large)
        bm25/                              bm25s files (absent for an empty version)
        manifest.json                      model key, dim, count, index kind
    collections/<collection id>/vectors/<document id>.npy   each document's chunk vectors (rebuilds never re-embed)

A version is built in ``v<N>-<random>.tmp`` and renamed into place (an atomic rename in one
directory), and only then named current in the database: a crash leaves at worst a directory no
row names (removed at start) and the previous version is served. The random part keeps two
gateways that share the data directory from ever writing the same directory. Search fuses the dense and BM25 rankings by
reciprocal rank (RRF, k=60).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["RRF_K", "Hit", "IndexVersion", "bm25_tokens", "build_version", "load_version", "prune_versions",
           "version_dir"]

RRF_K = 60
Mode = Literal["hybrid", "dense", "bm25"]

_STOP = frozenset("""a an and are as at be by for from has have in into is it its of on or that the their this to
was were what which who will with how does do did when where why can could should would i you he she we they them
his her our your my me us not no yes""".split())


def bm25_tokens(text: str) -> list[str]:
    """Lower-cased word tokens without stop words, with a light plural/-ing/-ed fold (both corpus and queries)."""
    out = []
    for w in re.findall(r"[^\W_]+", text.lower()):
        if w in _STOP:
            continue
        if len(w) > 4 and w.endswith("ies"):
            w = w[:-3] + "y"
        elif len(w) > 5 and w.endswith("ing"):
            w = w[:-3]
        elif len(w) > 4 and w.endswith("ed"):
            w = w[:-2]
        elif len(w) > 3 and w.endswith("s") and not w.endswith("ss"):
            w = w[:-1]
        out.append(w)
    return out


@dataclass
class Hit:
    chunk_id: str
    score: float  # the fused (or single-ranking) score
    dense_score: float | None = None
    bm25_score: float | None = None
    dense_rank: int | None = None
    bm25_rank: int | None = None


def version_dir(root: Path, collection_id: str, name: str) -> Path:
    return root / "collections" / collection_id / name


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def build_version(root: Path, collection_id: str, version: int, ids: list[str], vectors: np.ndarray,
                  texts: list[str], model_key: str, *, hnsw_above: int = 50_000) -> str:
    """Write version ``version`` (blocking); returns its directory's name. ``vectors`` rows match ``ids``/``texts``."""
    import faiss

    if len(ids) != len(texts) or len(ids) != vectors.shape[0]:
        raise ValueError("ids, texts and vectors disagree in length")
    name = f"v{version}-{secrets.token_hex(6)}"
    final = version_dir(root, collection_id, name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{name}.tmp"
    tmp.mkdir()
    try:
        dim = int(vectors.shape[1]) if vectors.ndim == 2 else 0
        kind = "flat"
        if len(ids) > hnsw_above:
            kind = "hnsw"
            dense: Any = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
            dense.hnsw.efConstruction = 80
        else:
            dense = faiss.IndexFlatIP(dim)
        if len(ids):
            dense.add(np.ascontiguousarray(vectors, dtype=np.float32))
        faiss.write_index(dense, str(tmp / "dense.faiss"))
        _write(tmp / "ids.json", json.dumps(ids).encode())
        if ids:
            import bm25s

            bm = bm25s.BM25()
            bm.index([bm25_tokens(t) or ["\x01empty"] for t in texts], show_progress=False)
            bm.save(str(tmp / "bm25"))
        manifest = {"version": version, "collection": collection_id, "model": model_key, "dim": dim,
                    "count": len(ids), "dense": kind}
        _write(tmp / "manifest.json", json.dumps(manifest).encode())
        _fsync_dir(tmp)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        return name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


class IndexVersion:
    """One loaded, immutable version; ``search`` is blocking and thread-safe (read-only)."""

    def __init__(self, path: Path) -> None:
        import faiss

        manifest = json.loads((path / "manifest.json").read_text())
        self.path = path
        self.version = int(manifest["version"])
        self.model = str(manifest["model"])
        self.dim = int(manifest["dim"])
        self.ids: list[str] = json.loads((path / "ids.json").read_text())
        self.dense = faiss.read_index(str(path / "dense.faiss"))
        if manifest.get("dense") == "hnsw":
            self.dense.hnsw.efSearch = 128
        self.bm25: Any = None
        if self.ids:
            import bm25s

            self.bm25 = bm25s.BM25.load(str(path / "bm25"))

    def __len__(self) -> int:
        return len(self.ids)

    def _dense(self, qvec: np.ndarray, n: int) -> list[tuple[int, float]]:
        scores, rows = self.dense.search(np.ascontiguousarray(qvec.reshape(1, -1), dtype=np.float32), n)
        return [(int(r), float(s)) for r, s in zip(rows[0], scores[0], strict=True) if r >= 0]

    def _bm25(self, query: str, n: int) -> list[tuple[int, float]]:
        ids = self.bm25.get_tokens_ids(bm25_tokens(query))
        if not ids:
            return []
        scores = self.bm25.get_scores_from_ids(ids)
        top = np.argpartition(-scores, min(n, len(scores)) - 1)[:n]
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(r), float(scores[r])) for r in top if scores[r] > 0]

    def search(self, qvec: np.ndarray | None, query: str, k: int, mode: Mode = "hybrid") -> list[Hit]:
        if not self.ids or k < 1:
            return []
        n = min(len(self.ids), max(50, 4 * k))
        dense = self._dense(qvec, n) if mode in ("hybrid", "dense") and qvec is not None else []
        sparse = self._bm25(query, n) if mode in ("hybrid", "bm25") else []
        hits: dict[int, Hit] = {}
        for rank, (row, s) in enumerate(dense):
            h = hits.setdefault(row, Hit(self.ids[row], 0.0))
            h.dense_score, h.dense_rank = s, rank + 1
            h.score += s if mode == "dense" else 1.0 / (RRF_K + rank + 1)
        for rank, (row, s) in enumerate(sparse):
            h = hits.setdefault(row, Hit(self.ids[row], 0.0))
            h.bm25_score, h.bm25_rank = s, rank + 1
            h.score += s if mode == "bm25" else 1.0 / (RRF_K + rank + 1)
        return sorted(hits.values(), key=lambda h: -h.score)[:k]


def load_version(root: Path, collection_id: str, name: str) -> IndexVersion:
    return IndexVersion(version_dir(root, collection_id, name))


def prune_versions(root: Path, collection_id: str, keep: set[str], *, below: int) -> None:
    """Remove version directories older than version ``below`` that are not in ``keep``, and the temp
    directories of such builds (a newer one may be another gateway's build in progress)."""
    base = root / "collections" / collection_id
    if not base.is_dir():
        return
    for p in base.iterdir():
        m = re.fullmatch(r"v(\d+)-[0-9a-f]+(\.tmp)?", p.name)
        if m and p.name not in keep and int(m.group(1)) < below:
            shutil.rmtree(p, ignore_errors=True)
