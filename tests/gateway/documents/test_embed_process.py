"""The embedding model runs in a child process: its vectors are the in-process model's, a crash of the child fails
the request in flight with EmbedError (no hang) and the next calls get a new child, the child dies with its parent,
and the gateway's process never imports torch."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gateway.documents.embed import Embedder, EmbedError

ROOT = Path(__file__).resolve().parents[3]
TEXTS = ["fire assembly point", "The approved budget of the North Harbor Bridge project is 52.3 million euros.",
         "How much money was set aside for the North Harbor Bridge project? " * 6, "naïve café 🙂", " "]
LONG = "Ledger page 7 line 3: crate 262 of type 3 left dock 7 on the morning shift. " * 20  # 256 tokens, truncated


def _gone(pid: int) -> bool:
    """Exited (a zombie left for a parent that does not reap counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_child_vectors_equal_the_in_process_model(embedder: Embedder, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", os.environ.get("OPENBLAS_NUM_THREADS", "1"))  # the import sets it
    # torch in this test process: the reference, not the gateway's path
    from gateway.documents import embed_child

    model = embed_child.build_model(embedder.dir, embedder.onnx_path, embedder.threads)
    ref = embed_child.encode(model, TEXTS, embedder.batch)
    got = embedder.encode(TEXTS)
    assert got.dtype == np.float32 and got.shape == ref.shape == (len(TEXTS), embedder.dim)
    assert float(np.abs(got - ref).max()) <= 1e-6


async def test_a_crash_fails_the_request_in_flight_and_a_new_child_takes_over(embedder: Embedder) -> None:
    e = Embedder()  # its own child (forked from the warm forkserver: no second torch import)
    pid3: int | None = None
    try:
        await e.warm()
        pid = e.child_pid
        assert e.ready and pid is not None and pid != embedder.child_pid
        ingest = asyncio.ensure_future(e.aencode([LONG] * 48))  # three slices of ~1.6 s of CPU each
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EmbedError, match="died during this request"):
            await asyncio.wait_for(ingest, 30)
        assert time.monotonic() - t0 < 5  # noticed by the child's sentinel, not a timeout
        assert _gone(pid)
        # a new child is started in the background: ready again without any call, same vectors
        deadline = time.monotonic() + 60
        while not e.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert e.ready and e.child_pid not in (None, pid)
        assert float(np.abs(await e.aencode(TEXTS[:2]) - embedder.encode(TEXTS[:2])).max()) <= 1e-6
        # killed while idle: not ready, and the next call starts a child instead of failing
        pid2 = e.child_pid
        assert pid2 is not None
        os.kill(pid2, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while e.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not e.ready
        assert (await e.aencode_query("fire assembly point")).shape == (e.dim,)
        pid3 = e.child_pid
        assert e.ready and pid3 not in (None, pid2)
    finally:
        e.close()  # what the gateway's exit does (close_all): the child is stopped, not left to the end
    assert pid3 is not None and _gone(pid3) and not e.ready
    with pytest.raises(EmbedError, match="closed"):
        e.encode(["x"])


def test_requests_of_two_threads_share_the_child_one_at_a_time(embedder: Embedder) -> None:
    out: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: out.append(embedder.encode(TEXTS))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 4 and all(np.array_equal(o, out[0]) for o in out)


_PARENT = textwrap.dedent("""
    import json, multiprocessing.forkserver as fs, os, sys, time
    from gateway.documents.embed import get_embedder

    if __name__ == "__main__":
        e = get_embedder()
        v = e.encode(["hello there"])
        heavy = sorted(m for m in ("torch", "transformers", "sentence_transformers", "onnxruntime") if m in sys.modules)
        server = fs._forkserver._forkserver_pid
        print(json.dumps({"child": e.child_pid, "heavy": heavy, "norm": float((v * v).sum()),
                          "server_threads": len(os.listdir(f"/proc/{server}/task"))}), flush=True)
        time.sleep(600)
""")


@pytest.mark.slow
def test_no_torch_in_the_parent_and_the_child_dies_with_it() -> None:
    """A process that embedded something holds no torch (nor transformers, sentence-transformers, ONNX Runtime);
    the forkserver that forks the model's process is single-threaded; SIGKILL of the parent ends the child."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, "the parent printed nothing"
        got = json.loads(line)
        assert got["heavy"] == [] and abs(got["norm"] - 1) < 1e-4
        assert got["server_threads"] == 1
        child = int(got["child"])
        assert not _gone(child)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child), "the embedding process outlived its parent"
