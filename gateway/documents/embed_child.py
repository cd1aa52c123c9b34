"""The embedding model's own process (gateway.documents.embed starts it): torch, transformers,
sentence-transformers and ONNX Runtime are imported here, never in the gateway, so their imports and
the model's Python-side work (tokenising, pooling) never hold the gateway's GIL.

The child is forked by multiprocessing's forkserver, which imports this module once (its preload) and
stays single-threaded (OpenBLAS held to one thread, ONNX Runtime imported only after the fork): after a
crash a new child starts without importing torch again. Importing this module imports torch: only the
forkserver, the child and tests that want an in-process reference do.

Protocol over one duplex ``Connection``: the child loads the model and answers ``("ok", pid)`` or
``("err", reason)``; then each ``("encode", texts)`` gets ``("ok", float32 array)`` or ``("err", reason)``;
``("stop",)`` or the gateway's end closing ends it. The child also dies with its parent: Linux's
parent-death signal (the forkserver, which exits when the gateway does) and a watch on the gateway's
liveness pipe while it waits for work.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGTERM when the thread that forked this process exits (Linux; elsewhere the liveness watches remain)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _in_forkserver_preload() -> bool:
    """Whether this import runs in multiprocessing's forkserver (its preload), not in a test importing us."""
    fs = sys.modules.get("multiprocessing.forkserver")
    f = sys._getframe(1) if fs is not None else None
    while f is not None:
        if f.f_code is fs.main.__code__:  # type: ignore[union-attr]
            return True
        f = f.f_back
    return False


# The forkserver notices its parent's death only between forks, not during this module's tens of seconds of
# imports: a gateway SIGKILLed while starting would leave it importing torch for nothing. (The parent is the
# gateway's embedding thread, which lives as long as the gateway's shared Embedder.)
if _in_forkserver_preload():
    _parent_pid = os.getppid()
    _die_with_parent()
    if os.getppid() != _parent_pid:  # it died before the signal was armed
        os._exit(0)
    # a gateway that raised its own priority (config nice < 0) does not lend it to the embedding model's work
    if os.getpriority(os.PRIO_PROCESS, 0) < 0:
        os.setpriority(os.PRIO_PROCESS, 0, 0)

# before transformers is imported (here in the forkserver): nothing is fetched, nothing is printed
for _k, _v in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
               ("HF_HUB_DISABLE_PROGRESS_BARS", "1")):
    os.environ.setdefault(_k, _v)
# OpenBLAS starts its worker threads when numpy loads; the forkserver must stay single-threaded to fork safely
# (and numpy's BLAS only copies here). ONNX Runtime also starts a thread at import: it is imported in the
# child, after the fork (build_model).
os.environ["OPENBLAS_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

SMALL_BATCH_TOKENS = 512  # a forward pass this small (a query) runs on one thread: a pool's hand-offs cost more


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
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # idle pool threads must not spin: the cores are shared with the lanes and the event loop
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

    def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any = None, **_: Any) -> dict[str, Any]:
        ids = input_ids.numpy().astype(np.int64, copy=False)
        feeds = {"input_ids": ids, "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = (token_type_ids.numpy().astype(np.int64, copy=False)
                                       if token_type_ids is not None else np.zeros_like(ids))
        sess = self.small if ids.size <= SMALL_BATCH_TOKENS else self.bulk
        return {"last_hidden_state": torch.from_numpy(sess.run(None, feeds)[0])}


def build_model(model_dir: Path, onnx_path: Path | None, threads: int) -> Any:
    """The sentence-transformers model with its forward in ONNX Runtime when ``onnx_path`` is given."""
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(threads if onnx_path is None else 1)  # ORT: torch only pools
    model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    if onnx_path is not None:
        # sentence-transformers keeps tokenising, pooling and normalising; only the forward changes
        model[0].model = OrtForward(onnx_path, threads, model[0].model.config)
    return model


def encode(model: Any, texts: Sequence[str], batch: int) -> np.ndarray:
    """(len(texts), dim) float32, L2-normalised."""
    vecs = model.encode(list(texts), batch_size=batch, convert_to_numpy=True, normalize_embeddings=True,
                        show_progress_bar=False)
    return np.ascontiguousarray(vecs, dtype=np.float32)


def serve(conn: Connection, model_dir: Path, onnx_path: Path | None, threads: int, batch: int) -> None:
    """The child's life: load, then answer encode requests one at a time until told to stop or orphaned."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the gateway's to handle; it stops us
    parent = multiprocessing.parent_process()
    watch: list[Any] = [conn] + ([parent.sentinel] if parent is not None else [])
    if parent is not None and not parent.is_alive():
        return
    # imported here, not at the top: embed.py starts this module's forkserver
    from gateway.documents.embed import single_threaded_blas

    single_threaded_blas()  # numpy here only copies; a BLAS pool would wait for busy cores
    try:
        model = build_model(model_dir, onnx_path, threads)
    except Exception as e:
        conn.send(("err", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ok", os.getpid()))
    while True:
        if conn not in wait(watch):  # the gateway is gone
            return
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg[0] != "encode":
            return
        try:
            out: tuple[str, Any] = ("ok", encode(model, msg[1], batch))
        except Exception as e:  # a bad input must not end the process: the caller gets the reason
            out = ("err", f"{type(e).__name__}: {e}")
        try:
            conn.send(out)
        except (BrokenPipeError, OSError):
            return
