"""The parsers of llama.cpp's benchmark output that every GPU benchmark shares (bench/engine_gpu.py)."""

import json

import pytest

from bench.engine_gpu import parse_batched_bench, parse_llama_bench


def test_llama_bench_rows_by_strata_keys() -> None:
    rows = [{"n_gen": 0, "n_prompt": 512, "avg_ts": 9000.5, "build_commit": "abc", "build_number": 1,
             "gpu_info": "H200", "backends": "CUDA"},
            {"n_gen": 0, "n_prompt": 4096, "avg_ts": 8000.0},
            {"n_gen": 128, "n_prompt": 0, "avg_ts": 300.25}]
    out = parse_llama_bench(json.dumps(rows))
    assert out == {"prefill_512_tok_s": 9000.5, "prefill_4096_tok_s": 8000.0, "decode_b1_tok_s": 300.25,
                   "build": "abc (1), H200, backends CUDA"}


def test_llama_bench_output_that_is_not_json_raises() -> None:
    with pytest.raises(json.JSONDecodeError):
        parse_llama_bench("llama-bench: error loading model")


def test_batched_bench_reads_only_its_jsonl_rows() -> None:
    text = 'main: n_kv_max = 8192\n{"pl": 8, "speed_tg": 930.3}\n{"other": 1}\n  {"pl": 32, "speed_tg": 2644.1}\n'
    assert parse_batched_bench(text) == {"decode_b8_tok_s": 930.3, "decode_b32_tok_s": 2644.1}
    assert parse_batched_bench("") == {}
