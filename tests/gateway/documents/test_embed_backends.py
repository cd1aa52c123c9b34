"""The embedding forward pass in ONNX Runtime (the setup-time export) against torch: fp32 gives the torch vectors
under the same index key; int8 gives close vectors under its own key; typed errors for impossible settings."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.documents.embed import Embedder, EmbedError, resolve_model_dir
from gateway.documents.onnx_export import export, find_export

TEXTS = ["fire assembly point", "The approved budget of the North Harbor Bridge project is 52.3 million euros.",
         "How much money was set aside for the North Harbor Bridge project? " * 6,
         "Ledger page 7 line 3: crate 262 of type 3 left dock 7 on the morning shift. " * 20]


def test_impossible_backend_settings_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(EmbedError, match="no ONNX export"):
        Embedder(backend="onnx", onnx_root=tmp_path)
    with pytest.raises(EmbedError, match="no int8 ONNX export"):
        Embedder(precision="int8", onnx_root=tmp_path)  # int8 never falls back: its vectors are another model's
    with pytest.raises(EmbedError, match="needs the ONNX backend"):
        Embedder(backend="torch", precision="int8")
    fallback = Embedder(onnx_root=tmp_path)  # auto without an export: torch, fp32, loaded on first use
    assert fallback.backend == "torch" and fallback.version_key == "all-MiniLM-L6-v2:384"


def test_onnx_forward_gives_the_torch_vectors(embedder: Embedder, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    name = "all-MiniLM-L6-v2"
    root = None
    if find_export(name, resolve_model_dir(name)) is None or find_export(name, resolve_model_dir(name), int8=True) is None:
        root = tmp_path  # setup did not build it (make setup does): build one here (~30 s)
        export(root=root)
    pt = Embedder(backend="torch")
    shared = root is None and embedder.backend == "onnx" and embedder.precision == "fp32"  # the default: loaded
    a = embedder if shared else Embedder(precision="fp32", onnx_root=root)
    b = Embedder(precision="int8", onnx_root=root)
    assert (a.backend, a.precision, b.backend, b.precision) == ("onnx", "fp32", "onnx", "int8")
    assert a.version_key == pt.version_key == "all-MiniLM-L6-v2:384" and b.version_key == "all-MiniLM-L6-v2-int8:384"
    ref, fp32, int8 = pt.encode(TEXTS), a.encode(TEXTS), b.encode(TEXTS)  # one padded batch of very unequal lengths
    assert fp32.shape == int8.shape == (len(TEXTS), 384)
    assert np.allclose(np.linalg.norm(int8, axis=1), 1.0, atol=1e-5)
    assert float((fp32 * ref).sum(1).min()) > 0.99999
    assert 0.95 < float((int8 * ref).sum(1).min()) < 0.99999  # close, but not the same model for an index
    single = a.encode(TEXTS[:1])[0]  # no padding (the one-thread query session): the same vector as in the batch
    assert float(single @ fp32[0]) > 0.99999
