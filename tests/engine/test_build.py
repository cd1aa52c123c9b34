"""engine._build's object step: sources compiled side by side, an object kept while its digest holds, a failed
source named with the compiler's message (a tiny source tree stands in for engine/csrc)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import _build


@pytest.fixture
def tiny_csrc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "t.h").write_text("int twice(int x);\n")
    (src / "a.c").write_text('#include "t.h"\nint twice(int x) { return 2 * x; }\n')
    (src / "b.c").write_text('#include "t.h"\nint four(int x) { return twice(twice(x)); }\n')
    monkeypatch.setattr(_build, "CSRC", src)
    monkeypatch.setattr(_build, "SOURCES", ["a.c", "b.c"])
    return src


def test_objects_are_kept_until_a_source_or_header_changes(tiny_csrc: Path, tmp_path: Path) -> None:
    out = tmp_path / "obj"
    objs = _build.compile_objects(out, jobs=2)
    assert [o.name for o in objs] == ["a.o", "b.o"] and all(o.stat().st_size > 0 for o in objs)
    first = {o.name: o.stat().st_mtime_ns for o in objs}
    assert {o.name: o.stat().st_mtime_ns for o in _build.compile_objects(out, jobs=2)} == first  # nothing rebuilt
    (tiny_csrc / "a.c").write_text('#include "t.h"\nint twice(int x) { return x + x; }\n')
    again = {o.name: o.stat().st_mtime_ns for o in _build.compile_objects(out, jobs=2)}
    assert again["b.o"] == first["b.o"] and again["a.o"] != first["a.o"]
    (tiny_csrc / "t.h").write_text("int twice(int x); /* changed */\n")  # a header: every object again
    after = {o.name: o.stat().st_mtime_ns for o in _build.compile_objects(out, jobs=2)}
    assert after["a.o"] != again["a.o"] and after["b.o"] != again["b.o"]


def test_a_source_that_does_not_compile_is_named(tiny_csrc: Path, tmp_path: Path) -> None:
    (tiny_csrc / "b.c").write_text("int four(int x) { return x +; }\n")
    with pytest.raises(RuntimeError, match=r"b\.c did not compile") as e:
        _build.compile_objects(tmp_path / "obj", jobs=2)
    assert "error" in str(e.value)
    assert not (tmp_path / "obj" / "b.o").exists()
