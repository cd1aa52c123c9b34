"""Build the ONNX Runtime forward pass of the embedding model at setup time (never at run time, never committed).

    PYTHONPATH=. .venv/bin/python -m gateway.documents.onnx_export            # the default model
    PYTHONPATH=. .venv/bin/python -m gateway.documents.onnx_export --model /srv/models/my-sentence-model

Writes ``<out>/<model name>/model.onnx`` (default ``var/models/embed``): the transformer of the
sentence-transformers model (token ids -> last hidden states), exported from the installed weights
with torch's exporter; ``model-int8.onnx``: the same with its matrix weights quantised to int8 per
output channel (ONNX Runtime's dynamic quantisation: activations quantised per batch at run time);
and ``export.json`` naming the weights they came from (size and SHA-256 of ``model.safetensors``), so
an export of other weights is never used. sentence-transformers still tokenises, batches, pools and
normalises (gateway.documents.embed swaps only its transformer's forward).

The fp32 export is checked before it is kept: vectors of padded batches of several shapes must match
the torch model's (cosine >= 0.99999), since a traced export can freeze shape-dependent branches. The
int8 model is *not* the same model as far as an index is concerned (cosine ~0.99 to fp32): its vectors
carry another index key (``<model>-int8``). Idempotent: an export that matches the weights is left alone
(``--force`` rebuilds it). Needs the packages onnx and onnxruntime (the ``rag`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from gateway.documents.config import DEFAULT_EMBED_MODEL

__all__ = ["DEFAULT_ONNX_DIR", "INT8_FILE", "ONNX_FILE", "ExportError", "export", "export_dir", "find_export",
           "weights_id"]

DEFAULT_ONNX_DIR = Path(__file__).resolve().parents[2] / "var" / "models" / "embed"
ONNX_FILE = "model.onnx"
INT8_FILE = "model-int8.onnx"
META_FILE = "export.json"
_OPSET = 17
_MIN_COSINE = 0.99999


class ExportError(RuntimeError):
    """The model cannot be exported, or its export does not reproduce the torch model's vectors."""


def weights_id(model_dir: Path) -> dict[str, Any]:
    """What identifies the weights an export was made from."""
    for name in ("model.safetensors", "pytorch_model.bin"):
        p = model_dir / name
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while block := f.read(1 << 20):
                    h.update(block)
            return {"file": name, "bytes": p.stat().st_size, "sha256": h.hexdigest()}
    raise ExportError(f"no model.safetensors or pytorch_model.bin in {model_dir}")


def export_dir(model_name: str, root: Path | None = None) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model_name)
    return (root or DEFAULT_ONNX_DIR) / safe


def find_export(model_name: str, model_dir: Path, root: Path | None = None, *, int8: bool = False) -> Path | None:
    """The export of these weights (``int8``: the quantised one), or None (missing, or made from other weights).
    Cheap: compares the weights' size and modification time recorded at export before hashing anything."""
    d = export_dir(model_name, root)
    onnx_path, meta_path = d / (INT8_FILE if int8 else ONNX_FILE), d / META_FILE
    if not onnx_path.is_file() or not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text())
        src = model_dir / meta["weights"]["file"]
        st = src.stat()
        if st.st_size != meta["weights"]["bytes"]:
            return None
        if st.st_mtime_ns != meta.get("weights_mtime_ns"):  # touched since: hash to be sure
            if weights_id(model_dir)["sha256"] != meta["weights"]["sha256"]:
                return None
    except (OSError, ValueError, KeyError, TypeError, ExportError):
        return None
    return onnx_path


class _LastHidden:  # built lazily: torch is imported only by export()
    @staticmethod
    def wrap(model: Any) -> Any:
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, inner: Any) -> None:
                super().__init__()
                self.inner = inner

            def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                 return_dict=True)
                return out.last_hidden_state

        return Wrapper(model)


def _check(onnx_path: Path, st_model: Any, threads: int = 1) -> float:
    """Worst cosine between the torch model's sentence vectors and an export's, over padded batches."""
    import numpy as np
    import onnxruntime as ort

    texts = ["short", "The approved budget of the North Harbor Bridge project is 52.3 million euros.",
             "How much money was set aside for it? " * 12, "a b c d e f g", "Ledger page 7 line 3: crate 262 " * 30]
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    sess = ort.InferenceSession(str(onnx_path), so, providers=["CPUExecutionProvider"])
    tok = st_model.tokenizer
    worst = 1.0
    for batch in (texts[:1], texts[:3], texts, texts[2:]):
        ref = st_model.encode(batch, normalize_embeddings=True, convert_to_numpy=True)
        enc = tok(batch, padding=True, truncation=True, max_length=st_model.max_seq_length, return_tensors="np")
        feeds = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64),
                 "token_type_ids": enc.get("token_type_ids", np.zeros_like(enc["input_ids"])).astype(np.int64)}
        hidden = sess.run(None, feeds)[0]
        m = feeds["attention_mask"][..., None].astype(np.float32)
        v = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        v /= np.linalg.norm(v, axis=1, keepdims=True)
        worst = min(worst, float((v * ref).sum(1).min()))
    return worst


def export(model: str = DEFAULT_EMBED_MODEL, root: Path | None = None, *, force: bool = False) -> Path:
    """Export ``model``'s transformer to ONNX (idempotent); the path of ``model.onnx``."""
    from gateway.documents.embed import resolve_model_dir

    model_dir = resolve_model_dir(model)
    name = model if model == DEFAULT_EMBED_MODEL else model_dir.name
    found = None if force else find_export(name, model_dir, root)
    if found is not None and find_export(name, model_dir, root, int8=True) is not None:
        return found
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(str(model_dir), device="cpu", local_files_only=True)
    wrapped = _LastHidden.wrap(st_model[0].auto_model).eval()
    # padded example: the mask path must be traced (an all-ones mask may be optimised away by the model code)
    ids = torch.tensor([[101, 2023, 2003, 1037, 3231, 102], [101, 7592, 102, 0, 0, 0]], dtype=torch.long)
    mask = (ids != 0).long()
    types = torch.zeros_like(ids)
    out_dir = export_dir(name, root)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".export-") as tmp:
        tmp_onnx = Path(tmp) / ONNX_FILE
        try:
            with torch.no_grad():
                torch.onnx.export(wrapped, (ids, mask, types), str(tmp_onnx), dynamo=False, opset_version=_OPSET,
                                  input_names=["input_ids", "attention_mask", "token_type_ids"],
                                  output_names=["last_hidden_state"],
                                  dynamic_axes={k: {0: "batch", 1: "seq"} for k in
                                                ("input_ids", "attention_mask", "token_type_ids", "last_hidden_state")})
        except Exception as e:  # only BERT-like encoders (ids, mask, token types) export this way
            raise ExportError(f"{name}: torch could not export the model: {type(e).__name__}: {e}") from None
        cos = _check(tmp_onnx, st_model)
        if cos < _MIN_COSINE:
            raise ExportError(f"{name}: the ONNX export's vectors differ from the torch model's (worst cosine "
                              f"{cos:.6f} < {_MIN_COSINE})")
        tmp_int8 = Path(tmp) / INT8_FILE
        try:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            # per output channel: per-tensor scales cost far more accuracy (worst cosine ~0.92 vs ~0.987 here)
            quantize_dynamic(tmp_onnx, tmp_int8, weight_type=QuantType.QInt8, per_channel=True)
        except Exception as e:
            raise ExportError(f"{name}: quantising the export to int8 failed: {type(e).__name__}: {e}") from None
        cos8 = _check(tmp_int8, st_model)
        src = weights_id(model_dir)
        meta = {"model": name, "weights": src, "weights_mtime_ns": (model_dir / src["file"]).stat().st_mtime_ns,
                "opset": _OPSET, "torch": torch.__version__, "worst_cosine_vs_torch": round(cos, 8),
                "int8_worst_cosine_vs_torch": round(cos8, 5)}
        (out_dir / META_FILE).unlink(missing_ok=True)  # written last: no metadata names a half-replaced pair
        os.replace(tmp_onnx, out_dir / ONNX_FILE)
        os.replace(tmp_int8, out_dir / INT8_FILE)
        (out_dir / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    return out_dir / ONNX_FILE


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_EMBED_MODEL, help="the packaged model's name or a local directory")
    ap.add_argument("--out", type=Path, default=None, help=f"root of the exports (default {DEFAULT_ONNX_DIR})")
    ap.add_argument("--force", action="store_true", help="rebuild even when an export of these weights exists")
    args = ap.parse_args(argv)
    try:
        path = export(args.model, args.out, force=args.force)
    except ExportError as e:
        print(f"onnx_export: {e}", file=sys.stderr)
        return 1
    print(f"onnx_export: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
