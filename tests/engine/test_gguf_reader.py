"""engine.gguf_model reads GGUF itself (one pass, numpy for numeric arrays) instead of through gguf-py's
reader: the metadata and tensors it returns must be exactly what gguf-py's reader gives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from common.gguf_meta import read_metadata
from engine.gguf_model import open_model

_SCALARS: list[tuple[str, GGUFValueType, Any]] = [
    ("u8", GGUFValueType.UINT8, 200), ("i8", GGUFValueType.INT8, -100), ("u16", GGUFValueType.UINT16, 60000),
    ("i16", GGUFValueType.INT16, -30000), ("u32", GGUFValueType.UINT32, 4_000_000_000),
    ("i32", GGUFValueType.INT32, -2_000_000_000), ("f32", GGUFValueType.FLOAT32, 0.1),
    ("u64", GGUFValueType.UINT64, 2**63 + 5), ("i64", GGUFValueType.INT64, -(2**62)),
    ("f64", GGUFValueType.FLOAT64, 1e-300), ("flag", GGUFValueType.BOOL, True), ("off", GGUFValueType.BOOL, False),
    ("text", GGUFValueType.STRING, "naïve café 你好 🌍"), ("empty", GGUFValueType.STRING, ""),
]


def _write(path: Path) -> Path:
    rng = np.random.default_rng(1)
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    for name, vtype, value in _SCALARS:
        w.add_key_value(f"test.{name}", value, vtype)
    w.add_array("test.floats", [0.5, -1.25, 3.0e-8, 1e30])
    w.add_array("test.ints", [1, -2, 3, 2**31 - 1])
    w.add_key_value("test.u8s", [0, 7, 255], GGUFValueType.ARRAY, sub_type=GGUFValueType.UINT8)
    w.add_key_value("test.bools", [True, False, True], GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    w.add_key_value("test.f64s", [1.5, -2.5], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT64)
    w.add_array("test.none", [])
    w.add_token_list(["<s>", "</s>", "héllo", "", "▁the", "你好", "\n\t"])
    w.add_token_scores([0.0, -1.5, -2.25, 0.0, -3.0, -4.0, -5.0])
    w.add_token_types([3, 3, 1, 1, 1, 1, 6])
    w.add_token_merges(["h é", "▁ t", "th e"])
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    w.add_tensor("token_embd.weight", rng.standard_normal((7, 64)).astype(np.float32))
    q = quantize(rng.standard_normal((8, 64)).astype(np.float32), GGMLQuantizationType.Q4_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q4_0)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_metadata_and_tensors_equal_gguf_py(tmp_path: Path) -> None:
    path = _write(tmp_path / "kinds.gguf")
    r = GGUFReader(path, "r")
    mf = open_model(path)
    want = {k: f.contents() for k, f in r.fields.items()}
    assert list(mf.metadata) == list(want)  # the same keys in the same order (header fields first)
    md = read_metadata(path)  # the metadata-only walk (the tokenizer's) gives the same
    assert md == mf.metadata and list(md) == list(want)
    for k, v in want.items():
        got = mf.metadata[k]
        assert got == v and type(got) is type(v), k
        if isinstance(v, list):
            assert [type(x) for x in got] == [type(x) for x in v], k
    assert mf.metadata["test.text"] == "naïve café 你好 🌍" and mf.metadata["test.u64"] == 2**63 + 5
    assert [t.name for t in r.tensors] == list(mf.tensors)
    for t in r.tensors:
        mine = mf.tensors[t.name]
        assert (mine.type_id, mine.shape, mine.n_bytes) == (int(t.tensor_type), tuple(int(x) for x in t.shape),
                                                             int(t.n_bytes))
        assert mine.data.tobytes() == np.asarray(t.data).tobytes()
        assert not mine.data.flags.writeable  # a read-only view of the mapping, not a copy
        assert np.shares_memory(mine.data, mf.mapping)
