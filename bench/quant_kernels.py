"""Single-thread rate of the CPU quant kernels, beside llama.cpp's for the same type, in one run.

Strata: st_kernel_rate, the micro-kernel the step uses (8 rows x N weights of the type, random
codes, weights in cache) against 1 token (decode) and 16 tokens (a batch), per variant, thread
CPU time. llama.cpp: the pinned llama-cpp-python's own libggml-cpu, its vec_dot for the type
against its activation type (Q8_K; Q8_0 for IQ4_NL, MXFP4 and Q8_0: one row, one token per call) over one row of
8 x N weights (the same bytes as Strata's 8 rows), called through ctypes with the call's fixed
cost (measured on one 256-element block) subtracted. Each figure is the median (``--stat median``)
or the best (``--stat best``, the default) of R runs, Strata and llama.cpp alternating, in GMAC/s
(multiply-accumulates per CPU second / 1e9); the JSON keeps every run's figure.

Q8_0_R8 (and Q4_1_R8) is Strata's repacked form of those types, the one its engine runs for every
tensor of 8k rows, beside llama.cpp's plain Q8_0 (Q4_1) vec_dot.

Both sides read the thread CPU clock only around many calls: on the Zen 3 VM that read is a system call
of 1.3-1.6 us, as long as one 8 x 8192 one-token call (st_kernel_rate batches its calls for this).

Usage: ``python -m bench.quant_kernels [--types IQ3_XXS,IQ2_XXS,...] [--n 8192]
[--runs R] [--stat best|median] [--seconds 0.3] [--json OUT.json]``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from collections.abc import Callable

import numpy as np

from bench.common import fmt_num, machine_info, text_table, write_json

# issue 32's types, then the K-quants and Q8_0 the published mixes put beside them
DEFAULT_TYPES = [
    "Q2_K",
    "Q3_K",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_NL",
    "IQ4_XS",
    "MXFP4",
    "Q4_K",
    "Q6_K",
    "Q8_0",
    "Q8_0_R8",
]
# the engine repacks Q4_1 / Q8_0 tensors of 8k rows at load (st_model_repack): these names measure
# that form, beside llama.cpp's vec_dot of the plain type
REPACKED = {"Q8_0_R8": "Q8_0", "Q4_1_R8": "Q4_1"}
Q8K_BYTES = 4 + 256 + 2 * 16  # block_q8_K: float d, 256 int8, 16 int16 sums
Q80_BYTES = 2 + 32  # block_q8_0: f16 d, 32 int8
Q8_0_ACT = {"IQ4_NL", "MXFP4", "Q8_0", "Q4_0", "Q5_0"}  # ggml's vec_dot_type for these is Q8_0, else Q8_K


def llama_symbols(name: str) -> tuple[str, str, int]:
    """(ggml vec_dot symbol, activation quantiser symbol, activation bytes per 256 elements) of a
    GGML type name: ggml spells the K-quants with an upper-case K (q4_K) and the rest in lower case."""
    low = name.lower()
    w = low[:-2] + "_K" if low.endswith("_k") else low
    if name in Q8_0_ACT:
        return f"ggml_vec_dot_{w}_q8_0", "quantize_row_q8_0", 8 * Q80_BYTES
    return f"ggml_vec_dot_{w}_q8_K", "quantize_row_q8_K", Q8K_BYTES


def strata_rate(type_id: int, variant: int, n: int, nt: int, seconds: float) -> float:
    from engine.native import check, ffi, lib

    out = ffi.new("double *")
    check(lib.st_kernel_rate(type_id, variant, n, nt, seconds, out), "kernel_rate")
    return float(out[0])


def llama_vec_dot(name: str, n: int, seed: int = 0) -> Callable[[float], float] | None:
    """A timer for llama.cpp's vec_dot of `name` over one n-element row, or None where its
    library has no such symbol."""
    import llama_cpp
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    lib = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    dot_name, quant_name, act_bytes = llama_symbols(name)
    try:
        fn, quant = getattr(lib, dot_name), getattr(lib, quant_name)
    except AttributeError:
        return None
    lib.ggml_cpu_init()
    fn.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
    ]
    quant.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    rng = np.random.default_rng(seed)
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    w = rng.integers(0, 256, size=(n // block, type_size), dtype=np.uint8)
    w[:, 1::2] &= 0x3B  # f16 fields wherever they fall stay finite (Strata's st_kernel_rate does the same)
    if (
        name == "MXFP4"
    ):  # E8M0 exponents near 2^-5, as st_kernel_rate's (random ones overflow or go subnormal)
        w[:, 0] = 119 + np.arange(w.shape[0]) % 7
    x = rng.standard_normal(n).astype(np.float32)
    y = np.zeros(n // 256 * act_bytes, np.uint8)
    quant(x.ctypes.data, y.ctypes.data, n)
    s = ctypes.c_float()
    keep = (w, y, s)

    def per_call(m: int, reps: int) -> float:
        args = (m, ctypes.addressof(s), 0, w.ctypes.data, 0, y.ctypes.data, 0, 1)
        t0 = time.thread_time()
        for _ in range(reps):
            fn(*args)
        return (time.thread_time() - t0) / reps

    def timer(seconds: float) -> float:
        _ = keep
        fixed = min(per_call(256, 2000) for _ in range(3))  # the ctypes call's own cost
        reps, t = 16, 0.0
        while True:
            t = per_call(n, reps)
            if t * reps >= seconds:
                break
            reps *= 2
        return n / max(t - fixed, 1e-12) / 1e9

    return timer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    ap.add_argument(
        "--n", type=int, default=8192, help="row length (Strata: 8 rows; llama.cpp: one row of 8n)"
    )
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stat", choices=("best", "median"), default="best")
    ap.add_argument("--seconds", type=float, default=0.3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from gguf import GGMLQuantizationType

    from engine.native import VARIANTS, available_variants, lib

    info = machine_info()
    variants = [v for v in available_variants() if v != "auto"]
    pick = max if args.stat == "best" else (lambda xs: float(np.median(xs)))
    rows, report = (
        [],
        {"machine": info, "n": args.n, "runs": args.runs, "stat": args.stat, "gmac_s": {}, "samples": {}},
    )
    for name in args.types.split(","):
        plain = REPACKED.get(name, name)
        tid = int(getattr(lib, f"ST_TYPE_{name}")) if name in REPACKED else int(GGMLQuantizationType[name])
        llama = llama_vec_dot(plain, 8 * args.n)
        samples: dict[str, list[float]] = {}
        for _ in range(args.runs):
            for v in variants:
                for nt in (1, 16):
                    if v == "ref" and nt == 16:
                        continue
                    key = f"{v}/{nt}"
                    samples.setdefault(key, []).append(
                        strata_rate(tid, VARIANTS[v], args.n, nt, args.seconds)
                    )
            if llama is not None:
                samples.setdefault("llama.cpp/1", []).append(llama(args.seconds))
        best = {key: pick(xs) for key, xs in samples.items()}
        report["gmac_s"][name] = best
        report["samples"][name] = samples
        top = max(best.get(f"{v}/1", 0.0) for v in variants)
        peer = best.get("llama.cpp/1")
        rows.append(
            [
                name,
                *(
                    fmt_num(best.get(f"{v}/{nt}"), 2) if f"{v}/{nt}" in best else "-"
                    for v in variants
                    for nt in (1, 16)
                ),
                fmt_num(peer, 2) if peer else "-",
                f"{top / peer:.2f}x" if peer else "-",
            ]
        )
    headers = ["type", *(f"{v} {nt}t" for v in variants for nt in (1, 16)), "llama.cpp 1t", "best 1t / llama"]
    print(
        f"{info['cpu_model']}; busy cores before: {info['busy_cores_before']}; GMAC/s, single thread, "
        f"{args.stat} of {args.runs}"
    )
    print(text_table(headers, rows))
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
