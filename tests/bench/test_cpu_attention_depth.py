"""bench.cpu_attention_depth's kernel mode: GB/s per thread of the F16 and 8-bit caches' attention, reference
against the selected variant, on small random caches."""

from __future__ import annotations

import pytest

from bench.cpu_attention_depth import kernel_call, kv_bytes_per_key, main, run_kernels


def test_kv_bytes_per_key() -> None:
    assert kv_bytes_per_key("f16", 128, 128) == 512.0
    assert kv_bytes_per_key("q8_0", 128, 128) == 272.0  # int8 values and an F16 scale per 32


def test_run_kernels_reports_both_caches_and_variants() -> None:
    logs: list[str] = []
    rep = run_kernels([0, 40], 64, 3, 1, logs.append)
    assert [(r["depth"], r["kv_type"]) for r in rep["rows"]] == [
        (0, "f16"),
        (0, "q8_0"),
        (40, "f16"),
        (40, "q8_0"),
    ]
    for r in rep["rows"]:
        assert r["ref_gb_s"] > 0 and r["auto_gb_s"] > 0 and r["ref_ms"] > 0 and r["auto_ms"] > 0
    assert len(logs) == 4


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_kernel_call_runs_past_one_chunk(kv_type: str) -> None:
    kernel_call(kv_type, "auto", 1500, 64, 4)()  # two chunks of 1,024 keys
    kernel_call(kv_type, "ref", 1500, 64, 4)()


def test_kernel_mode_rejects_bad_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kernel", "--depths", "16", "--head-dim", "48"]) == 2
    assert main(["--kernel", "--depths", "16", "--group", "0"]) == 2
    assert "multiple of 32" in capsys.readouterr().err
