"""Fixtures of the documents tests: one real embedding model (all-MiniLM-L6-v2, offline) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.documents.embed import Embedder, get_embedder


@pytest.fixture(scope="session")
def embedder() -> Iterator[Embedder]:
    """The process-wide instance the gateways of these tests use too (loaded once)."""
    e = get_embedder()
    e.encode(["warm up"])
    yield e
