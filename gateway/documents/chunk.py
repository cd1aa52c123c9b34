"""Structure-aware chunking, counted in the embedding model's tokens.

A document's blocks (headings, paragraphs, table rows; PDF pages) are grouped into sections:
a heading or a new page starts one, so a chunk never spans two pages or two headings. Inside a
section, blocks (or, for a block longer than a chunk, its sentences, or for a sentence longer
than a chunk, runs of words) are packed into chunks of at most ``size`` tokens; each chunk but
the first of a section starts with the last units of the previous one, up to ``overlap`` tokens.

Provenance kept per chunk: page, heading path and character offsets into the document text
(the blocks joined by blank lines), so ``text == document_text(blocks)[char_start:char_end]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.documents.extract import Block

__all__ = ["Chunk", "chunk_blocks", "document_text", "text_length"]

Counter = Callable[[list[str]], list[int]]  # texts -> token counts (no special tokens)
_SEP = "\n\n"
_SENTENCE = re.compile(r"(?<=[.!?;:])\s+|\n+")


@dataclass
class Chunk:
    ordinal: int
    text: str
    char_start: int
    char_end: int
    tokens: int
    page: int | None = None
    heading: list[str] = field(default_factory=list)

    def embed_text(self) -> str:
        """What is embedded and BM25-indexed: the heading path gives a passage its context."""
        return (" > ".join(self.heading) + "\n" + self.text) if self.heading else self.text


@dataclass
class _Unit:
    start: int
    end: int
    tokens: int


def document_text(blocks: Sequence[Block]) -> str:
    return _SEP.join(b.text for b in blocks)


def text_length(blocks: Sequence[Block]) -> int:
    """Characters ``blocks`` take in the document's text, with the separator that follows them: the
    ``offset`` of the part after them."""
    return sum(len(b.text) + len(_SEP) for b in blocks)


def _split_long(text: str, base: int, size: int, count: Counter) -> list[_Unit]:
    """Sentences of one over-long block; a sentence still too long becomes runs of words."""
    spans = []
    pos = 0
    for m in _SENTENCE.finditer(text):
        if m.start() > pos:
            spans.append((pos, m.start()))
        pos = m.end()
    if pos < len(text):
        spans.append((pos, len(text)))
    counts = count([text[a:b] for a, b in spans])
    units: list[_Unit] = []
    for (a, b), n in zip(spans, counts, strict=True):
        if n <= size:
            units.append(_Unit(base + a, base + b, n))
            continue
        words = [(m.start() + a, m.end() + a) for m in re.finditer(r"\S+", text[a:b])]
        wcounts = count([text[x:y] for x, y in words])
        run_start, run_tokens = None, 0
        last_end = a
        for (x, y), wn in zip(words, wcounts, strict=True):
            if run_start is not None and run_tokens + wn > size:
                units.append(_Unit(base + run_start, base + last_end, run_tokens))
                run_start, run_tokens = None, 0
            if run_start is None:
                run_start = x
            run_tokens += wn
            last_end = y
        if run_start is not None:
            units.append(_Unit(base + run_start, base + last_end, run_tokens))
    return units


def chunk_blocks(blocks: Sequence[Block], count: Counter, size: int = 200, overlap: int = 40, *,
                 offset: int = 0, ordinal: int = 0) -> list[Chunk]:
    """Chunks of at most ``size`` tokens (a single word longer than that is the only exception).

    ``offset`` / ``ordinal``: where ``blocks`` start in the document's text and the ordinal of their first
    chunk, for a document chunked a part at a time (a PDF's pages as they are extracted: a chunk never spans
    two pages, so parts cut at page boundaries chunk exactly as the whole document would)."""
    if overlap >= size:
        raise ValueError("overlap must be smaller than size")
    text = document_text(blocks)
    starts = []
    pos = 0
    for b in blocks:
        starts.append(pos)
        pos += len(b.text) + len(_SEP)
    counts = count([b.text for b in blocks]) if blocks else []

    # sections: (page, heading path, [(block index)...])
    sections: list[tuple[int | None, list[str], list[int]]] = []
    path: list[tuple[int, str]] = []
    cur: tuple[int | None, list[str], list[int]] | None = None
    for i, b in enumerate(blocks):
        if b.kind == "heading":
            level = max(1, b.level)
            path = [(lv, t) for lv, t in path if lv < level] + [(level, b.text)]
            cur = None
            continue
        heading = [t for _, t in path]
        if cur is None or cur[0] != b.page or cur[1] != heading:
            cur = (b.page, heading, [])
            sections.append(cur)
        cur[2].append(i)

    chunks: list[Chunk] = []
    for page, heading, idxs in sections:
        units: list[_Unit] = []
        for i in idxs:
            if counts[i] <= size:
                units.append(_Unit(starts[i], starts[i] + len(blocks[i].text), counts[i]))
            else:
                units += _split_long(blocks[i].text, starts[i], size, count)
        j = 0
        while j < len(units):
            first = j
            tokens = units[j].tokens
            j += 1
            while j < len(units) and tokens + units[j].tokens <= size:
                tokens += units[j].tokens
                j += 1
            a, b = units[first].start, units[j - 1].end
            chunks.append(Chunk(ordinal + len(chunks), text[a:b], offset + a, offset + b, tokens, page, list(heading)))
            if j >= len(units) or overlap == 0:
                continue
            # step back over the last units (never all of them: every chunk must move forward)
            back, back_tokens = j, 0
            while back - 1 > first and back_tokens + units[back - 1].tokens <= overlap and \
                    back_tokens + units[back - 1].tokens + units[j].tokens <= size:
                back -= 1
                back_tokens += units[back].tokens
            j = back
    return chunks
