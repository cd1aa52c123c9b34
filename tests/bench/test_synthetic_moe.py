"""The synthetic MoE models of bench/synthetic_moe.py: the ``default`` shape is the default model's, and a model
built from a metadata-only copy of the default model carries its tokenizer and chat template unchanged (the
gateway then loads the same tokenizer document, by digest, as for the default model). Written at a small shape:
the real ones are 0.45 and 4.4 GB."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf import GGUFReader

from bench.synthetic_moe import SHAPE_KEYS, SHAPES, Shape, build_synthetic_model, main, write_metadata
from common.gguf_meta import read_metadata
from common.prompt import tokenizer_document
from engine.default_model import build_default_model, default_model_path
from gateway.tokencount import LocalCounter


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return Path(build_default_model(default_model_path()))


@pytest.fixture(scope="module")
def meta_gguf(default_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_metadata(tmp_path_factory.mktemp("meta") / "default-meta.gguf", default_gguf)


def test_the_default_shape_is_the_default_models(default_gguf: Path) -> None:
    md = read_metadata(default_gguf)
    s = SHAPES["default"]
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.n_ff, s.n_expert, s.n_used) == (
        md["llama.block_count"],
        md["llama.embedding_length"],
        md["llama.attention.head_count"],
        md["llama.attention.head_count_kv"],
        md["llama.expert_feed_forward_length"],
        md["llama.expert_count"],
        md["llama.expert_used_count"],
    )
    assert s.n_embd // s.n_head == md["llama.rope.dimension_count"]


def test_the_metadata_copy_holds_every_key_and_no_tensor(default_gguf: Path, meta_gguf: Path) -> None:
    meta, ref = read_metadata(meta_gguf), read_metadata(default_gguf)
    assert meta.pop("GGUF.tensor_count") == 0 and ref.pop("GGUF.tensor_count") == 302
    assert meta == ref
    assert meta_gguf.stat().st_size < 3 << 20  # what tools/gpu/gateway_wheels.sh carries (gzipped: ~0.5 MB)


def test_a_model_from_the_copy_has_the_default_models_tokenizer(
    default_gguf: Path, meta_gguf: Path, tmp_path: Path
) -> None:
    small = Shape(n_layer=2, n_embd=128, n_head=2, n_head_kv=1, n_ff=64, n_expert=4, n_used=2)
    out = build_synthetic_model(tmp_path / "m.gguf", meta_gguf, small)
    md, ref = read_metadata(out), read_metadata(default_gguf)
    same = set(md) - SHAPE_KEYS - {"GGUF.tensor_count"}
    assert same == set(ref) - SHAPE_KEYS - {"GGUF.tensor_count"}
    assert {k: md[k] for k in same} == {k: ref[k] for k in same}
    assert (
        md["llama.block_count"],
        md["llama.embedding_length"],
        md["llama.attention.head_count"],
        md["llama.attention.head_count_kv"],
        md["llama.expert_count"],
    ) == (2, 128, 2, 1, 4)
    # the lane serves this document and names its digest: the gateway builds the very same tokenizer and template
    doc, digest = tokenizer_document(md)
    assert (doc, digest) == tokenizer_document(ref)
    body = {"model": "strata-default", "messages": [{"role": "user", "content": "Name three colours."}]}
    count = LocalCounter(digest, json.loads(doc)).count(body, "strata-default")
    assert count is not None and count > 10  # the template's system prompt and turn markers besides the words
    names = {t.name: t.tensor_type.name for t in GGUFReader(out).tensors}
    assert names["token_embd.weight"] == "Q8_0" and names["blk.1.ffn_down_exps.weight"] == "Q4_1"
    assert len(names) == 2 + 2 * 10
    assert build_synthetic_model(out, meta_gguf, small) == out  # an existing file is kept


def test_the_cli_wants_a_path_for_a_copy_or_another_shape(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--metadata-only"], ["--shape", "default"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "needs OUT" in capsys.readouterr().err
