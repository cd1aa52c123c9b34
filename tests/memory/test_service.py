"""memory.service without lanes or an embedding model: when summarisation runs and what it folds, and the
recent turns' loading window (it anchors the verbatim blocks, so it moves in steps)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from memory.config import MemoryConfig
from memory.service import MemoryService, _load_from
from memory.store import MemoryStore, open_engine


def _service(tmp_path: Path, calls: list[list[dict[str, Any]]]) -> MemoryService:
    async def complete(messages: list[dict[str, Any]], max_tokens: int, temperature: float) -> str:
        calls.append(messages)
        return "The user's cat is Pixel."

    cfg = MemoryConfig(summarize_after_tokens=100, summary_keep_turns=2, summary_input_tokens=10_000)
    return MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, None, complete)


def test_summary_folds_only_what_the_lane_no_longer_sees(tmp_path: Path) -> None:
    calls: list[list[dict[str, Any]]] = []
    svc = _service(tmp_path, calls)
    s = svc.store.create_session(1)
    assert s is not None
    svc.store.append(s.pk, [("user" if i % 2 == 0 else "assistant", f"line {i} " + "x" * 60, 30, True)
                            for i in range(20)])
    # everything still fits verbatim (no composition left a turn out): no summary, however long the history
    assert asyncio.run(svc.summarise(s.pk)) is False and not calls
    s = svc.store.get_session(1, s.id)
    assert s is not None
    loaded = asyncio.run(svc.load(s, "what was my cat called?"))
    comp = loaded.compose(svc.cfg, None, [{"role": "user", "content": "what was my cat called?"}], 400)
    assert comp.dropped > 0
    svc.composed(loaded, comp)
    assert asyncio.run(svc.summarise(s.pk)) is True and len(calls) == 1
    sm = svc.store.summary(s.pk)
    assert sm is not None and sm.last_seq == comp.dropped  # exactly the turns left out of the lane's prompt
    # nothing more is left out: the next reply starts no summary
    assert asyncio.run(svc.summarise(s.pk)) is False and len(calls) == 1


def test_recent_turns_load_from_a_point_that_moves_in_steps() -> None:
    assert _load_from(0, 150, 200) == 0 and _load_from(40, 240, 200) == 40
    froms = [_load_from(0, n, 200) for n in range(201, 600)]
    assert all(n - f <= 200 for n, f in zip(range(201, 600), froms, strict=True))  # never more than `most`
    assert all(f % 100 == 0 for f in froms) and len(set(froms)) == 4  # moves by half of `most` at a time


class _LoadingModel:
    """Stands in for the embedding model of a gateway that just started: ``ready`` is False until the test
    says the load finished; a query before then would wait for the load (the stall this guards against)."""

    version_key = "test-model:4"

    def __init__(self) -> None:
        self.ready = False
        self.queries: list[str] = []

    async def aencode(self, texts: Any) -> Any:
        import numpy as np

        return np.tile(np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32), (len(texts), 1))

    async def aencode_query(self, text: str) -> Any:
        import numpy as np

        if not self.ready:
            raise AssertionError("the request waited for the embedding model's load")
        self.queries.append(text)
        return np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)


def test_composes_without_retrieval_while_the_model_loads(tmp_path: Path) -> None:
    model = _LoadingModel()
    cfg = MemoryConfig(retrieve_min_score=0.0)
    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, model, None)
    s = svc.store.create_session(1)
    assert s is not None
    svc.store.append(s.pk, [("user" if i % 2 == 0 else "assistant", f"turn {i} " + "y" * 300, 100, True)
                            for i in range(40)])
    s = svc.store.get_session(1, s.id)
    assert s is not None
    new = [{"role": "user", "content": "and the cat?"}]
    loaded = asyncio.run(svc.load(s, "and the cat?"))
    comp = loaded.compose(cfg, None, new, 1200)
    assert comp.recent > 0 and comp.dropped > 0 and comp.retrieved == 0 and not model.queries
    assert comp.header().endswith("; retrieval=skipped (embedding model not loaded)")
    model.ready = True  # loaded: the same request now retrieves older turns, and the header says nothing more
    comp = asyncio.run(svc.load(s, "and the cat?")).compose(cfg, None, new, 1200)
    assert model.queries == ["and the cat?"] and comp.retrieved > 0 and "skipped" not in comp.header()


def test_a_new_embedder_is_not_ready_until_loaded() -> None:
    from gateway.documents.embed import Embedder

    e = Embedder(backend="torch")  # reads the tokenizer only; the model loads on first use
    assert e.ready is False
