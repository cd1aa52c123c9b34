"""memory.service without lanes or an embedding model: when summarisation runs and what it folds, the recent
turns' loading window (it anchors the verbatim blocks, so it moves in steps), and that a deleted session leaves
no state behind for a later one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from memory.config import MemoryConfig
from memory.service import MemoryService, _load_from
from memory.store import MemoryStore, Session, open_engine


def _service(tmp_path: Path, calls: list[list[dict[str, Any]]]) -> MemoryService:
    async def complete(messages: list[dict[str, Any]], max_tokens: int, temperature: float, key_id: int) -> str:
        assert key_id == 1  # the session's key
        calls.append(messages)
        return "The user's cat is Pixel."

    cfg = MemoryConfig(summarize_after_tokens=100, summary_keep_turns=2, summary_input_tokens=10_000)
    return MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, None, complete)


def _session_with_turns(svc: MemoryService, n: int, label: str, body: str, tokens: int) -> Session:
    """A new session of key 1 holding ``n`` alternating user/assistant turns ``f"{label} {i} " + body`` of
    ``tokens`` estimated tokens each, read back (so its ``n_turns`` counts them)."""
    s = svc.store.create_session(1)
    assert s is not None
    svc.store.append(s.pk, [("user" if i % 2 == 0 else "assistant", f"{label} {i} " + body, tokens, True)
                            for i in range(n)])
    s = svc.store.get_session(1, s.id)
    assert s is not None
    return s


def test_summary_folds_only_what_the_lane_no_longer_sees(tmp_path: Path) -> None:
    calls: list[list[dict[str, Any]]] = []
    svc = _service(tmp_path, calls)
    s = _session_with_turns(svc, 20, "line", "x" * 60, 30)
    # everything still fits verbatim (no composition left a turn out): no summary, however long the history
    assert asyncio.run(svc.summarise(s.pk)) is False and not calls
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
    s = _session_with_turns(svc, 40, "turn", "y" * 300, 100)
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


class _Words:
    """Stands in for the embedding model: a text's vector marks whether it names the planted fact's word, so the
    question scores 1.0 against the fact's turn and 0.0 against every filler. With ``gate`` set, turn embeddings
    wait for it: a background embedding held in flight."""

    version_key = "test-words:2"
    ready = True

    def __init__(self) -> None:
        self.gate: asyncio.Event | None = None
        self.waiting = False

    @staticmethod
    def _vec(text: str) -> Any:
        import numpy as np

        return np.array([1.0, 0.0] if "locker" in text.lower() else [0.0, 1.0], dtype=np.float32)

    async def aencode(self, texts: Any) -> Any:
        import numpy as np

        if self.gate is not None:
            self.waiting = True
            await self.gate.wait()
        return np.stack([self._vec(t) for t in texts])

    async def aencode_query(self, text: str) -> Any:
        return self._vec(text)


def _held(svc: MemoryService) -> dict[str, Any]:
    """The service's per-session state, by attribute (empty dicts when nothing is held)."""
    names = ("_cache", "_embedded_upto", "_embedded_seq", "_locks", "_retry", "_left_out", "_summarising")
    return {n: getattr(svc, n) for n in names if getattr(svc, n)}


@pytest.mark.parametrize("new_key", [1, 2], ids=["same-key", "other-key"])
def test_a_session_deleted_during_its_embedding_leaves_nothing_for_the_next(tmp_path: Path, new_key: int) -> None:
    """The harness's memory scenario: each distance a new session, deleted right after its last reply while that
    reply's embedding ran. The next session used to get the deleted one's pk and turn ids and inherit its
    "embedded up to turn N", so its oldest turns (the planted fact) never got vectors and were never retrieved."""
    model = _Words()
    cfg = MemoryConfig()  # default retrieve_min_score 0.25, top_k 4
    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, model, None)
    filler = "filler about the weather in some town, nothing to remember here " * 5  # ~110 estimated tokens

    async def say(s: Any, text: str) -> None:
        await svc.remember(s, [{"role": "user", "content": text}], "Noted, thanks.", complete=True,
                           reply_tokens=4, request_id=None)

    async def scenario() -> None:
        old = svc.store.create_session(1)
        assert old is not None
        for i in range(10):
            await say(old, f"{i}: {filler}")
        await svc.drain()
        model.gate = asyncio.Event()
        await say(old, "the last question")  # its embedding starts in the background and is held
        for _ in range(500):
            if model.waiting:
                break
            await asyncio.sleep(0.01)
        assert model.waiting
        deleting = asyncio.ensure_future(svc.delete(1, old.id))
        await asyncio.wait({deleting}, timeout=0.5)  # the old code deleted here, before the embedding ended
        model.gate.set()
        assert await deleting is True
        model.gate = None
        await svc.drain()
        assert _held(svc) == {}  # a deleted session leaves nothing behind

        new = svc.store.create_session(new_key)
        assert new is not None and new.pk > old.pk  # ids are never reused
        await say(new, "My locker code is 4417.")
        for i in range(30):
            await say(new, f"{i}: {filler}")
        await svc.drain()
        s = svc.store.get_session(new_key, new.id)
        assert s is not None
        q = "What is my locker code?"
        comp = (await svc.load(s, q)).compose(cfg, None, [{"role": "user", "content": q}], 1200)
        assert comp.dropped > 2  # the fact's exchange is far outside the verbatim window
        assert comp.retrieved >= 1 and any("4417" in m["content"] for m in comp.messages)
        assert await svc.delete(new_key, new.id) is True
        assert _held(svc) == {}

    asyncio.run(scenario())


def test_late_writers_of_a_deleted_session_leave_nothing(tmp_path: Path) -> None:
    """A request that loaded a session, then found it deleted when storing its reply, and an embedding or a
    summary that starts after the deletion: none of them leaves state for the gone session."""
    model = _Words()
    calls: list[list[dict[str, Any]]] = []

    async def complete(messages: list[dict[str, Any]], max_tokens: int, temperature: float, key_id: int) -> str:
        assert key_id == 1  # the session's key
        calls.append(messages)
        return "summary"

    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")),
                        MemoryConfig(retrieve_min_score=0.0), model, complete)

    async def scenario() -> None:
        s = _session_with_turns(svc, 30, "turn", "z" * 300, 100)
        loaded = await svc.load(s, "locker?")
        comp = loaded.compose(svc.cfg, None, [{"role": "user", "content": "locker?"}], 1200)
        svc.composed(loaded, comp)
        assert comp.dropped > 0 and svc._left_out and svc._cache
        assert svc.store.delete_session(1, s.id)  # another gateway (or this one's route) deleted it meanwhile
        with pytest.raises(KeyError):
            await svc.remember(s, [{"role": "user", "content": "locker?"}], "ok", complete=True, reply_tokens=1,
                               request_id=None)
        assert _held(svc) == {}
        assert await svc.embed_missing(s.pk) == 0 and await svc.summarise(s.pk, force=True) is False
        assert (await svc.load(s, "locker?")).candidates == []
        await svc.drain()
        assert _held(svc) == {} and not calls

    asyncio.run(scenario())


def test_the_vector_cache_stays_within_its_budget_and_an_evicted_session_retrieves_the_same(tmp_path: Path) -> None:
    """Sessions' vectors are cached least recently used first within ``vector_cache_mb``; a session dropped
    from the cache reloads its vectors from the database and retrieves exactly what it did before."""
    model = _Words()
    one = 256 * (2 * 4 + 8)  # one session's cache at its smallest capacity: 256 rows of 2 floats and an id
    cfg = MemoryConfig(vector_cache_mb=2.5 * one / 2**20)  # room for two sessions, not three
    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, model, None)
    q = "What is my locker code?"

    async def scenario() -> None:
        sessions, first = [], []
        for n in range(3):
            s = _session_with_turns(svc, 40, f"s{n}", "filler about the weather " * 8, 60)
            svc.store.append(s.pk, [("user", f"My locker code is 44{n}7.", 8, True)])
            s = svc.store.get_session(1, s.id)
            assert s is not None
            await svc.embed_missing(s.pk)
            loaded = await svc.load(s, q)
            assert svc.cache_bytes() <= 2.5 * one and len(svc._cache) <= 2  # the budget holds after every load
            first.append([(c.turn.id, c.score) for c in loaded.candidates])
            sessions.append(s)
        assert list(svc._cache) == [sessions[1].pk, sessions[2].pk] and svc.cache_evictions == 1
        for n, s in enumerate(sessions):  # in this order each session was just dropped: every load reloads
            loaded = await svc.load(s, q)
            assert [(c.turn.id, c.score) for c in loaded.candidates] == first[n]
            assert loaded.candidates[0].turn.content == f"My locker code is 44{n}7." and loaded.candidates[0].score == 1
            assert svc.cache_bytes() <= 2.5 * one
        assert svc.cache_evictions == 4  # each of those loads dropped the least recently used session

    asyncio.run(scenario())


def test_per_session_state_is_bounded_and_a_forgotten_session_retrieves_the_same(tmp_path: Path) -> None:
    """The small per-session entries (embedded up to, left out, retries) are kept for the ``session_state_max``
    most recently used sessions only; a forgotten session's next request rebuilds them from the database and
    retrieves exactly what it did before."""
    model = _Words()
    cfg = MemoryConfig(session_state_max=3)
    svc = MemoryService(MemoryStore(open_engine(f"sqlite:///{tmp_path / 'm.db'}")), cfg, model, None)
    q = "What is my locker code?"
    small = ("_embedded_upto", "_embedded_seq", "_retry", "_left_out", "_cache", "_recent")

    async def scenario() -> None:
        sessions, first = [], []
        for n in range(8):
            s = _session_with_turns(svc, 6, f"s{n}", "filler about the weather", 10)
            svc.store.append(s.pk, [("user", f"My locker code is 44{n}7.", 8, True)])
            s = svc.store.get_session(1, s.id)
            assert s is not None
            await svc.embed_missing(s.pk)
            loaded = await svc.load(s, q)
            svc.composed(loaded, loaded.compose(svc.cfg, None, [{"role": "user", "content": q}], 60))
            assert all(len(getattr(svc, name)) <= 3 for name in small)  # the bound holds after every request
            first.append([(c.turn.id, c.score) for c in loaded.candidates])
            sessions.append(s)
        assert list(svc._recent) == [s.pk for s in sessions[-3:]] and svc.state_evictions == 5 and svc._left_out
        assert not svc._locks  # no lock outlives its use
        s0 = sessions[0]
        assert s0.pk not in svc._embedded_seq and s0.pk not in svc._left_out
        loaded = await svc.load(s0, q)  # forgotten: asks the database which turns lack vectors, none do
        assert [(c.turn.id, c.score) for c in loaded.candidates] == first[0]
        assert loaded.candidates[0].turn.content == "My locker code is 4407."
        assert svc._embedded_seq[s0.pk] == s0.n_turns and list(svc._recent)[-1] == s0.pk

    asyncio.run(scenario())
