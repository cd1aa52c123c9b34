"""A session's retrieval whose embedding fails with EmbedError (the model's process died; a new one loads) is
skipped with a note in the composition's header, as while the model loads, instead of failing the request."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common.embedding import EmbedError
from memory.config import MemoryConfig
from memory.service import RETRIEVAL_FAILED, MemoryService
from memory.store import MemoryStore, Session, open_engine


class _Crashing:
    """A loaded model whose process dies during the next ``fail_query`` queries / ``fail_encode`` encodes."""

    version_key = "test-model:4"
    ready = True

    def __init__(self) -> None:
        self.fail_query = 0
        self.fail_encode = 0

    async def aencode(self, texts: Sequence[str]) -> np.ndarray:
        if self.fail_encode:
            self.fail_encode -= 1
            raise EmbedError("the embedding model's process died during this request (signal 9)")
        return np.tile(np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32), (len(texts), 1))

    async def aencode_query(self, text: str) -> np.ndarray:
        if self.fail_query:
            self.fail_query -= 1
            raise EmbedError("the embedding model's process died during this request (signal 9)")
        return np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)


def _session(svc: MemoryService) -> Session:
    s = svc.store.create_session(1)
    assert s is not None
    svc.store.append(s.pk, [("user" if i % 2 == 0 else "assistant", f"turn {i} " + "y" * 300, 100, True)
                            for i in range(40)])
    s = svc.store.get_session(1, s.id)
    assert s is not None
    return s


def test_retrieval_is_skipped_when_the_embedding_fails(tmp_path: Path) -> None:
    model = _Crashing()
    cfg = MemoryConfig(retrieve_min_score=0.0)
    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, model, None)
    s = _session(svc)
    new = [{"role": "user", "content": "and the cat?"}]

    async def compose() -> str:
        loaded = await svc.load(s, "and the cat?")
        comp = loaded.compose(cfg, None, new, 1200)
        assert comp.recent > 0 and comp.dropped > 0
        return comp.header() if comp.retrieved == 0 else ""

    model.fail_encode = 1  # the backfill of the turns' vectors (no vector stored yet) fails
    assert asyncio.run(compose()).endswith("; " + RETRIEVAL_FAILED)
    model.fail_query = 1  # the backfill works now, the query's encode fails
    assert asyncio.run(compose()).endswith("; " + RETRIEVAL_FAILED)
    assert asyncio.run(compose()) == ""  # the new process: older turns retrieved again, no note
