"""Choose each batch-1 candidate knob's value from run 72's first process: the value whose two rows' mean GPU step
beats the default rows' mean by >= 0.005 ms (else 0). Prints shell assignments."""
import json
import sys

ms = json.load(open(sys.argv[1]))["decode_step_gpu_ms"]
base = [v for k, v in ms.items() if k.startswith("b1_none_")]
b = sum(base) / len(base)
print(f"# default rows {base} mean {b:.4f}", file=sys.stderr)
for k in ("gu_chunk", "norm_fast", "att_b1"):
    best, bv = "0", b - 0.005
    for v in ("1", "2", "3"):
        rows = [ms.get(f"b1_{k}_{v}"), ms.get(f"b1_{k}_0{v}")]
        rows = [r for r in rows if r is not None]
        if rows:
            m = sum(rows) / len(rows)
            print(f"# {k}={v}: {rows} mean {m:.4f} ({m - b:+.4f})", file=sys.stderr)
            if m < bv:
                best, bv = v, m
    print(f"STRATA_GPU_{k.upper()}={best}")
