"""Text extraction from uploaded documents, run in a child process under hard limits.

``extract_file`` (the parent side) starts ``python -m gateway.documents.extract`` with an
address-space limit (RLIMIT_AS), a CPU limit and a wall-clock timeout, reads one JSON answer
from its stdout and turns anything else (a kill, a crash, garbage) into ``ExtractionError``
with a reason a user can read. The child parses one file:

* PDF (pypdf): text per page, page numbers kept; page cap; every decompressed stream capped;
* DOCX (python-docx): paragraphs, headings (style "Heading N" / "Title"), tables as rows; the
  zip is checked before python-docx opens it (member count, total uncompressed size, per-member
  compression ratio, no DTD or entity declaration in any XML part);
* HTML (the standard library's parser: no network, no entity expansion beyond HTML's own):
  headings and block text; script, style, template and similar elements dropped;
* Markdown: ATX headings, paragraphs, table rows;
* text: BOM, then UTF-8, then a detected encoding.

This module imports nothing heavy at import time: the child starts in a fraction of a second.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Literal

__all__ = ["FORMATS", "SUPPORTED_TYPES", "Block", "Extracted", "ExtractLimits", "ExtractionError", "FileTypeError",
           "PAGE_BATCH", "Emit", "detect_format", "extract_file", "extract_in_process", "extract_stream"]

log = logging.getLogger("strata.gateway.documents")

REPO_ROOT = Path(__file__).resolve().parents[2]

# extension -> format; the only types accepted
FORMATS: dict[str, str] = {".pdf": "pdf", ".docx": "docx", ".md": "md", ".markdown": "md", ".html": "html",
                           ".htm": "html", ".txt": "txt", ".text": "txt"}
SUPPORTED_TYPES = "PDF (.pdf), Word (.docx), Markdown (.md, .markdown), HTML (.html, .htm), text (.txt, .text)"

_XML_DANGER = re.compile(rb"<!\s*(DOCTYPE|ENTITY)", re.IGNORECASE)
_MAX_ZIP_MEMBERS = 5000
_RATIO_FLOOR = 1024 * 1024  # members smaller than this are not ratio-checked (small XML compresses well)


class ExtractionError(Exception):
    """The document cannot be extracted; ``str(e)`` is the reason shown to the user."""


class FileTypeError(ExtractionError):
    """The file's name or content is not a supported type (HTTP 415 at upload)."""


@dataclass
class ExtractLimits:
    max_pages: int = 1000
    max_chars: int = 20_000_000
    max_uncompressed_bytes: int = 200 * 1024 * 1024
    max_ratio: float = 100.0
    max_stream_bytes: int = 50 * 1024 * 1024
    timeout_s: float = 120.0
    memory_mb: int = 1024


@dataclass
class Block:
    """One structural unit of text: a heading, a paragraph or a table row."""

    text: str
    kind: Literal["heading", "para", "row"] = "para"
    level: int = 0  # heading level (1 = top)
    page: int | None = None  # 1-based PDF page


@dataclass
class Extracted:
    format: str
    blocks: list[Block] = field(default_factory=list)
    pages: int | None = None
    streamed: int = 0  # blocks already handed to an ``emit`` callback (not in ``blocks``)

    @property
    def chars(self) -> int:
        return sum(len(b.text) for b in self.blocks)


# (blocks, pages read so far, pages in all) -> None: a PDF's blocks in page order, a part at a time
Emit = Callable[[list[Block], int, int], None]
PAGE_BATCH = 8  # PDF pages per part handed over while the rest is extracted


# ---------------------------------------------------------------------------------------- type detection


def detect_format(filename: str, head: bytes) -> str:
    """The format named by ``filename``'s extension, checked against the first bytes of the content."""
    ext = os.path.splitext(filename.lower())[1]
    fmt = FORMATS.get(ext)
    if fmt is None:
        raise FileTypeError(f"unsupported file type {ext or '(no extension)'!r}; supported: {SUPPORTED_TYPES}")
    looks = _sniff(head)
    if fmt == "pdf" and looks != "pdf":
        raise FileTypeError(f"{filename!r} is named .pdf but its content is {_describe(looks)}, not a PDF")
    if fmt == "docx" and looks != "zip":
        raise FileTypeError(f"{filename!r} is named .docx but its content is {_describe(looks)}, not a Word "
                            "document (a zip)")
    if fmt in ("md", "html", "txt") and looks in ("pdf", "zip", "binary"):
        raise FileTypeError(f"{filename!r} is named {ext} but its content is {_describe(looks)}, not text")
    return fmt


def _sniff(head: bytes) -> str:
    if b"%PDF-" in head[:1024]:
        return "pdf"
    if head.startswith(b"PK\x03\x04"):
        return "zip"
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "text"
    if b"\x00" in head[:8192]:
        return "binary"
    return "text"


def _describe(looks: str) -> str:
    return {"pdf": "a PDF", "zip": "a zip archive", "binary": "binary data", "text": "text"}[looks]


# ---------------------------------------------------------------------------------------- text helpers


def decode_text(data: bytes) -> str:
    """Bytes to text: a BOM decides, else strict UTF-8, else the detected encoding (cp1252 as the last resort)."""
    if data.startswith(codecs.BOM_UTF8):
        return data[3:].decode("utf-8", "replace")
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return data.decode("utf-16", "replace")
    if b"\x00" in data[:8192]:
        raise ExtractionError("the file holds binary data, not text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    try:
        from charset_normalizer import from_bytes
        results = from_bytes(data[:1024 * 1024])
        best = results.best()
        if best is not None and best.encoding:
            # equally plausible candidates: the most common legacy encoding wins (cp1250 and cp1252 read
            # most Latin text identically; they differ on letters like è/č)
            ties = {m.encoding for m in results if m.chaos == best.chaos and m.coherence == best.coherence}
            return data.decode("cp1252" if "cp1252" in ties else best.encoding, "replace")
    except ImportError:
        pass
    return data.decode("cp1252", "replace")


def _clean(text: str) -> str:
    text = text.replace("\x00", "").replace("\r\n", "\n").replace("\r", "\n")
    return re.sub(r"[ \t\f\v\u00a0]+", " ", text).strip()


def _paragraphs(text: str, page: int | None = None, unwrap: bool = False) -> list[Block]:
    """Blocks split at blank lines; ``unwrap`` joins the lines of a paragraph (a PDF's line wrapping is layout,
    not text: "52.3 million\neuros" must read as one phrase)."""
    parts = (_clean(x) for x in re.split(r"\n\s*\n", text))
    if unwrap:
        parts = (re.sub(r"\s*\n\s*", " ", x) for x in parts)
    return [Block(p, "para", 0, page) for p in parts if p]


# ---------------------------------------------------------------------------------------- per format


def _extract_pdf(path: Path, lim: ExtractLimits, emit: Emit | None = None) -> Extracted:
    """With ``emit``, every ``PAGE_BATCH`` pages' blocks are handed over as soon as they are read (and not kept):
    the parent embeds them while the next pages are extracted."""

    from pypdf import PdfReader, apply_configuration
    from pypdf.errors import LimitReachedError, PdfReadError

    logging.getLogger("pypdf").setLevel(logging.ERROR)
    cap = lim.max_stream_bytes
    caps = dict(zlib_maximum_output_length=cap, lzw_maximum_output_length=cap, run_length_maximum_output_length=cap,
                array_based_stream_maximum_output_length=cap, maximum_declared_stream_length=cap)
    try:
        with apply_configuration(**caps):
            reader = PdfReader(str(path), strict=False)
            if reader.is_encrypted:
                try:
                    ok = reader.decrypt("")
                except Exception:
                    ok = 0
                if not ok:
                    raise ExtractionError("the PDF is encrypted with a password")
            n = len(reader.pages)
            if n > lim.max_pages:
                raise ExtractionError(f"the PDF has {n} pages; the limit is {lim.max_pages}")
            if n == 0:
                raise ExtractionError("the PDF has no pages")
            out = Extracted("pdf", pages=n)
            chars = 0
            pending: list[Block] = []
            for i, page in enumerate(reader.pages, start=1):
                contents = page.get_contents()
                if contents is not None:
                    contents.get_data()  # extract_text hides a decompression limit; this raises it
                text = page.extract_text() or ""
                chars += len(text)
                if chars > lim.max_chars:
                    raise ExtractionError(f"the PDF holds more than {lim.max_chars} characters of text")
                pending += _paragraphs(text, i, unwrap=True)
                if emit is not None and (i % PAGE_BATCH == 0 or i == n):
                    if pending:
                        emit(pending, i, n)
                    out.streamed += len(pending)
                    pending = []
            out.blocks = pending
            return out
    except LimitReachedError as e:
        raise ExtractionError(f"a PDF stream is too large when decompressed (limit {cap} bytes): {e}") from None
    except PdfReadError as e:
        raise ExtractionError(f"not a readable PDF: {e}") from None


def check_docx_zip(path: Path, lim: ExtractLimits) -> None:
    """Refuse a zip bomb or an XML bomb before any XML parser sees the file."""
    try:
        z = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError):
        raise ExtractionError("not a readable Word document (not a valid zip file)") from None
    with z:
        infos = z.infolist()
        if len(infos) > _MAX_ZIP_MEMBERS:
            raise ExtractionError(f"the Word document has {len(infos)} zip members; the limit is {_MAX_ZIP_MEMBERS}")
        total = sum(i.file_size for i in infos)
        if total > lim.max_uncompressed_bytes:
            raise ExtractionError(f"the Word document unpacks to {total} bytes; the limit is "
                                  f"{lim.max_uncompressed_bytes}")
        for i in infos:
            if i.file_size > _RATIO_FLOOR and i.file_size > lim.max_ratio * max(1, i.compress_size):
                raise ExtractionError(f"zip member {i.filename!r} expands {i.file_size / max(1, i.compress_size):.0f}"
                                      f"x (limit {lim.max_ratio:g}x): refused as a decompression bomb")
        names = {i.filename for i in infos}
        if "word/document.xml" not in names:
            raise ExtractionError("not a Word document: the zip has no word/document.xml")
        for i in infos:
            if not i.filename.lower().endswith((".xml", ".rels")):
                continue
            tail = b""
            try:
                with z.open(i) as f:  # zipfile never reads past the declared size (the total checked above)
                    first = True
                    while chunk := f.read(1 << 16):
                        if first and (chunk.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in chunk[:4]):
                            # UTF-16/32: the byte search below would not see a DTD; Word writes UTF-8 only
                            raise ExtractionError(f"zip member {i.filename!r} is not UTF-8 XML (refused)")
                        first = False
                        if _XML_DANGER.search(tail + chunk):
                            raise ExtractionError(f"zip member {i.filename!r} declares a DTD or entities (refused: "
                                                  "entity expansion and external entities)")
                        tail = chunk[-16:]
            except (zipfile.BadZipFile, OSError, EOFError, ValueError):
                raise ExtractionError(f"not a readable Word document: zip member {i.filename!r} is damaged") from None


def _extract_docx(path: Path, lim: ExtractLimits) -> Extracted:
    check_docx_zip(path, lim)
    import docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    try:
        document = docx.Document(str(path))
    except Exception as e:  # python-docx raises many types for a broken package
        raise ExtractionError(f"not a readable Word document ({type(e).__name__})") from None
    out = Extracted("docx")
    chars = 0
    for item in document.iter_inner_content():
        if isinstance(item, Paragraph):
            text = _clean(item.text)
            if not text:
                continue
            style = (item.style.name if item.style is not None else "") or ""
            m = re.match(r"Heading\s*(\d)", style)
            if m or style == "Title":
                out.blocks.append(Block(text, "heading", int(m.group(1)) if m else 1))
            else:
                out.blocks.append(Block(text, "para"))
        elif isinstance(item, Table):
            for row in item.rows:
                cells: list[str] = []
                for cell in row.cells:
                    t = _clean(cell.text)
                    if t and (not cells or cells[-1] != t):  # a merged cell repeats itself
                        cells.append(t)
                if cells:
                    out.blocks.append(Block(" | ".join(cells), "row"))
        else:
            continue
        chars += len(out.blocks[-1].text) if out.blocks else 0
        if chars > lim.max_chars:
            raise ExtractionError(f"the Word document holds more than {lim.max_chars} characters of text")
    return out


class _HTMLText(HTMLParser):
    _DROP = frozenset({"script", "style", "template", "noscript", "head", "svg", "math", "iframe", "object"})
    _BLOCK = frozenset({"p", "div", "section", "article", "li", "ul", "ol", "br", "pre", "blockquote", "table",
                        "tbody", "thead", "dd", "dt", "dl", "main", "header", "footer", "nav", "aside", "form",
                        "figure", "figcaption", "hr", "title", "body", "html"})
    _VOID = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "embed", "source", "wbr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.blocks: list[Block] = []
        self._buf: list[str] = []
        self._drop = 0
        self._heading = 0
        self._row: list[str] | None = None
        self._cell: list[str] | None = None

    def _flush(self) -> None:
        text = _clean(" ".join(self._buf))
        self._buf = []
        if text:
            self.blocks.append(Block(text, "heading" if self._heading else "para", self._heading))

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in self._DROP:
            if tag not in self._VOID:
                self._drop += 1
            return
        if self._drop:
            return
        if re.fullmatch(r"h[1-6]", tag):
            self._flush()
            self._heading = int(tag[1])
        elif tag == "tr":
            self._flush()
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag in self._BLOCK:
            self._flush()

    def handle_endtag(self, tag: str) -> None:
        if tag in self._DROP:
            self._drop = max(0, self._drop - 1)
            return
        if self._drop:
            return
        if re.fullmatch(r"h[1-6]", tag):
            self._flush()
            self._heading = 0
        elif tag in ("td", "th") and self._row is not None and self._cell is not None:
            cell = _clean(" ".join(self._cell))
            if cell:
                self._row.append(cell)
            self._cell = None
        elif tag == "tr" and self._row is not None:
            if self._row:
                self.blocks.append(Block(" | ".join(self._row), "row"))
            self._row = None
        elif tag in self._BLOCK:
            self._flush()

    def handle_data(self, data: str) -> None:
        if self._drop:
            return
        if self._cell is not None:
            self._cell.append(data)
        else:
            self._buf.append(data)

    def close(self) -> None:
        super().close()
        self._flush()


def _extract_html(path: Path, lim: ExtractLimits) -> Extracted:
    raw = path.read_bytes()
    text = decode_text(raw)
    p = _HTMLText()
    p.feed(text)
    p.close()
    return Extracted("html", p.blocks)


_MD_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_MD_FENCE = re.compile(r"^(```|~~~)")
_MD_TABLE_RULE = re.compile(r"^\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?$")


def _extract_md(path: Path, lim: ExtractLimits) -> Extracted:
    text = decode_text(path.read_bytes())
    out = Extracted("md")
    para: list[str] = []
    fence = False

    def flush() -> None:
        if para:
            t = _clean("\n".join(para))
            if t:
                out.blocks.append(Block(t, "para"))
            para.clear()

    for line in text.splitlines():
        if _MD_FENCE.match(line.strip()):
            fence = not fence
            if not fence:
                flush()
            continue
        if fence:
            para.append(line)
            continue
        m = _MD_HEADING.match(line)
        if m:
            flush()
            if m.group(2).strip():
                out.blocks.append(Block(_clean(m.group(2)), "heading", len(m.group(1))))
            continue
        s = line.strip()
        if s.startswith("|") and s.endswith("|") and len(s) > 1:
            flush()
            if not _MD_TABLE_RULE.match(s):
                cells = [c.strip() for c in s.strip("|").split("|") if c.strip()]
                if cells:
                    out.blocks.append(Block(" | ".join(cells), "row"))
            continue
        if not s:
            flush()
            continue
        para.append(line)
    flush()
    return out


def _extract_txt(path: Path, lim: ExtractLimits) -> Extracted:
    return Extracted("txt", _paragraphs(decode_text(path.read_bytes())))


_EXTRACTORS = {"pdf": _extract_pdf, "docx": _extract_docx, "html": _extract_html, "md": _extract_md,
               "txt": _extract_txt}


def extract_in_process(path: Path, fmt: str, lim: ExtractLimits, emit: Emit | None = None) -> Extracted:
    """Extract in this process (the child calls this; tests may too). Raises ExtractionError. With ``emit``, a
    PDF's pages are handed over in parts as they are read (``streamed`` counts them); other formats return
    all their blocks at once."""
    if fmt not in _EXTRACTORS:
        raise FileTypeError(f"unsupported format {fmt!r}; supported: {SUPPORTED_TYPES}")
    if path.stat().st_size == 0:
        raise ExtractionError("the file is empty")
    if fmt in ("md", "html", "txt") and path.stat().st_size > lim.max_chars * 4:
        raise ExtractionError(f"the file is larger than the text limit ({lim.max_chars} characters)")
    out = _extract_pdf(path, lim, emit) if fmt == "pdf" else _EXTRACTORS[fmt](path, lim)
    if out.chars > lim.max_chars:
        raise ExtractionError(f"the document holds more than {lim.max_chars} characters of text")
    if not out.blocks and not out.streamed:
        raise ExtractionError("no text found in the document (a scanned PDF needs OCR, which is not supported)")
    return out


# ---------------------------------------------------------------------------------------- the child process


def _limit_child(memory_mb: int, cpu_s: int) -> None:  # runs in the child between fork and exec
    import resource
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.nice(10)  # chat traffic on the same cores comes first


def extract_file(path: Path, fmt: str, lim: ExtractLimits) -> Extracted:
    """Extract ``path`` in a child process under ``lim`` (blocking: call it from a worker thread)."""
    blocks: list[Block] = []
    out = extract_stream(path, fmt, lim, lambda part, _done, _total: blocks.extend(part))
    out.blocks = blocks
    return out


def extract_stream(path: Path, fmt: str, lim: ExtractLimits, on_part: Emit,
                   stop: threading.Event | None = None) -> Extracted:
    """Extract ``path`` in a child process under ``lim``, calling ``on_part(blocks, pages_done, pages)`` for each
    part as the child reads it (a PDF: every ``PAGE_BATCH`` pages; other formats: one part). Blocking: call it
    from a worker thread. The answer's ``blocks`` are empty (they went to ``on_part``). A part may arrive before
    the extraction fails: the caller discards what it did with the parts on ``ExtractionError``. ``stop`` set
    (the document was deleted) kills the child at the next part."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "gateway.documents.extract", fmt, str(path), json.dumps(asdict(lim))]
    answer: dict[str, Any] | None = None
    garbage = b""
    timed_out = threading.Event()
    with tempfile.TemporaryFile() as err:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, env=env,
                                    cwd=REPO_ROOT, preexec_fn=lambda: _limit_child(lim.memory_mb, int(lim.timeout_s) + 1))
        except OSError as e:
            log.error("documents: the extraction process did not start: %s", e)
            raise ExtractionError("could not start the extraction process") from None

        def expire() -> None:
            timed_out.set()
            proc.kill()

        watchdog = threading.Timer(lim.timeout_s, expire)  # the wall clock covers the whole extraction
        watchdog.daemon = True
        watchdog.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # one JSON object a line: parts, then the answer
                if stop is not None and stop.is_set():
                    proc.kill()
                    raise ExtractionError("extraction stopped: the document was deleted")
                try:
                    msg = json.loads(line)
                except ValueError:
                    garbage = line[:300]
                    break
                if "part" in msg and answer is None:
                    on_part([Block(**b) for b in msg["part"]], int(msg["done"]), int(msg["pages"]))
                else:
                    answer = msg
            rc = proc.wait()
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if timed_out.is_set():
            raise ExtractionError(f"extraction took longer than {lim.timeout_s:g}s and was stopped")
        err.seek(0, os.SEEK_END)
        err.seek(max(0, err.tell() - 2000))
        tail = err.read().decode("utf-8", "replace").strip().splitlines()
    if rc < 0:
        import signal
        name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
        why = {"SIGXCPU": "it used more CPU time than allowed", "SIGKILL": "it was killed",
               "SIGSEGV": "it crashed (probably out of memory)"}.get(name, f"signal {name}")
        raise ExtractionError(f"the extraction process died: {why}")
    if answer is None:
        last = tail[-1] if tail else garbage.decode("utf-8", "replace")
        if "MemoryError" in last:
            raise ExtractionError(f"extraction ran out of memory (limit {lim.memory_mb} MiB)") from None
        log.error("documents: the extraction process failed (exit %s): %s", rc, last[:2000])
        raise ExtractionError(f"the extraction process failed (exit {rc})") from None
    if not answer.get("ok"):
        if answer.get("detail"):
            log.warning("documents: extraction failed: %s", answer["detail"])
        raise ExtractionError(str(answer.get("reason") or "extraction failed"))
    return Extracted(answer["format"], [], answer.get("pages"), streamed=int(answer.get("blocks", 0)))


def _child_main(argv: list[str]) -> int:
    import warnings
    warnings.simplefilter("ignore")
    fmt, path, lim_json = argv
    lim = ExtractLimits(**json.loads(lim_json))

    def send(msg: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(msg, ensure_ascii=False) + "\n")
        sys.stdout.flush()

    def part(blocks: list[Block], done: int, pages: int) -> None:
        send({"part": [asdict(b) for b in blocks], "done": done, "pages": pages})

    try:
        res = extract_in_process(Path(path), fmt, lim, part)
        if res.blocks:
            part(res.blocks, res.pages or 0, res.pages or 0)
        answer: dict[str, Any] = {"ok": True, "format": res.format, "pages": res.pages,
                                  "blocks": res.streamed + len(res.blocks)}
    except ExtractionError as e:
        answer = {"ok": False, "reason": str(e)}
    except MemoryError:
        answer = {"ok": False, "reason": f"extraction ran out of memory (limit {lim.memory_mb} MiB)"}
    except RecursionError:
        answer = {"ok": False, "reason": "the document is nested too deeply to parse"}
    except Exception as e:  # a parser bug on a hostile file: a reason, never a traceback to the user
        # the text may name server paths: the reason (the client's) says what kind of failure, the detail (the
        # gateway's log) the rest
        answer = {"ok": False, "reason": f"could not parse the {fmt.upper()} file ({type(e).__name__})",
                  "detail": f"{type(e).__name__}: {e}"[:2000]}
    send(answer)
    return 0


if __name__ == "__main__":
    raise SystemExit(_child_main(sys.argv[1:]))
