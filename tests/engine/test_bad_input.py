"""Bad model files and impossible requests raise clear, typed errors; the process lives."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from engine.engine import Engine, EngineError, KVCapacityError
from engine.gguf_model import GGUFError, UnsupportedModelError, open_model
from tests.engine.gguf_factory import make_random_gguf


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_gguf(tmp_path_factory.mktemp("good") / "good.gguf")


def test_truncated_file(good: Path, tmp_path: Path) -> None:
    data = good.read_bytes()
    for cut in (6, 100, len(data) // 2, len(data) - 1):
        bad = tmp_path / f"trunc{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFError) as ei:
            Engine.open(bad, threads=1, kv_tokens=64)
        assert str(bad) in str(ei.value)
        assert "trunc" in str(ei.value) or "corrupt" in str(ei.value) or "short" in str(ei.value)


def test_flipped_magic(good: Path, tmp_path: Path) -> None:
    bad = tmp_path / "magic.gguf"
    data = bytearray(good.read_bytes())
    data[0] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match="bad magic") as ei:
        open_model(bad)
    assert ei.value.path == str(bad)


def test_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="not found"):
        open_model(tmp_path / "nope.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        open_model(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "arch.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'mamba'"):
        open_model(path)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    blob = np.zeros((256, 66), np.uint8)  # 256 rows of one IQ2_XXS block (256 elements in 66 bytes)
    path = make_random_gguf(tmp_path / "iq.gguf", n_embd=256, n_head=4, n_head_kv=2, n_ff=256, raw_overrides={
        "blk.0.attn_q.weight": (blob, blob.shape, GGMLQuantizationType.IQ2_XXS)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*IQ2_XXS") as ei:
        Engine.open(path, threads=1, kv_tokens=64)
    assert str(path) in str(ei.value)


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    path = make_random_gguf(tmp_path / "shape.gguf",
                            overrides={"blk.1.attn_k.weight": np.zeros((40, 64), np.float32)})
    with pytest.raises(EngineError, match=r"layer 1: tensor attn_k has ne\[1\]=40, expected 32"):
        Engine.open(path, threads=1, kv_tokens=64)


def test_missing_tensor(tmp_path: Path) -> None:
    path = make_random_gguf(tmp_path / "missing.gguf", omit=("blk.0.ffn_down_exps.weight",))
    with pytest.raises(EngineError, match="layer 0: tensor ffn_down_exps is missing"):
        Engine.open(path, threads=1, kv_tokens=64)


def test_prompt_longer_than_kv_capacity(good: Path) -> None:
    with Engine.open(good, threads=1, kv_tokens=64) as eng:
        with pytest.raises(KVCapacityError, match="KV cache"):
            eng.generate(list(range(100)), max_tokens=4)
        # nothing leaked, and the engine still works
        assert eng.blocks.num_free == eng.blocks.n_blocks
        assert len(eng.generate(list(range(10)), max_tokens=4).token_ids) == 4


def test_out_of_range_token_and_block(good: Path) -> None:
    with Engine.open(good, threads=1, kv_tokens=64) as eng:
        with pytest.raises(EngineError, match="token id 999 out of range"):
            eng.forward([999], [0], [0], [[0]], [0])
        with pytest.raises(EngineError, match="outside"):
            eng.forward([1], [0], [0], [[77]], [0])
        with pytest.raises(EngineError, match="exceeds"):
            eng.forward([1], [40], [0], [[0]], [0])


def test_file_is_not_modified_by_loading(good: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    shutil.copy(good, copy)
    before = copy.read_bytes()
    with Engine.open(copy, threads=1, kv_tokens=64) as eng:
        eng.generate([1, 2, 3], max_tokens=2)
    assert copy.read_bytes() == before
