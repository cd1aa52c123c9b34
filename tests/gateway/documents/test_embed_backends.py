"""The embedding forward pass in ONNX Runtime (the setup-time export) against torch: the same vectors, one index
key, and a typed error when the ONNX backend is asked for without an export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gateway.documents.embed import Embedder, EmbedError, resolve_model_dir
from gateway.documents.onnx_export import export, find_export

TEXTS = ["fire assembly point", "The approved budget of the North Harbor Bridge project is 52.3 million euros.",
         "How much money was set aside for the North Harbor Bridge project? " * 6,
         "Ledger page 7 line 3: crate 262 of type 3 left dock 7 on the morning shift. " * 20]


def test_onnx_backend_without_an_export_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(EmbedError, match="no ONNX export"):
        Embedder(backend="onnx", onnx_root=tmp_path)


def test_onnx_forward_gives_the_torch_vectors(embedder: Embedder, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    root = None if find_export(embedder.name, resolve_model_dir(embedder.name)) is not None else tmp_path
    if root is not None:  # setup did not build it (make setup does): build one here (~10 s)
        export(root=root)
    ort = embedder if embedder.backend == "onnx" else Embedder(backend="onnx", onnx_root=root)
    pt = embedder if embedder.backend == "torch" else Embedder(backend="torch")
    assert ort.backend == "onnx" and pt.backend == "torch" and ort.version_key == pt.version_key
    a, b = ort.encode(TEXTS), pt.encode(TEXTS)  # one padded batch of very different lengths
    assert a.shape == b.shape == (len(TEXTS), 384)
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert float((a * b).sum(1).min()) > 0.99999
    single = ort.encode(TEXTS[:1])[0]  # no padding: the same vector as inside the batch
    assert float(single @ a[0]) > 0.99999
