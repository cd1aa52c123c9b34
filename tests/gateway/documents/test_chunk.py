"""Chunking: token budgets, overlap, structure boundaries and exact provenance."""

from __future__ import annotations

import pytest

from gateway.documents.chunk import Chunk, chunk_blocks, document_text, text_length
from gateway.documents.embed import Embedder
from gateway.documents.extract import Block


def test_chunks_respect_size_and_keep_exact_offsets(embedder: Embedder) -> None:
    sentences = " ".join(f"Sentence number {i} says something about topic {i % 7}." for i in range(120))
    blocks = [Block("Guide", "heading", 1), Block(sentences), Block("Short tail paragraph.")]
    chunks = chunk_blocks(blocks, embedder.count_tokens, size=64, overlap=16)
    text = document_text(blocks)
    assert len(chunks) > 5
    for c in chunks:
        assert text[c.char_start:c.char_end] == c.text
        assert c.tokens <= 64
        assert embedder.count_tokens([c.text])[0] <= 64 + 4  # joins add at most a token or two
        assert c.heading == ["Guide"]
    assert [c.ordinal for c in chunks] == list(range(len(chunks)))
    # overlap: each next chunk starts inside the previous one
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.char_start < a.char_end
        assert b.char_end > a.char_end


def test_no_overlap_means_disjoint(embedder: Embedder) -> None:
    blocks = [Block(f"Paragraph {i} with a few words in it.") for i in range(40)]
    chunks = chunk_blocks(blocks, embedder.count_tokens, size=40, overlap=0)
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b.char_start > a.char_end


def test_headings_and_pages_split_sections(embedder: Embedder) -> None:
    blocks = [Block("Manual", "heading", 1), Block("Intro text."), Block("Safety", "heading", 2),
              Block("Wear goggles."), Block("Install", "heading", 2), Block("Bolt it down."),
              Block("p1 text", page=1), Block("p2 text", page=2)]
    chunks = chunk_blocks(blocks, embedder.count_tokens, size=200, overlap=20)
    got = [(c.heading, c.page, c.text) for c in chunks]
    assert got == [(["Manual"], None, "Intro text."), (["Manual", "Safety"], None, "Wear goggles."),
                   (["Manual", "Install"], None, "Bolt it down."),
                   (["Manual", "Install"], 1, "p1 text"), (["Manual", "Install"], 2, "p2 text")]
    assert chunks[1].embed_text() == "Manual > Safety\nWear goggles."


def test_a_sentence_longer_than_a_chunk_is_split_by_words(embedder: Embedder) -> None:
    blocks = [Block(" ".join(f"word{i}" for i in range(600)))]
    chunks = chunk_blocks(blocks, embedder.count_tokens, size=50, overlap=10)
    assert len(chunks) > 10
    assert all(c.tokens <= 50 for c in chunks)
    assert chunks[-1].text.endswith("word599")


def test_bad_overlap() -> None:
    with pytest.raises(ValueError):
        chunk_blocks([], lambda t: [len(x) for x in t], size=10, overlap=10)


def test_a_document_chunked_a_part_at_a_time_is_chunked_as_a_whole(embedder: Embedder) -> None:
    """Ingestion chunks a PDF's pages as the extraction child sends them: same chunks, ordinals, offsets."""
    pages = [[Block(f"Page {p} paragraph {i}: " + "words of filler text " * (3 + (p * i) % 7), "para", 0, p)
              for i in range(4)] for p in range(1, 6)]
    whole = chunk_blocks([b for page in pages for b in page], embedder.count_tokens, size=48, overlap=12)
    parted: list[Chunk] = []
    offset = 0
    for part in (pages[0] + pages[1], pages[2], pages[3] + pages[4]):
        parted += chunk_blocks(part, embedder.count_tokens, size=48, overlap=12, offset=offset, ordinal=len(parted))
        offset += text_length(part)
    assert parted == whole and len(whole) > 5
