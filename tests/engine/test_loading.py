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
