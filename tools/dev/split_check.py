"""Split decode attention on a real model: one decode step's logits with the split forced to each
mode against no split, at the same state (the same prefilled cache, the same token and position; a
decode step rewrites only its own position, so repeating it is idempotent). Also printed: the layers
whose routed experts differ from the unsplit step's, and the unsplit step of the reference kernels
against a SIMD variant's (a float-rounding-sized change that involves no split at all).

    PYTHONPATH=$PWD python tools/dev/split_check.py check [--cached 300] [model.gguf]
    PYTHONPATH=$PWD python tools/dev/split_check.py f16 SRC.gguf DST.gguf        # weights as F16
    PYTHONPATH=$PWD python tools/dev/split_check.py truncate SRC.gguf DST.gguf L  # first L layers

`f16` and `truncate` write copies for bisecting: a model with F16 weights takes float activations
(no per-step int8 activation rounding), a truncated one shows the layer where a difference appears.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from engine.engine import Engine
from engine.native import VARIANTS, available_variants, lib, set_attn_split

DEFAULT_MODEL = "var/models/smollm2-135m-moe8.gguf"


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def check(path: str, n: int) -> None:
    rng = np.random.default_rng(0)
    with Engine.open(path, threads=2, kv_tokens=n + 64) as eng:
        hp = eng.hparams
        print(f"{path}: n_layer {hp.n_layer} n_head {hp.n_head} n_head_kv {hp.n_head_kv} "
              f"n_expert {hp.n_expert} cached {n}")
        table = eng.blocks.allocate(-(-(n + 2) // eng.block_size))
        eng.prefill([int(t) for t in rng.integers(100, 5000, n)], table)
        tok = int(rng.integers(100, 5000))

        def step(mode: str | int) -> tuple[np.ndarray, np.ndarray]:  # logits [n_vocab], experts [n_layer, n_expert]
            set_attn_split(mode)
            hist = np.zeros((hp.n_layer, max(hp.n_expert, 1)), np.int32)
            logits = eng.forward([tok], [n], [0], [table], [0], hist if hp.n_expert else None)[0].copy()
            return logits, hist

        def flipped(a: np.ndarray, b: np.ndarray) -> list[int]:
            return [int(i) for i in np.nonzero((a != b).any(axis=1))[0]]

        ref, ref_hist = step("off")
        print(f"{'off again':10} rel {rel(step('off')[0], ref):.3g}")
        for mode in ("auto", 16, 64, 256, 1024):
            got, hist = step(mode)
            print(f"{mode!s:10} rel {rel(got, ref):.3g}  layers whose experts differ: {flipped(hist, ref_hist)}")
        simd = [v for v in available_variants() if v != "ref"]
        if simd:
            outs = []
            for v in ("ref", simd[0]):
                assert lib.st_set_variant(VARIANTS[v]) == 0
                outs.append(step("off"))
            lib.st_set_variant(VARIANTS["auto"])
            print(f"unsplit ref vs {simd[0]}: rel {rel(outs[0][0], outs[1][0]):.3g}  "
                  f"layers whose experts differ: {flipped(outs[0][1], outs[1][1])}")
        set_attn_split("auto")


def copy(src: Path, dst: Path, n_layer: int | None, f16: bool) -> None:
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name == "general.architecture" or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        value = n_layer if n_layer is not None and f.name == f"{arch}.block_count" else f.contents()
        w.add_key_value(f.name, value, vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    floats = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
    for t in r.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if n_layer is not None and m and int(m.group(1)) >= n_layer:
            continue
        if f16 and t.tensor_type not in floats:
            w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float16),
                         raw_dtype=gguf.GGMLQuantizationType.F16)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # quantised: bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    c.add_argument("--cached", type=int, default=300)
    f = sub.add_parser("f16")
    f.add_argument("src", type=Path)
    f.add_argument("dst", type=Path)
    t = sub.add_parser("truncate")
    t.add_argument("src", type=Path)
    t.add_argument("dst", type=Path)
    t.add_argument("n_layer", type=int)
    a = ap.parse_args()
    if a.cmd == "check":
        check(a.model, a.cached)
    elif a.cmd == "f16":
        copy(a.src, a.dst, None, True)
    else:
        copy(a.src, a.dst, a.n_layer, False)


if __name__ == "__main__":
    main()
