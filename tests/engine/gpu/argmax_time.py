"""What the step's greedy pick costs on the GPU, per form (run on the GPU machine after device_run.sh's setup):

    python3 tests/engine/gpu/argmax_time.py [--steps 300] [--splits 1,4,8,16,32]

A one-layer MoE with the bench model's vocabulary (151,936; hidden 64), so that a decode step's GPU time
(st_step_stats.t_total: from the batch upload to the end of the copies back) is mostly the output head, the
pick and the copy. Per sequence count (1, 8, 32): the median t_total of graph-replayed decode steps asking for
logits (the 0.6 MB-a-row copy, no pick), for the picks with k_argmax_rows (STRATA_GPU_ARGMAX_SPLIT=1) and with
k_argmax_split at each --splits value; every form's picks are checked against np.argmax of the logits row."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

V = 151936


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--splits", default="1,4,8,16,32")
    ap.add_argument("--seqs", default="1,8,32")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.getcwd())
    import gguf

    from engine.engine import Engine
    from tests.engine.gguf_factory import make_random_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = make_random_gguf(Path(tmp) / "v.gguf", n_vocab=V, n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=64,
                                n_expert=4, n_expert_used=2, weight_type=gguf.GGMLQuantizationType.Q8_0)
        eng = Engine.open(path, device="cuda:0", kv_tokens=8192, block_size=16)
        rng = np.random.default_rng(0)

        def median_us(n: int, tabs: list, toks: list[int], greedy: bool, split: str) -> tuple[float, np.ndarray]:
            os.environ["STRATA_GPU_ARGMAX_SPLIT"] = split
            ts = []
            for s in range(args.steps + 3):
                out = eng.forward(toks, [17] * n, list(range(n)), tabs, list(range(n)), greedy=greedy)
                if s >= 3:
                    ts.append(eng.last_stats.t_total)
            return 1e6 * float(np.median(ts)), out

        for n in (int(s) for s in args.seqs.split(",")):
            tabs = [eng.blocks.allocate(2) for _ in range(n)]
            toks = [int(t) for t in rng.integers(0, V, size=n)]
            lg_t, logits = median_us(n, tabs, toks, False, "1")
            ref = np.argmax(logits, axis=1)
            row = [f"logits {lg_t:6.1f}"]
            for sp in args.splits.split(","):
                t, picks = median_us(n, tabs, toks, True, sp)
                assert picks.tolist() == ref.tolist(), (n, sp)
                row.append(f"{'rows' if sp == '1' else 'split ' + sp} {t:6.1f}")
            lg2, _ = median_us(n, tabs, toks, False, "1")
            print(f"{n:>2} seqs, median GPU step (us): " + ", ".join(row) + f", logits again {lg2:6.1f}")
            for tb in tabs:
                eng.blocks.release(tb)
        eng.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
