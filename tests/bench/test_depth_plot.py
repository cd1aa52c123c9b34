"""bench.depth_plot: the two accepted inputs (bench.engine_gpu --depth's JSON, a summary of recorded figures), the
figure it writes, the committed docs figure against its data, and a clear error for a bad file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import depth_plot as dp
from bench.common import REPO_ROOT

DATA = REPO_ROOT / "docs" / "data" / "gpu-depth-h200.json"
FIGURE = REPO_ROOT / "docs" / "img" / "gpu-depth-h200.svg"


def test_engine_gpu_depth_json_gives_the_decode_lines(tmp_path: Path) -> None:
    run = {"strata": {"0": {"tok_s": 400.0, "step_ms": 2.5}, "32768": {"tok_s": 220.0, "step_ms": 4.5}},
           "llama_cpp": {"0": 300.0, "32768": 210.0}, "kv_type": "q8_0", "n_seq": 8}
    f = tmp_path / "depth.json"
    f.write_text(json.dumps(run))
    series = dp.read_series(f)
    assert [(s["label"], s["peer"], s["points"]) for s in series] == [
        ("Strata, 8-bit KV, 8 sequences", False, {0: 400.0, 32768: 220.0}),
        ("llama.cpp, 8-bit KV, 8 sequences", True, {0: 300.0, 32768: 210.0})]
    assert dp.main([str(f), "--out", str(tmp_path / "d.png")]) == 0
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_same_input_writes_the_same_svg_with_its_text(tmp_path: Path) -> None:
    a, b = tmp_path / "a.svg", tmp_path / "b.svg"
    for out in (a, b):
        assert dp.main([str(DATA), "--out", str(out)]) == 0
    assert a.read_bytes() == b.read_bytes()
    text = a.read_text()
    for s in json.loads(DATA.read_text())["series"]:
        assert s["label"] in text
    assert "batch-1 decode tok/s" in text and "prefill tok/s" in text


def test_the_docs_figure_shows_its_data() -> None:
    """docs/img/gpu-depth-h200.svg is drawn from docs/data/gpu-depth-h200.json (every series named in it)."""
    text = FIGURE.read_text()
    data = json.loads(DATA.read_text())
    assert data["title"] in text
    assert all(s["label"] in text for s in data["series"])


@pytest.mark.parametrize(("content", "says"), [
    ("not json", "Expecting value"),
    ("[1, 2]", "expected a JSON object"),
    ('{"series": [{"panel": "decode", "label": "x", "points": {"0": -1}}]}', "a tok/s > 0"),
    ('{"series": [{"panel": "sideways", "label": "x", "points": {"0": 1}}]}', "needs 'panel'"),
    ('{"other": 1}', "neither bench.engine_gpu --depth's JSON"),
])
def test_a_bad_input_is_named_not_a_traceback(tmp_path: Path, content: str, says: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.json"
    f.write_text(content)
    assert dp.main([str(f), "--out", str(tmp_path / "x.svg")]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and not (tmp_path / "x.svg").exists()
