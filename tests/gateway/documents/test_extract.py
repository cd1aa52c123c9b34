"""Extraction in the child process: every format, and hostile files rejected with a reason, quickly."""

from __future__ import annotations

import time
import zipfile
from pathlib import Path

import pytest

from gateway.documents.extract import (
    PAGE_BATCH,
    Block,
    ExtractionError,
    ExtractLimits,
    FileTypeError,
    check_docx_zip,
    decode_text,
    detect_format,
    extract_file,
    extract_in_process,
    extract_stream,
)
from tests.gateway.documents.samples import billion_laughs_docx, make_docx, make_pdf, pdf_bomb, zip_bomb_docx

LIM = ExtractLimits(timeout_s=30.0)


def test_pdf_pages_and_paragraphs(tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "a.pdf", ["Alpha page one.\n\nSecond paragraph.", "Beta page two.",
                                         "The valve code on page three is QX-41."])
    out = extract_file(pdf, "pdf", LIM)
    assert out.pages == 3
    assert [b.page for b in out.blocks if "QX-41" in b.text] == [3]
    assert any(b.page == 1 and "Alpha" in b.text for b in out.blocks)


def test_pdf_pages_arrive_in_parts_while_the_child_reads(tmp_path: Path) -> None:
    n = 2 * PAGE_BATCH + 3
    pdf = make_pdf(tmp_path / "p.pdf", [f"Page {i} says hello.\n\nSecond paragraph of page {i}." for i in range(1, n + 1)])
    parts: list[tuple[list[Block], int, int]] = []
    out = extract_stream(pdf, "pdf", LIM, lambda blocks, done, total: parts.append((blocks, done, total)))
    assert [(done, total) for _, done, total in parts] == [(PAGE_BATCH, n), (2 * PAGE_BATCH, n), (n, n)]
    joined = [b for blocks, _, _ in parts for b in blocks]
    assert out.pages == n and out.blocks == [] and out.streamed == len(joined) >= n
    assert joined == extract_in_process(pdf, "pdf", LIM).blocks  # the parts, joined, are exactly the document
    # a limit reached after the first part still fails the whole extraction (the caller drops the parts)
    chars_per_page = max(sum(len(b.text) for b in joined if b.page == p) for p in range(1, n + 1))
    parts.clear()
    with pytest.raises(ExtractionError, match="more than"):
        extract_stream(pdf, "pdf", ExtractLimits(timeout_s=30.0, max_chars=chars_per_page * (PAGE_BATCH + 2)),
                       lambda blocks, done, total: parts.append((blocks, done, total)))
    assert [done for _, done, _ in parts] == [PAGE_BATCH]


def test_docx_headings_paragraphs_table_rows(tmp_path: Path) -> None:
    d = make_docx(tmp_path / "a.docx", "Boiler manual", ["Start the pump first."],
                  [["Setting", "Value"], ["boiler pressure", "42 bar"]])
    out = extract_file(d, "docx", LIM)
    assert out.blocks[0].kind == "heading" and out.blocks[0].text == "Boiler manual" and out.blocks[0].level == 1
    rows = [b.text for b in out.blocks if b.kind == "row"]
    assert rows == ["Setting | Value", "boiler pressure | 42 bar"]


def test_html_drops_scripts_and_styles(tmp_path: Path) -> None:
    p = tmp_path / "a.html"
    p.write_text("<html><head><title>t</title><style>.x{color:red}</style></head><body><h2>Rules</h2>"
                 "<p>Keep <b>left</b>.</p><script>steal()</script><noscript>nojs</noscript>"
                 "<table><tr><th>k</th><td>v &amp; w</td></tr></table></body></html>")
    out = extract_file(p, "html", LIM)
    texts = [b.text for b in out.blocks]
    assert texts == ["Rules", "Keep left .", "k | v & w"] or texts == ["Rules", "Keep left.", "k | v & w"]
    assert out.blocks[0].kind == "heading" and out.blocks[0].level == 2
    assert not any("steal" in t or "color" in t or "nojs" in t for t in texts)


def test_markdown_structure(tmp_path: Path) -> None:
    p = tmp_path / "a.md"
    p.write_text("# Guide\n\nIntro line\ncontinues.\n\n## Part\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```\ncode\n```\n")
    out = extract_file(p, "md", LIM)
    assert [(b.kind, b.text) for b in out.blocks] == [("heading", "Guide"), ("para", "Intro line\ncontinues."),
                                                      ("heading", "Part"), ("row", "a | b"), ("row", "1 | 2"),
                                                      ("para", "code")]


def test_text_encodings() -> None:
    assert decode_text("naïve café".encode("utf-16")) == "naïve café"
    assert decode_text(b"\xef\xbb\xbfbom text") == "bom text"
    latin = ("Les élèves étudient à l'école près de la forêt. " * 20).encode("latin-1")
    assert "élèves" in decode_text(latin)
    with pytest.raises(ExtractionError, match="binary"):
        decode_text(b"abc\x00\x01\x02")


def test_wrong_extension_and_unsupported_types() -> None:
    with pytest.raises(FileTypeError, match="supported: PDF"):
        detect_format("tool.exe", b"MZ\x90\x00")
    with pytest.raises(FileTypeError, match="not a PDF"):
        detect_format("report.pdf", b"PK\x03\x04rest")
    with pytest.raises(FileTypeError, match="not a Word document"):
        detect_format("report.docx", b"%PDF-1.7\n")
    with pytest.raises(FileTypeError, match="not text"):
        detect_format("notes.txt", b"%PDF-1.4\n...")
    assert detect_format("Notes.MD", b"# hi") == "md"


def test_empty_file(tmp_path: Path) -> None:
    p = tmp_path / "e.txt"
    p.write_bytes(b"")
    with pytest.raises(ExtractionError, match="empty"):
        extract_file(p, "txt", LIM)


def test_pdf_bomb_fails_fast_with_reason(tmp_path: Path) -> None:
    bomb = pdf_bomb(tmp_path / "bomb.pdf", gib=2.0)
    assert bomb.stat().st_size < 4 << 20
    t0 = time.monotonic()
    with pytest.raises(ExtractionError, match="too large when decompressed"):
        extract_file(bomb, "pdf", LIM)
    assert time.monotonic() - t0 < 20


def test_truncated_pdf(tmp_path: Path) -> None:
    data = make_pdf(tmp_path / "ok.pdf", ["some text"] * 3).read_bytes()
    cut = tmp_path / "cut.pdf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ExtractionError, match="not a readable PDF|no text"):
        extract_file(cut, "pdf", LIM)


def test_pdf_page_cap(tmp_path: Path) -> None:
    pdf = make_pdf(tmp_path / "many.pdf", [f"page {i}" for i in range(6)])
    with pytest.raises(ExtractionError, match="6 pages; the limit is 5"):
        extract_file(pdf, "pdf", ExtractLimits(max_pages=5))


def test_zip_bomb_docx_refused_before_parsing(tmp_path: Path) -> None:
    base = make_docx(tmp_path / "base.docx", "H", ["text"])
    bomb = zip_bomb_docx(tmp_path / "bomb.docx", base, gib=0.3)  # 300 MiB: past the 200 MiB cap
    assert bomb.stat().st_size < 4 << 20
    with pytest.raises(ExtractionError, match="unpacks to"):
        extract_file(bomb, "docx", LIM)
    # with a total cap above it, the compression ratio still refuses it
    with pytest.raises(ExtractionError, match="decompression bomb"):
        check_docx_zip(bomb, ExtractLimits(max_uncompressed_bytes=4 << 30))


def test_billion_laughs_docx_refused(tmp_path: Path) -> None:
    base = make_docx(tmp_path / "base.docx", "H", ["text"])
    bad = billion_laughs_docx(tmp_path / "lol.docx", base)
    with pytest.raises(ExtractionError, match="DTD or entities"):
        extract_file(bad, "docx", LIM)


def test_not_a_zip_named_docx(tmp_path: Path) -> None:
    p = tmp_path / "x.docx"
    p.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(ExtractionError, match="not a readable Word document"):
        extract_file(p, "docx", LIM)


def test_memory_limit_kills_a_runaway_child(tmp_path: Path) -> None:
    """A text document whose decoding needs more memory than the child may have: a reason, not a hang."""
    p = tmp_path / "big.txt"
    p.write_bytes(b"word " * (40 << 20))  # 200 MiB of text: decoding and splitting need well over 256 MiB
    with pytest.raises(ExtractionError, match="memory|limit|died"):
        extract_file(p, "txt", ExtractLimits(memory_mb=256, max_chars=10**9))


def test_wall_clock_timeout(tmp_path: Path) -> None:
    p = tmp_path / "t.txt"
    p.write_bytes(b"x")
    t0 = time.monotonic()
    with pytest.raises(ExtractionError, match="longer than 0.01s"):
        extract_file(p, "txt", ExtractLimits(timeout_s=0.01))
    assert time.monotonic() - t0 < 5


def test_a_parser_failure_names_no_server_path(tmp_path: Path) -> None:
    """A broken package that python-docx refuses (its message names the file's path): the reason a client reads
    says what failed, the path and the exception's text stay in the server's log."""
    p = tmp_path / "secret-dir-name" / "x.docx"
    p.parent.mkdir()
    with zipfile.ZipFile(p, "w") as z:  # a document part, but no [Content_Types].xml: not an OPC package
        z.writestr("word/document.xml", "<w:document/>")
    with pytest.raises(ExtractionError, match="not a readable Word document") as info:
        extract_file(p, "docx", LIM)
    assert "secret-dir-name" not in str(info.value) and str(tmp_path) not in str(info.value)


def test_utf16_xml_members_are_refused(tmp_path: Path) -> None:
    """A DTD in UTF-16 XML hides from the byte search for '<!DOCTYPE': such a member is refused outright."""
    base = make_docx(tmp_path / "base.docx", "H", ["text"])
    bad = tmp_path / "u16.docx"
    with zipfile.ZipFile(base) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "word/document.xml":
                text = data.decode().replace("?>", '?><!DOCTYPE x [<!ENTITY a "b">]>', 1)
                data = text.replace('encoding="UTF-8"', 'encoding="UTF-16"').encode("utf-16")
            dst.writestr(item, data)
    with pytest.raises(ExtractionError, match="not UTF-8 XML"):
        check_docx_zip(bad, LIM)
