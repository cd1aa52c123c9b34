"""Test documents made on the fly: ordinary ones of every type and hostile ones (bombs, broken files)."""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

__all__ = ["billion_laughs_docx", "make_docx", "make_pdf", "pdf_bomb", "raw_pdf", "zip_bomb_docx"]


def make_pdf(path: Path, pages: list[str]) -> Path:
    """A real PDF (fpdf2), one string per page; blank lines separate paragraphs."""
    from fpdf import FPDF

    pdf = FPDF()
    pdf.set_font("Helvetica", size=11)
    for text in pages:
        pdf.add_page()
        pdf.multi_cell(0, 6, text)
    pdf.output(str(path))
    return path


def make_docx(path: Path, heading: str, paragraphs: list[str], table: list[list[str]] | None = None) -> Path:
    import docx

    d = docx.Document()
    d.add_heading(heading, 1)
    for p in paragraphs:
        d.add_paragraph(p)
    if table:
        t = d.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                t.cell(r, c).text = value
    d.save(str(path))
    return path


def raw_pdf(objects: list[bytes]) -> bytes:
    """A PDF from raw object bodies (object i+1 = objects[i]) with a correct xref table."""
    out = io.BytesIO()
    out.write(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objects, start=1):
        offsets.append(out.tell())
        out.write(b"%d 0 obj\n" % i + body + b"\nendobj\n")
    xref = out.tell()
    out.write(b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1))
    for off in offsets:
        out.write(b"%010d 00000 n \n" % off)
    out.write(b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref))
    return out.getvalue()


def _deflate_repeated(unit: bytes, total: int) -> bytes:
    """zlib data inflating to ``total`` bytes of ``unit`` repeated, made in well under a second: after a full
    flush the compressor starts afresh, so every further 1 MiB block compresses to the same bytes."""
    block = unit * ((1 << 20) // len(unit))
    z = zlib.compressobj(9)
    first = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)  # zlib header + block
    again = z.compress(block) + z.flush(zlib.Z_FULL_FLUSH)
    n = max(1, total // len(block))
    adler = 1
    for _ in range(n):
        adler = zlib.adler32(block, adler)
    return first + again * (n - 1) + b"\x03\x00" + adler.to_bytes(4, "big")  # empty final block, checksum


def pdf_bomb(path: Path, gib: float = 2.0) -> Path:
    """One page whose content stream inflates to ``gib`` GiB (about 1/1000 of that on disk)."""
    data = _deflate_repeated(b" ", int(gib * (1 << 30)))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << >> >>",
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(data) + data + b"\nendstream"]
    path.write_bytes(raw_pdf(objects))
    return path


def zip_bomb_docx(path: Path, base: Path, gib: float = 1.0) -> Path:
    """A real .docx plus a member inflating to ``gib`` GiB and a nested zip of zips (42.zip style)."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(16):
            z.writestr(f"layer{i}.bin", b"\0" * (4 << 20))
    nested = io.BytesIO()
    with zipfile.ZipFile(nested, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(16):
            z.writestr(f"{i}.zip", inner.getvalue())
    with zipfile.ZipFile(base) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            dst.writestr(item, src.read(item.filename))
        dst.writestr("word/embeddings/nested.zip", nested.getvalue())
        # a member written from a pre-deflated stream: 1 GiB of zeros in ~1 MB
        info = zipfile.ZipInfo("word/media/zeros.bin")
        info.compress_type = zipfile.ZIP_DEFLATED
        with dst.open(info, "w", force_zip64=True) as f:
            chunk = b"\0" * (1 << 20)
            for _ in range(int(gib * 1024)):
                f.write(chunk)
    return path


def billion_laughs_docx(path: Path, base: Path) -> Path:
    """A real .docx whose document.xml declares the classic nested entities."""
    ents = ['<!ENTITY lol "lol">'] + [f'<!ENTITY lol{i} "{("&lol" + (str(i - 1) if i > 1 else "") + ";") * 10}">'
                                       for i in range(1, 10)]
    with zipfile.ZipFile(base) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename == "word/document.xml":
                head, _, rest = data.partition(b"?>")
                dtd = ("<!DOCTYPE lolz [" + "".join(ents) + "]>").encode()
                data = head + b"?>" + dtd + rest.replace(b"</w:body>", b"<w:p><w:r><w:t>&lol9;</w:t></w:r></w:p>"
                                                         b"</w:body>", 1)
            dst.writestr(item, data)
    return path
