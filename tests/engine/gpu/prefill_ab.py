"""Prefill rates of several knob settings of one CUDA library, the bench model loaded once (docs/gpu-runs.md).

    STRATA_CUDA_LIB=x.so python -m tests.engine.gpu.prefill_ab [--n 512,4096] [--repeat 3] \
        [--set NAME "ENV=V ENV2=V2"]... [--profile NAME]

Each --set is a named group of environment variables (read per step or launch by the library);
"base" (no variables) always runs first. Rounds alternate the settings (round r times every setting
once at every length), so drift spreads over all of them; the median per (setting, length) is
printed last, one line each. --profile NAME[,NAME]: then the kernel times (CUPTI through torch's profiler,
graphs and PDL off) of one 512- and one 4,096-token prefill with that setting, grouped into parts
(GEMM forms by their template arguments, attention, norms, routing, quantisation).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import numpy as np

from bench.engine_gpu import bench_model

# k_linear_gemm<T, SW, BN, CS[, FAST]>: at Qwen3-30B-A3B shapes CS tells the layer (K = 768: down,
# 2,048: q / k / v / gate+up, 4,096: o)
PARTS = [("gate/up GEMM", r"k_linear_gemm<\d+, true"), ("down GEMM", r"k_linear_gemm<\d+, false, \d+, 1"),
         ("q/k/v GEMM", r"k_linear_gemm<\d+, false, \d+, 2"), ("o GEMM", r"k_linear_gemm<\d+, false, \d+, 4"),
         ("other GEMM", r"k_linear_gemm|k_ksplit"), ("attention", r"k_attention"), ("q/k/v post, rope", r"k_qkv"),
         ("RMSNorm", r"k_rmsnorm"), ("router", r"k_linear_f|k_router"), ("routing", r"k_route|k_group"),
         ("8-bit quantisation", r"k_quant_act"), ("matvec", r"k_linear_q"), ("embedding", r"k_embed")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="512,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--set", nargs=2, action="append", default=[], metavar=("NAME", "ENV=V ..."))
    ap.add_argument("--profile", default=None, metavar="NAME[,NAME]")
    ap.add_argument("--model-dir", default="/tmp/strata-bench")
    args = ap.parse_args(argv)
    from engine.engine import Engine

    path = bench_model(args.model_dir)
    sets = [("base", {})] + [(n, dict(kv.split("=", 1) for kv in spec.split())) for n, spec in args.set]
    lengths = [int(x) for x in args.n.split(",")]
    lib = Path(os.environ.get("STRATA_CUDA_LIB", "engine/_strata_cuda.so")).name
    rates: dict[tuple[str, int], list[float]] = {}
    with Engine.open(path, device="cuda:0", kv_tokens=max(8192, max(lengths) + 16), block_size=16,
                     prefill_chunk=512) as eng:
        rng = np.random.default_rng(1)

        def prefill(n: int, prof: object = None) -> float:
            ids = [int(t) for t in rng.integers(0, eng.hparams.n_vocab, size=n)]
            b = eng.blocks.allocate(-(-n // eng.block_size))
            assert b is not None
            try:
                eng.prefill(ids[:16], b)
                if prof is not None:
                    prof.start()  # type: ignore[attr-defined]
                t = time.perf_counter()
                eng.prefill(ids, b)
                dt = time.perf_counter() - t
                if prof is not None:
                    prof.stop()  # type: ignore[attr-defined]
                return n / dt
            finally:
                eng.blocks.release(b)

        def with_env(env: dict, fn):  # noqa: ANN001, ANN202
            old = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                return fn()
            finally:
                for k, v in old.items():
                    if v is None:
                        del os.environ[k]
                    else:
                        os.environ[k] = v

        for _name, env in sets:  # warm every setting once (kernels loaded, scratch sized)
            for n in lengths:
                with_env(env, lambda n=n: prefill(n))
        for _ in range(args.repeat):
            for name, env in sets:
                for n in lengths:
                    rates.setdefault((name, n), []).append(with_env(env, lambda n=n: prefill(n)))
        for (name, n), r in rates.items():
            print(f"{lib} {name:<12} pp{n:<5} median {float(np.median(r)):7.0f} tok/s ({', '.join(f'{x:.0f}' for x in r)})")
        for pname in (args.profile.split(",") if args.profile else []):
            import torch.profiler as tp

            env = dict(dict(sets)[pname], STRATA_GPU_GRAPHS="0", STRATA_GPU_PDL="0")
            for n in (512, 4096):
                prof = tp.profile(activities=[tp.ProfilerActivity.CUDA])
                with_env(env, lambda n=n, prof=prof: prefill(n, prof))
                parts: dict[str, float] = {}
                total = 0.0
                for ev in prof.key_averages():
                    us = ev.self_device_time_total if hasattr(ev, "self_device_time_total") else ev.self_cuda_time_total
                    if us <= 0:
                        continue
                    total += us
                    part = next((p for p, rx in PARTS if re.search(rx, ev.key)), "other: " + ev.key[:40])
                    parts[part] = parts.get(part, 0.0) + us
                print(f"== {lib} {pname}: prefill of {n} tokens, graphs and PDL off: {total / 1e3:.1f} ms of kernels")
                for p, us in sorted(parts.items(), key=lambda kv: -kv[1]):
                    print(f"  {p:<44}{us / 1e3:9.2f} ms {100 * us / total:5.1f}%")
                print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
