"""A synthetic 8-expert, top-2 llama-architecture MoE about ten times the size of the default
model, written at bench time (never committed): the default model's tokenizer and chat
metadata, random Q4_1 weights (Q8_0 tied embedding / output head, F32 norms and router).

    python -m bench.synthetic_moe [OUT.gguf]        # default var/bench/synthetic-moe8-10x.gguf

Shape: 24 layers, n_embd 2048, 32 heads of 64 (8 KV heads), expert FFN 5632, 8 experts top 2,
the default model's 49,152-token vocabulary: ~4.4 GB, 9.9x the default model's 0.45 GB. The
weights are random (scaled so activations stay O(1) through the layers); the model is for
timing only and its text is noise.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import gguf
import numpy as np

N_LAYER, N_EMBD, N_HEAD, N_HEAD_KV, N_FF, N_EXPERT, N_USED = 24, 2048, 32, 8, 5632, 8, 2
SEED = 20261201
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "var" / "bench" / "synthetic-moe8-10x.gguf"
SHAPE_KEYS = {"llama.block_count", "llama.embedding_length", "llama.feed_forward_length",
              "llama.attention.head_count", "llama.attention.head_count_kv", "llama.rope.dimension_count",
              "llama.expert_count", "llama.expert_used_count", "llama.expert_feed_forward_length",
              "llama.expert_weights_norm", "llama.expert_gating_func"}


def _q4_1(rng: np.random.Generator, rows: int, k: int, lead: tuple[int, ...] = ()) -> np.ndarray:
    """Random Q4_1 blocks [*lead, rows, k/32 * 20 bytes]: d = 1/(4 sqrt k), m = -7.5 d (zero mean)."""
    nb = k // 32
    d = np.float16(1.0 / (4.0 * np.sqrt(k)))
    m = np.float16(-7.5 * float(d))
    blk = np.empty((*lead, rows, nb, 20), np.uint8)
    blk[..., 0:2] = np.frombuffer(d.tobytes(), np.uint8)
    blk[..., 2:4] = np.frombuffer(m.tobytes(), np.uint8)
    blk[..., 4:] = rng.integers(0, 256, size=(*lead, rows, nb, 16), dtype=np.uint8)
    return blk.reshape(*lead, rows, nb * 20)


def _q8_0(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    nb = k // 32
    blk = np.empty((rows, nb, 34), np.uint8)
    blk[..., 0:2] = np.frombuffer(np.float16(0.02 / 127 * 3).tobytes(), np.uint8)
    blk[..., 2:] = rng.integers(0, 256, size=(rows, nb, 32), dtype=np.uint8)
    return blk.reshape(rows, nb * 34)


def build_synthetic_model(out: Path = DEFAULT_OUT, source: Path | None = None) -> Path:
    """Write the model to ``out`` unless a file is already there; return ``out``."""
    out = Path(out)
    if out.is_file():
        return out
    if source is None:
        from engine.default_model import build_default_model, default_model_path

        source = Path(build_default_model(default_model_path()))
    reader = gguf.GGUFReader(source)
    from engine.default_model import _field_value  # the same metadata copy the default model uses
    from engine.gguf_model import abort_gguf, commit_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name in SHAPE_KEYS:
                continue
            value, vtype, sub = _field_value(field)
            w.add_key_value(name, value, vtype, sub)
        w.add_block_count(N_LAYER)
        w.add_embedding_length(N_EMBD)
        w.add_feed_forward_length(N_FF)
        w.add_head_count(N_HEAD)
        w.add_head_count_kv(N_HEAD_KV)
        w.add_rope_dimension_count(N_EMBD // N_HEAD)
        w.add_expert_count(N_EXPERT)
        w.add_expert_used_count(N_USED)
        w.add_expert_feed_forward_length(N_FF)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        n_vocab = int(reader.get_field("llama.vocab_size").contents())
        kv = N_EMBD // N_HEAD * N_HEAD_KV
        Q41, Q80, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
        # (name, byte shape, type, maker): tensors are generated one at a time while writing
        plan: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, object]] = [
            ("token_embd.weight", (n_vocab, N_EMBD // 32 * 34), Q80, lambda r: _q8_0(r, n_vocab, N_EMBD)),
            ("output_norm.weight", (N_EMBD,), F32, lambda r: np.ones(N_EMBD, np.float32))]
        for i in range(N_LAYER):
            b = f"blk.{i}."
            plan += [
                (b + "attn_norm.weight", (N_EMBD,), F32, lambda r: np.ones(N_EMBD, np.float32)),
                (b + "attn_q.weight", (N_EMBD, N_EMBD // 32 * 20), Q41, lambda r: _q4_1(r, N_EMBD, N_EMBD)),
                (b + "attn_k.weight", (kv, N_EMBD // 32 * 20), Q41, lambda r: _q4_1(r, kv, N_EMBD)),
                (b + "attn_v.weight", (kv, N_EMBD // 32 * 20), Q41, lambda r: _q4_1(r, kv, N_EMBD)),
                (b + "attn_output.weight", (N_EMBD, N_EMBD // 32 * 20), Q41, lambda r: _q4_1(r, N_EMBD, N_EMBD)),
                (b + "ffn_norm.weight", (N_EMBD,), F32, lambda r: np.ones(N_EMBD, np.float32)),
                (b + "ffn_gate_inp.weight", (N_EXPERT, N_EMBD), F32,
                 lambda r: (r.standard_normal((N_EXPERT, N_EMBD)) / np.sqrt(N_EMBD)).astype(np.float32)),
                (b + "ffn_gate_exps.weight", (N_EXPERT, N_FF, N_EMBD // 32 * 20), Q41,
                 lambda r: _q4_1(r, N_FF, N_EMBD, (N_EXPERT,))),
                (b + "ffn_up_exps.weight", (N_EXPERT, N_FF, N_EMBD // 32 * 20), Q41,
                 lambda r: _q4_1(r, N_FF, N_EMBD, (N_EXPERT,))),
                (b + "ffn_down_exps.weight", (N_EXPERT, N_EMBD, N_FF // 32 * 20), Q41,
                 lambda r: _q4_1(r, N_EMBD, N_FF, (N_EXPERT,))),
            ]
        for name, shape, qtype, _ in plan:
            dtype = np.float32 if qtype == F32 else np.uint8
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            w.add_tensor_info(name, shape, np.dtype(dtype), nbytes, raw_dtype=qtype)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        rng = np.random.default_rng(SEED)
        for _, _, _, make in plan:
            w.write_tensor_data(make(rng))  # type: ignore[operator]
        commit_gguf(w, tmp, out)
    except BaseException:
        abort_gguf(w, tmp)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    print(build_synthetic_model(Path(args[0]) if args else DEFAULT_OUT))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
