"""Synthetic 8-expert, top-2 llama-architecture MoE models written at bench time (never committed): the
default model's tokenizer and chat metadata, random Q4_1 weights (Q8_0 tied embedding / output head, F32 norms
and router).

    python -m bench.synthetic_moe [OUT.gguf]        # the 10x shape, default var/bench/synthetic-moe8-10x.gguf
    python -m bench.synthetic_moe --shape default --source META.gguf OUT.gguf
    python -m bench.synthetic_moe --metadata-only OUT.gguf   # the default model's metadata, no tensors (~2 MB)

Shapes: ``10x`` (24 layers, n_embd 2048, 32 heads of 64 (8 KV heads), expert FFN 5632, 8 experts top 2, the
default model's 49,152-token vocabulary: ~4.4 GB, 9.9x the default model's 0.45 GB) and ``default`` (the
default model's own shape: 30 layers, n_embd 576, 9 heads of 64 (3 KV heads), expert FFN 1536: 0.45 GB), for a
machine that lacks the default model's package but must serve requests as it does (tools/gpu/gateway_overhead.sh:
the same tokenizer and chat template, so the gateway counts and renders prompts as with the default model, and
the same compute per token). The source of the metadata is the default model, or a metadata-only copy of it
(``--metadata-only``: what tools/gpu/gateway_wheels.sh carries instead of the model's 98 MB package). The
weights are random (scaled so activations stay O(1) through the layers); the model is for timing only and its
text is noise.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np


@dataclass(frozen=True)
class Shape:
    """A model's dimensions: layers, width, attention heads (query, KV; 64 wide at both shapes), expert FFN
    width, experts and experts used per token."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_expert: int = 8
    n_used: int = 2


SHAPES = {"10x": Shape(24, 2048, 32, 8, 5632), "default": Shape(30, 576, 9, 3, 1536)}
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


def _default_source() -> Path:
    from engine.default_model import build_default_model, default_model_path

    return Path(build_default_model(default_model_path()))


def write_metadata(out: Path, source: Path | None = None) -> Path:
    """Every metadata key of ``source`` (default: the default model) and no tensor, to ``out``: the tokenizer,
    chat template and shape keys that build_synthetic_model reads, ~2 MB instead of the model's 0.45 GB."""
    from engine.default_model import _field_value
    from engine.gguf_model import abort_gguf, commit_gguf

    reader = gguf.GGUFReader(source if source is not None else _default_source())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, str(reader.get_field("general.architecture").contents()))
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            value, vtype, sub = _field_value(field)
            w.add_key_value(name, value, vtype, sub)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        commit_gguf(w, tmp, out)
    except BaseException:
        abort_gguf(w, tmp)
        raise
    return out


def build_synthetic_model(out: Path = DEFAULT_OUT, source: Path | None = None, shape: Shape = SHAPES["10x"]) -> Path:
    """Write the model of ``shape`` to ``out`` unless a file is already there; return ``out``. ``source``: where
    the tokenizer and chat metadata come from (default: the default model)."""
    out = Path(out)
    if out.is_file():
        return out
    if source is None:
        source = _default_source()
    reader = gguf.GGUFReader(source)
    from engine.default_model import _field_value  # the same metadata copy the default model uses
    from engine.gguf_model import abort_gguf, commit_gguf

    n_layer, n_embd, n_head, n_head_kv, n_ff = shape.n_layer, shape.n_embd, shape.n_head, shape.n_head_kv, shape.n_ff
    n_expert, n_used = shape.n_expert, shape.n_used
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture" or name in SHAPE_KEYS:
                continue
            value, vtype, sub = _field_value(field)
            w.add_key_value(name, value, vtype, sub)
        w.add_block_count(n_layer)
        w.add_embedding_length(n_embd)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(n_embd // n_head)
        w.add_expert_count(n_expert)
        w.add_expert_used_count(n_used)
        w.add_expert_feed_forward_length(n_ff)
        w.add_expert_weights_norm(True)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        n_vocab = int(reader.get_field("llama.vocab_size").contents())
        kv = n_embd // n_head * n_head_kv
        Q41, Q80, F32 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F32
        # (name, byte shape, type, maker): tensors are generated one at a time while writing
        plan: list[tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, object]] = [
            ("token_embd.weight", (n_vocab, n_embd // 32 * 34), Q80, lambda r: _q8_0(r, n_vocab, n_embd)),
            ("output_norm.weight", (n_embd,), F32, lambda r: np.ones(n_embd, np.float32))]
        for i in range(n_layer):
            b = f"blk.{i}."
            plan += [
                (b + "attn_norm.weight", (n_embd,), F32, lambda r: np.ones(n_embd, np.float32)),
                (b + "attn_q.weight", (n_embd, n_embd // 32 * 20), Q41, lambda r: _q4_1(r, n_embd, n_embd)),
                (b + "attn_k.weight", (kv, n_embd // 32 * 20), Q41, lambda r: _q4_1(r, kv, n_embd)),
                (b + "attn_v.weight", (kv, n_embd // 32 * 20), Q41, lambda r: _q4_1(r, kv, n_embd)),
                (b + "attn_output.weight", (n_embd, n_embd // 32 * 20), Q41, lambda r: _q4_1(r, n_embd, n_embd)),
                (b + "ffn_norm.weight", (n_embd,), F32, lambda r: np.ones(n_embd, np.float32)),
                (b + "ffn_gate_inp.weight", (n_expert, n_embd), F32,
                 lambda r: (r.standard_normal((n_expert, n_embd)) / np.sqrt(n_embd)).astype(np.float32)),
                (b + "ffn_gate_exps.weight", (n_expert, n_ff, n_embd // 32 * 20), Q41,
                 lambda r: _q4_1(r, n_ff, n_embd, (n_expert,))),
                (b + "ffn_up_exps.weight", (n_expert, n_ff, n_embd // 32 * 20), Q41,
                 lambda r: _q4_1(r, n_ff, n_embd, (n_expert,))),
                (b + "ffn_down_exps.weight", (n_expert, n_embd, n_ff // 32 * 20), Q41,
                 lambda r: _q4_1(r, n_embd, n_ff, (n_expert,))),
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
    p = argparse.ArgumentParser(prog="python -m bench.synthetic_moe", description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, help=f"the GGUF to write (default {DEFAULT_OUT} for the 10x shape)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="10x", help="the model's shape (default 10x)")
    p.add_argument("--source", type=Path, help="the GGUF whose metadata (tokenizer, chat template) the model "
                   "takes (default: the default model)")
    p.add_argument("--metadata-only", action="store_true",
                   help="write the source's metadata alone (no tensors) to OUT: a --source for another machine")
    args = p.parse_args(argv)
    if args.metadata_only:
        if args.out is None:
            p.error("--metadata-only needs OUT")
        print(write_metadata(args.out, args.source))
        return 0
    if args.out is None and args.shape != "10x":
        p.error(f"--shape {args.shape} needs OUT")
    print(build_synthetic_model(args.out or DEFAULT_OUT, args.source, SHAPES[args.shape]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
