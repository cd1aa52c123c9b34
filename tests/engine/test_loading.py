"""Loading maps the GGUF and hands C pointers into the mapping: no weight is copied."""

from __future__ import annotations

import os
from pathlib import Path

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from engine.native import ffi


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _file_mappings(path: Path) -> list[tuple[int, int]]:
    spans = []
    with open("/proc/self/maps") as fh:
        for line in fh:
            if line.rstrip().endswith(str(path)):
                lo, hi = line.split()[0].split("-")
                spans.append((int(lo, 16), int(hi, 16)))
    return spans


def test_resident_memory_far_below_file_size() -> None:
    path = build_default_model(default_model_path())
    size = path.stat().st_size
    before = _rss()
    with Engine.open(path, threads=1, kv_tokens=256) as eng:
        grown = _rss() - before
        assert grown < 0.25 * size, f"RSS grew {grown / 1e6:.0f} MB for a {size / 1e6:.0f} MB file"
        # every weight pointer given to C lies inside a read-only mapping of the file
        spans = _file_mappings(path.resolve())
        assert spans, "the model file is not memory-mapped"
        for name in ("token_embd.weight", "blk.0.ffn_gate_exps.weight", "blk.29.attn_q.weight"):
            addr = int(ffi.cast("uintptr_t", ffi.from_buffer(eng.model_file.tensors[name].data)))
            assert any(lo <= addr < hi for lo, hi in spans), name


def test_gil_is_released_during_a_step() -> None:
    """Python threads keep running while C computes a step (the lane's event loop relies on it)."""
    import threading
    import time

    import numpy as np

    with Engine.open(build_default_model(default_model_path()), threads=1, kv_tokens=2048) as eng:
        ids = list(np.random.default_rng(0).integers(100, 40000, size=1024))
        ticks = 0
        done = threading.Event()

        def spin() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                time.sleep(0.001)

        th = threading.Thread(target=spin)
        th.start()
        blocks = eng.blocks.allocate(-(-len(ids) // eng.block_size))
        t0 = time.perf_counter()
        eng.prefill(ids, blocks)  # two 512-token C steps
        elapsed = time.perf_counter() - t0
        done.set()
        th.join()
        eng.blocks.release(blocks)
    assert elapsed > 0.2
    assert ticks > 0.3 * elapsed / 0.001 * 0.5, (ticks, elapsed)
