"""bench/engine_cpu.py's argument types and the --arch summary, on made-up reports."""

import argparse

import pytest

from bench.engine_cpu import arch_list, arch_rows, format_arch_markdown, format_arch_summary, thread_list


def test_thread_list() -> None:
    assert thread_list("1,2") == [1, 2]
    assert thread_list("4") == [4]
    for bad in ("", "a,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            thread_list(bad)


def test_arch_list() -> None:
    assert arch_list("all") == ["glm4moe", "gpt-oss", "deepseek2"]
    assert arch_list("gpt-oss, deepseek2") == ["gpt-oss", "deepseek2"]
    with pytest.raises(argparse.ArgumentTypeError, match="qwen3moe"):
        arch_list("qwen3moe")


def _report(label: str, threads: int, s: float, p: float) -> dict:
    return {"model": {"label": f"{label} (x, 2 layers)"}, "config": {"threads": threads},
            "medians": {"strata": {"decode_tok_s": s, "prefill_tok_s": 2 * s},
                        "llama.cpp": {"decode_tok_s": p, "prefill_tok_s": p}},
            "ratios": {"decode_tok_s": s / p, "prefill_tok_s": 2 * s / p},
            "strata_profile": {"decode": {"shares": {"output": 0.25}}},
            "machine": {"date": "2026-12-04T12:00:00+00:00", "git_commit": "abc123"}}


def test_arch_summary_rows_and_tables() -> None:
    reps = [_report("synthetic-glm.gguf", 1, 8.0, 10.0), _report("synthetic-glm.gguf", 2, 15.0, 12.0)]
    rows = arch_rows(reps)
    assert rows[0][:5] == ("synthetic-glm.gguf", 1, 8.0, 10.0, 0.8)
    assert rows[1][4] == pytest.approx(1.25)
    text = format_arch_summary(reps)
    assert "0.80x" in text and "1.25x" in text and "25%" in text
    md = format_arch_markdown(reps)
    assert md.splitlines()[0].startswith("| date") and "| 2026-12-04 | abc123 | synthetic-glm.gguf |" in md
    assert format_arch_markdown([]) == ""
