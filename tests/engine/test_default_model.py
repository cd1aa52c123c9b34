"""engine.default_model: SmolLM2-135M upcycled to an 8-expert Mixtral-style GGUF."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from engine import default_model as dm

REPO = Path(__file__).resolve().parents[2]
FFN = ("gate", "up", "down")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.build_default_model(tmp_path_factory.mktemp("default_model") / "moe8.gguf")


@pytest.fixture(scope="module")
def built_reader(built: Path) -> gguf.GGUFReader:
    """gguf-py's reader of the built file, shared by the read-only tests: each parse walks the 49k-token
    vocabulary element by element (seconds)."""
    return gguf.GGUFReader(built)


@pytest.fixture(scope="module")
def source() -> gguf.GGUFReader:
    return gguf.GGUFReader(dm.source_model_path())


def _kv(r: gguf.GGUFReader, key: str) -> Any:
    f = r.get_field(key)
    return None if f is None else f.contents()


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fp:
        while chunk := fp.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def test_expert_metadata(built_reader: gguf.GGUFReader) -> None:
    r = built_reader
    assert _kv(r, "general.architecture") == "llama"
    assert _kv(r, "llama.expert_count") == 8
    assert _kv(r, "llama.expert_used_count") == 2
    assert _kv(r, "llama.expert_feed_forward_length") == 1536
    assert _kv(r, "llama.expert_weights_norm") is True
    assert _kv(r, "llama.expert_gating_func") == int(gguf.ExpertGatingFuncType.SOFTMAX)


def test_source_metadata_preserved(built_reader: gguf.GGUFReader, source: gguf.GGUFReader) -> None:
    r = built_reader
    for name, field in source.fields.items():
        if name.startswith("GGUF."):
            continue
        got = r.get_field(name)
        assert got is not None, name
        assert got.types == field.types, name
        assert got.contents() == field.contents(), name
    assert _kv(r, "tokenizer.ggml.model") == "gpt2"
    assert "<|im_start|>" in _kv(r, "tokenizer.chat_template")
    assert _kv(r, "general.file_type") == int(gguf.LlamaFileType.MOSTLY_Q4_1)


def test_experts_are_byte_copies_of_the_dense_ffn(built_reader: gguf.GGUFReader, source: gguf.GGUFReader) -> None:
    src = {t.name: t for t in source.tensors}
    out = {t.name: t for t in built_reader.tensors}
    n_layer = _kv(source, "llama.block_count")
    assert len(out) == len(src) + n_layer  # 3 dense FFN tensors -> router + 3 expert tensors
    for i in range(n_layer):
        for kind in FFN:
            dense, exps = src[f"blk.{i}.ffn_{kind}.weight"], out[f"blk.{i}.ffn_{kind}_exps.weight"]
            assert f"blk.{i}.ffn_{kind}.weight" not in out
            assert exps.tensor_type == dense.tensor_type == gguf.GGMLQuantizationType.Q4_1
            assert [int(d) for d in exps.shape] == [*(int(d) for d in dense.shape), 8]
            raw = bytes(dense.data)
            per_expert = np.asarray(exps.data).reshape(8, -1)
            for e in range(8):
                assert per_expert[e].tobytes() == raw, (i, kind, e)
    for name, t in src.items():  # everything else is untouched
        if ".ffn_" in name and not name.endswith("ffn_norm.weight"):
            continue
        assert out[name].tensor_type == t.tensor_type and bytes(out[name].data) == bytes(t.data), name


def test_router_is_f32_seeded_and_paired(built_reader: gguf.GGUFReader, source: gguf.GGUFReader) -> None:
    out = {t.name: t for t in built_reader.tensors}
    n_layer = _kv(source, "llama.block_count")
    routers = []
    for i in range(n_layer):
        t = out[f"blk.{i}.ffn_gate_inp.weight"]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert [int(d) for d in t.shape] == [576, 8]
        w = np.asarray(t.data).reshape(8, 576)
        # identical pairs -> top-2 logits tie -> weights exactly 0.5 -> MoE output == dense output
        np.testing.assert_array_equal(w[0::2], w[1::2])
        assert len({w[j].tobytes() for j in range(0, 8, 2)}) == 4
        routers.append(w)
    rng = np.random.default_rng(dm.ROUTER_SEED)
    np.testing.assert_array_equal(routers[0], dm._router(rng, 576))
    assert not np.array_equal(routers[0], routers[1])


def test_routing_spreads_tokens_over_pairs(built_reader: gguf.GGUFReader) -> None:
    w = np.asarray({t.name: t for t in built_reader.tensors}["blk.0.ffn_gate_inp.weight"].data)
    x = np.random.default_rng(0).standard_normal((256, 576)).astype(np.float32)
    top2 = np.argsort(-(x @ w.reshape(8, 576).T), axis=1, kind="stable")[:, :2]
    assert np.all(top2[:, 0] // 2 == top2[:, 1] // 2)  # always a pair
    assert len(set(top2[:, 0] // 2)) == 4  # and every pair gets tokens


def test_idempotent(built: Path) -> None:
    before = built.stat()
    assert dm.build_default_model(built) == built
    after = built.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_validity_check(built: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert dm.is_valid_default_model(built)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    assert not dm.is_valid_default_model(bad)
    assert not dm.is_valid_default_model(tmp_path / "absent.gguf")
    monkeypatch.setattr(dm, "RECIPE_VERSION", dm.RECIPE_VERSION + 1)  # recipe change -> rebuild
    assert not dm.is_valid_default_model(built)


def test_validity_stamp_is_not_trusted_after_a_change(built: Path, tmp_path: Path) -> None:
    """A checked file is not parsed again while unchanged; a truncated or rewritten one is."""
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(built.read_bytes())
    assert dm.is_valid_default_model(copy)
    stamp = tmp_path / "copy.gguf.valid"
    assert stamp.is_file()
    with copy.open("r+b") as f:  # truncated in place: size and mtime change, the stamp no longer matches
        f.truncate(copy.stat().st_size // 2)
    assert not dm.is_valid_default_model(copy)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    (tmp_path / "bad.gguf.valid").write_text(stamp.read_text())  # another file's stamp proves nothing
    assert not dm.is_valid_default_model(bad)


@pytest.mark.slow
def test_invalid_file_is_rebuilt_identically(built: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    out.write_bytes(b"half a file")
    assert dm.build_default_model(out) == out
    assert _sha(out) == _sha(built)  # deterministic: same seed, same bytes
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    ino = out.stat().st_ino
    dm.build_default_model(out, force=True)
    assert out.stat().st_ino != ino  # force rewrote it (temp file + rename)


def test_default_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("STRATA_MODEL_DIR", raising=False)
    assert dm.default_model_path() == REPO / "var" / "models" / "smollm2-135m-moe8.gguf"
    monkeypatch.setenv("STRATA_MODEL_DIR", str(tmp_path))
    assert dm.default_model_path() == tmp_path / "smollm2-135m-moe8.gguf"


def test_cli_prints_path(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert dm.main(["--out", str(built)]) == 0
    assert capsys.readouterr().out.strip() == str(built)


def test_llama_cpp_upcycled_equals_dense(built: Path) -> None:
    import llama_cpp

    logits = []
    for path in (dm.source_model_path(), built):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=2)
        try:
            ids = llm.tokenize(b"The capital of France is")
            llm.eval(ids)
            logits.append(np.asarray(llm.scores[: len(ids)]))
        finally:
            llm.close()
    np.testing.assert_array_equal(logits[0], logits[1])


def test_q4_k_quantiser_round_trips_through_gguf_py() -> None:
    """quantize_q4_k writes ggml's block_q4_K layout: gguf-py's dequantiser reads it back within
    4-bit error, and values on the 4-bit grid come back as the same codes (up to the f16 rounding
    of the super-block scale)."""
    x = np.random.default_rng(5).standard_normal((4, 512)).astype(np.float32) * 0.05
    y = gguf.quants.dequantize(dm.quantize_q4_k(x), gguf.GGMLQuantizationType.Q4_K).reshape(x.shape)
    assert np.sqrt(np.mean((y - x) ** 2)) <= 0.1 * np.sqrt(np.mean(x**2))
    codes = np.random.default_rng(6).integers(0, 16, size=(2, 256)).astype(np.float32)
    codes[:, ::32] = 0  # every sub-block spans 0..15: scale 1, offset 0
    codes[:, 1::32] = 15
    z = gguf.quants.dequantize(dm.quantize_q4_k(codes), gguf.GGMLQuantizationType.Q4_K).reshape(codes.shape)
    assert np.array_equal(np.rint(z), codes) and np.abs(z - codes).max() < 0.01
    with pytest.raises(dm.DefaultModelError, match="multiple of 256"):
        dm.quantize_q4_k(np.zeros((1, 576), np.float32))


@pytest.fixture(scope="module")
def built_k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dm.build_default_model(tmp_path_factory.mktemp("default_model_k") / "moe8-q4k.gguf", quant="k")


def test_k_quant_build(built: Path, built_reader: gguf.GGUFReader, built_k: Path, monkeypatch: pytest.MonkeyPatch,
                      tmp_path: Path) -> None:
    """The k-quant build: down experts Q4_K (the only 256-divisible rows), everything else as in the
    Q4_1 build; each build's validity check refuses the other; the engine's next-token logits on
    it stay close to the Q4_1 build's."""
    from engine.engine import Engine

    types = {t.name: t.tensor_type for t in gguf.GGUFReader(built_k).tensors}
    base = {t.name: t.tensor_type for t in built_reader.tensors}
    assert types.keys() == base.keys()
    for name, qt in types.items():
        want = gguf.GGMLQuantizationType.Q4_K if name.endswith("ffn_down_exps.weight") else base[name]
        assert qt == want, name
    assert dm.is_valid_default_model(built_k, "k") and not dm.is_valid_default_model(built_k)
    assert not dm.is_valid_default_model(built, "k")
    monkeypatch.setenv("STRATA_MODEL_DIR", str(tmp_path))
    assert dm.default_model_path("k") == tmp_path / "smollm2-135m-moe8-q4k.gguf"
    with pytest.raises(dm.DefaultModelError, match="unknown default-model build"):
        dm.default_model_path("q2")
    prompt = [1, 504, 3458, 282, 4649, 314, 216]
    with Engine.open(built, threads=2, kv_tokens=256) as eng:
        ref = eng.logits_for(prompt)[-1]
    with Engine.open(built_k, threads=2, kv_tokens=256) as eng:
        got = eng.logits_for(prompt)[-1]
    assert np.corrcoef(ref, got)[0, 1] > 0.98
