"""Fixtures of the documents tests: one real embedding model (all-MiniLM-L6-v2, offline) per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gateway.documents.embed import Embedder


@pytest.fixture(scope="session")
def embedder() -> Iterator[Embedder]:
    e = Embedder(threads=1, batch=32)
    e.encode(["warm up"])
    yield e
    e.close()
