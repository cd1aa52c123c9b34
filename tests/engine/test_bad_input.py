"""Bad model files and impossible requests raise clear, typed errors; the process lives."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from engine.engine import Engine, EngineError, KVCapacityError
from engine.gguf_model import GGUFError, UnsupportedModelError, build_desc, open_model
from engine.native import ffi, lib
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
    blob = np.zeros((256, 50), np.uint8)  # 256 rows of one IQ1_S block (256 elements in 50 bytes)
    path = make_random_gguf(tmp_path / "iq.gguf", n_embd=256, n_head=4, n_head_kv=2, n_ff=256, raw_overrides={
        "blk.0.attn_q.weight": (blob, blob.shape, GGMLQuantizationType.IQ1_S)})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.attn_q\.weight.*IQ1_S") as ei:
        Engine.open(path, threads=1, kv_tokens=64)
    assert str(path) in str(ei.value)


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    """A shape the C checks refuse is the typed load error, carrying the C message."""
    path = make_random_gguf(tmp_path / "shape.gguf",
                            overrides={"blk.1.attn_k.weight": np.zeros((40, 64), np.float32)})
    with pytest.raises(GGUFError, match=r"layer 1: tensor attn_k has ne\[1\]=40, expected 32") as ei:
        Engine.open(path, threads=1, kv_tokens=64)
    assert ei.value.path == str(path) and ei.value.code == lib.ST_EINVAL


def test_missing_tensor(tmp_path: Path) -> None:
    path = make_random_gguf(tmp_path / "missing.gguf", omit=("blk.0.ffn_down_exps.weight",))
    with pytest.raises(GGUFError, match="layer 0: tensor ffn_down_exps is missing"):
        Engine.open(path, threads=1, kv_tokens=64)


def _patch_metadata_u32(path: Path, key: str, value: int) -> None:
    from gguf import GGUFReader

    r = GGUFReader(path, "r+")
    r.fields[key].parts[-1][0] = value
    r.data.flush()
    del r


@pytest.mark.parametrize(("key", "value", "match"), [
    ("llama.block_count", 0xFFFFFFFF, r"'llama.block_count' = 4294967295 is out of range"),
    ("llama.attention.head_count", 1 << 20, "out of range"),
    ("llama.embedding_length", 0, "out of range"),
])
def test_absurd_hyper_parameters_are_refused_before_allocation(good: Path, tmp_path: Path, key: str, value: int,
                                                               match: str) -> None:
    bad = tmp_path / "hp.gguf"
    shutil.copy(good, bad)
    _patch_metadata_u32(bad, key, value)
    with pytest.raises(GGUFError, match=match):
        Engine.open(bad, threads=1, kv_tokens=64)


def _desc(good: Path) -> tuple[Any, list[Any]]:
    mf = open_model(good)
    desc, keep = build_desc(mf)
    return desc, keep + [mf]


def _create(desc: Any) -> tuple[int, str]:
    pm = ffi.new("st_model **")
    rc = lib.st_model_create(desc, pm)
    if rc == 0:
        lib.st_model_destroy(pm[0])
    return rc, ffi.string(lib.st_last_error()).decode()


def test_c_accepts_the_descriptor_python_builds(good: Path) -> None:
    desc, _keep = _desc(good)
    assert _create(desc)[0] == 0


def test_c_checks_byte_length_against_type_and_shape(good: Path) -> None:
    desc, _keep = _desc(good)
    desc.layers[1].wq.n_bytes -= 1
    rc, msg = _create(desc)
    assert rc == lib.ST_EINVAL and "layer 1: tensor attn_q holds" in msg and "need" in msg


def test_c_checks_every_tensor_lies_inside_the_mapping(good: Path) -> None:
    desc, _keep = _desc(good)
    desc.map_bytes -= 1  # the last tensor now ends one byte past the mapping
    rc, msg = _create(desc)
    assert rc == lib.ST_ERANGE and "outside the model file" in msg
    desc, _keep = _desc(good)
    desc.layers[0].wv.data = ffi.cast("void *", int(ffi.cast("uintptr_t", desc.map_data)) - 64)
    rc, msg = _create(desc)
    assert rc == lib.ST_ERANGE and "layer 0: tensor attn_v" in msg
    desc, _keep = _desc(good)
    desc.map_data = ffi.NULL
    rc, msg = _create(desc)
    assert rc == lib.ST_EINVAL and "mapping" in msg


def test_c_bounds_dimensions_in_64_bits(good: Path) -> None:
    desc, _keep = _desc(good)
    desc.n_layer = 1 << 30  # refused before the layer table is allocated
    assert _create(desc)[0] == lib.ST_EINVAL
    desc, _keep = _desc(good)
    desc.n_head, desc.head_dim, desc.n_head_kv = 1024, 1024, 1024  # 2^20 > the longest row, no 32-bit wrap
    rc, msg = _create(desc)
    assert rc == lib.ST_EUNSUPPORTED and "exceeds the longest row" in msg
    desc, _keep = _desc(good)
    t = desc.layers[0].gate_exps
    t.ne[1], t.ne[2] = 1 << 40, 1 << 40  # bytes would wrap 64 bits
    rc, msg = _create(desc)
    assert rc in (lib.ST_EINVAL, lib.ST_ERANGE) and "gate_exps" in msg
    desc, _keep = _desc(good)
    desc.layers[0].attn_norm.ne[0] = -64
    assert _create(desc)[0] == lib.ST_EINVAL
    desc, _keep = _desc(good)
    desc.rope_base = float("nan")
    assert _create(desc)[0] == lib.ST_EINVAL


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


@pytest.mark.parametrize(("offset", "value", "match"), [
    (8, 1 << 62, "tensor count"),       # header: tensor count
    (16, (1 << 64) - 1, "metadata count"),  # header: metadata count
    (24, 1 << 60, "metadata key 0"),    # the first key's string length
    (4, 1 << 24, "version"),
])
def test_huge_counts_and_lengths_are_refused_before_parsing(good: Path, tmp_path: Path, offset: int, value: int,
                                                            match: str) -> None:
    """gguf-py trusts these; the layout check bounds every one by the bytes left."""
    bad = tmp_path / "counts.gguf"
    data = bytearray(good.read_bytes())
    size = 4 if offset == 4 else 8
    data[offset:offset + size] = value.to_bytes(size, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=match):
        open_model(bad)


def test_python_bounds_mirror_the_c_bounds() -> None:
    """gguf_model refuses absurd hyper-parameters with the same limits st_model_create uses."""
    import re

    import engine.gguf_model as gm

    header = (Path(gm.__file__).parent / "csrc" / "internal.h").read_text()
    c = {k: int(a) << int(b or 0) for k, a, b in re.findall(r"#define ST_MAX_(\w+) \(?(\d+)(?: << (\d+))?", header)}
    assert {k: c[k] for k in ("LAYERS", "HEADS", "HEAD_DIM", "ROW", "EXPERTS", "EXPERTS_USED", "VOCAB")} == {
        "LAYERS": gm.MAX_LAYERS, "HEADS": gm.MAX_HEADS, "HEAD_DIM": gm.MAX_HEAD_DIM, "ROW": gm.MAX_ROW,
        "EXPERTS": gm.MAX_EXPERTS, "EXPERTS_USED": gm.MAX_EXPERTS_USED, "VOCAB": gm.MAX_VOCAB}
