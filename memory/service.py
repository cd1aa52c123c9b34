"""Session memory at run time: loading a session for composition, storing turns, vectors, summarisation.

One :class:`MemoryService` per gateway process. Blocking store calls run in worker threads;
embeddings run on the shared embedding model's worker thread (the RAG model: the same vectors
space as document search). Turn vectors are written in the background after a reply is stored,
and backfilled when a request finds some missing (a gateway killed in between), so a killed
process loses no retrievability. A per-session cache keeps the vector matrix in memory; it grows
by the rows added since (turn ids only increase) and is dropped with the session. The caches of
all sessions together stay within ``vector_cache_mb``: past it the least recently used are dropped,
and such a session's next request reloads its vectors from the database (the same rows: same
retrieval). The small per-session entries (how far turns are embedded, what a composition left
out, a summary's retry) are kept for the ``session_state_max`` most recently used sessions; a
forgotten session's next request asks the database again which turns lack vectors (one query) and
its next composition that leaves turns out notes them again, so it works as before, only not
from memory. Sessions' locks are held only while someone uses them (weak references).

Summarisation (:meth:`MemoryService.summarise`) runs as a background task after a reply when the
unsummarised history passes ``summarize_after_tokens`` *and* a composition has left turns out of the
lane's prompt; it folds only such turns (while everything fits verbatim a summary would only lose
detail and change the cached head). A failure is logged and retried later with back-off by the
sweeper; nothing waits for it. The summariser's lane call is made on behalf of the session's key (the only
key whose requests add turns to it), so the caller charges it to that key's limits; when they are spent it raises
:class:`SummaryDeferred` and the summary is tried again once the key has room (not counted as a failure).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from common.embedding import EmbedError, single_threaded_blas
from memory.compose import Composition, Scored, compose, estimate_tokens
from memory.config import MemoryConfig
from memory.store import MemoryStore, Session, Summary, Turn

__all__ = ["RETRIEVAL_FAILED", "RETRIEVAL_LOADING", "SUMMARY_SYSTEM", "Complete", "Loaded", "MemoryService",
           "SummaryDeferred", "summary_prompt"]

log = logging.getLogger("strata.memory")

# (messages, max_tokens, temperature, key_id of the session's owner) -> the reply text; raises on failure
Complete = Callable[[list[dict[str, Any]], int, float, int], Awaitable[str]]


class SummaryDeferred(Exception):
    """The summariser may not call a lane now (the session's key is at one of its limits): the summary is tried
    again after ``retry_after`` seconds, and the attempt is no failure."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = max(1.0, retry_after)

SUMMARY_SYSTEM = (
    "You keep the running summary of a conversation between a user and an assistant. Rewrite the summary so it "
    "also covers the new turns. Keep every fact the user stated: names, numbers, codes, dates, places, "
    "preferences and decisions. When a fact was corrected, keep only the corrected value. Write short plain "
    "sentences. Reply with the summary only.")
RETRIEVAL_LOADING = "retrieval=skipped (embedding model not loaded)"  # notes of the composition's header
RETRIEVAL_FAILED = "retrieval=skipped (embedding model failed; restarting)"
_BACKFILL_PER_REQUEST = 256  # turns embedded while a request waits (a gateway killed before its background work)
_TURN_CHARS_IN_SUMMARY = 1500


class Embeds(Protocol):
    version_key: str

    @property
    def ready(self) -> bool: ...  # the model is loaded (a query costs a forward pass, not the first load)

    async def aencode(self, texts: Sequence[str]) -> np.ndarray: ...

    async def aencode_query(self, text: str) -> np.ndarray: ...


def summary_prompt(previous: Summary | None, turns: Sequence[Turn]) -> list[dict[str, Any]]:
    """The fixed summarisation prompt: the previous summary and the turns to fold in."""
    lines = []
    for t in turns:
        body = t.content if len(t.content) <= _TURN_CHARS_IN_SUMMARY else t.content[:_TURN_CHARS_IN_SUMMARY] + " ..."
        lines.append(f"{'User' if t.role == 'user' else 'Assistant'}: {body}")
    turns_text = "\n".join(lines)
    if previous is not None and previous.text.strip():
        user = f"Current summary:\n{previous.text.strip()}\n\nNew turns:\n{turns_text}\n\nThe updated summary:"
    else:
        user = f"Conversation:\n{turns_text}\n\nThe summary:"
    return [{"role": "system", "content": SUMMARY_SYSTEM}, {"role": "user", "content": user}]


class _VecCache:
    """A session's turn vectors in memory, in turn-id order; grows in place (capacity doubling), so a new
    turn does not copy the whole matrix."""

    def __init__(self) -> None:
        self.last_id = 0
        self._ids = np.zeros(0, dtype=np.int64)
        self._buf: np.ndarray | None = None
        self.n = 0

    @property
    def ids(self) -> np.ndarray:
        return self._ids[:self.n]

    @property
    def nbytes(self) -> int:
        """Memory held (the allocated capacity, not just the rows in use)."""
        return self._ids.nbytes + (self._buf.nbytes if self._buf is not None else 0)

    @property
    def mat(self) -> np.ndarray:
        assert self._buf is not None or self.n == 0
        return self._buf[:self.n] if self._buf is not None else np.zeros((0, 0), dtype=np.float32)

    def extend(self, ids: np.ndarray, mat: np.ndarray) -> None:
        keep = ids > self.last_id  # a concurrent request of the session may have added them already
        if not keep.any():
            return
        ids, mat = ids[keep], mat[keep]
        need = self.n + len(ids)
        if self._buf is None or need > len(self._buf) or self._buf.shape[1] != mat.shape[1]:
            cap = max(need, 2 * (len(self._buf) if self._buf is not None else 0), 256)
            buf = np.empty((cap, mat.shape[1]), dtype=np.float32)
            new_ids = np.empty(cap, dtype=np.int64)
            if self._buf is not None and self.n:
                buf[:self.n] = self._buf[:self.n]
                new_ids[:self.n] = self._ids[:self.n]
            self._buf, self._ids = buf, new_ids
        self._buf[self.n:need] = mat
        self._ids[self.n:need] = ids
        self.n = need
        self.last_id = int(ids[-1])


@dataclass
class Loaded:
    """What a request needs to compose, loaded once (the budget may take several compositions)."""

    session: Session
    summary: Summary | None
    recent: list[Turn]
    candidates: list[Scored]
    load_ms: float
    note: str = ""  # reported in the composition's header (retrieval skipped while the model loads)

    def compose(self, cfg: MemoryConfig, system: str | None, new_messages: Sequence[dict[str, Any]],
                budget: int) -> Composition:
        comp = compose(system=system if system is not None else self.session.system, summary=self.summary,
                       recent=self.recent, candidates=self.candidates, new_messages=new_messages, budget=budget,
                       top_k=cfg.retrieve_top_k, retrieve_share=cfg.retrieve_share,
                       total_turns=self.session.n_turns)
        comp.note = self.note
        return comp


class MemoryService:
    def __init__(self, store: MemoryStore, cfg: MemoryConfig, embedder: Embeds | None,
                 complete: Complete | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.embedder = embedder
        self.complete = complete
        if embedder is not None:
            single_threaded_blas()  # the similarity over a session's vectors is one BLAS matrix-vector product
        self._cache: OrderedDict[int, _VecCache] = OrderedDict()  # least recently used first
        self._cache_budget = int(cfg.vector_cache_mb * 2**20)
        self.cache_evictions = 0
        self._embedded_upto: dict[int, int] = {}  # session pk -> every turn up to this id has a vector
        self._embedded_seq: dict[int, int] = {}  # ... and up to this seq: a request compares its n_turns, no query
        # a lock lives while a coroutine holds or waits for it: nothing to bound
        self._locks: weakref.WeakValueDictionary[int, asyncio.Lock] = weakref.WeakValueDictionary()
        self._recent: OrderedDict[int, None] = OrderedDict()  # sessions with small state here, LRU first
        self.state_evictions = 0
        self._summarising: set[int] = set()
        self._retry: dict[int, tuple[float, int]] = {}  # session pk -> (next attempt, failures)
        self._left_out: dict[int, int] = {}  # session pk -> newest unsummarised seq a composition left out
        self._tasks: set[asyncio.Task[Any]] = set()
        self.summaries_written = 0
        self.summary_failures = 0
        self.summaries_deferred = 0

    # ------------------------------------------------------------ sessions
    async def session(self, key_id: int, sid: str) -> Session | None:
        return await asyncio.to_thread(self.store.get_session, key_id, sid)

    async def delete(self, key_id: int, sid: str) -> bool:
        s = await asyncio.to_thread(self.store.get_session, key_id, sid)
        if s is None:
            return False
        # under the session's lock: an embedding in flight for the last reply writes its state before it is
        # dropped here, not after (a client deleting right after its last reply left state behind)
        async with self._locks.setdefault(s.pk, asyncio.Lock()):
            ok = await asyncio.to_thread(self.store.delete_session, key_id, sid)
            self._forget(s.pk)
        return ok

    def _forget(self, pk: int) -> None:
        """Drop what this process holds for a session that is gone. Session and turn ids are never reused
        (memory.store), so a leftover could not mislead a later session, but it would stay forever."""
        self._drop_state(pk)
        self._locks.pop(pk, None)

    def _drop_state(self, pk: int) -> None:
        """Forget a session's vectors and small state (not its lock: a request may hold it); its next request
        reloads what it needs from the database."""
        for held in (self._cache, self._embedded_upto, self._embedded_seq, self._retry, self._left_out, self._recent):
            held.pop(pk, None)

    def _touch(self, pk: int) -> None:
        """The session was used now: keep its small state, forget the least recently used sessions' past
        ``session_state_max`` (never a session being summarised: its task writes its state when done)."""
        recent = self._recent
        recent[pk] = None
        recent.move_to_end(pk)
        for _ in range(len(recent) - self.cfg.session_state_max):
            old = next(iter(recent))
            if old in self._summarising:
                recent.move_to_end(old)
                continue
            self._drop_state(old)
            self.state_evictions += 1

    # ------------------------------------------------------------ loading for composition
    async def load(self, session: Session, query: str) -> Loaded:
        t0 = time.perf_counter()
        pk = session.pk
        self._touch(pk)
        qvec: asyncio.Future[np.ndarray] | None = None
        cache: _VecCache | None = None
        note = ""
        retrieve = self.embedder is not None and self.cfg.retrieve_top_k > 0 and bool(query.strip()) \
            and session.n_turns > 0
        if retrieve and self.embedder is not None and not self.embedder.ready:
            # a new gateway's model takes a minute or more to load: compose from the summary and the recent
            # turns now rather than stall the request (the turns' vectors are backfilled once it is loaded)
            retrieve, note = False, RETRIEVAL_LOADING
        if retrieve and self.embedder is not None:
            # the query's forward pass runs on the embedding thread while the rows load on a worker thread
            qvec = asyncio.ensure_future(self.embedder.aencode_query(query[:4000]))
            cache = self._cache.setdefault(pk, _VecCache())
            self._cache.move_to_end(pk)
        try:
            summary, recent, ids, mat = await asyncio.to_thread(self._rows, session,
                                                                cache.last_id if cache is not None else None)
            candidates: list[Scored] = []
            if qvec is not None and cache is not None:
                cache.extend(ids, mat)
                try:
                    if session.n_turns > self._embedded_seq.get(pk, 0):  # turns without vectors (see embed_missing)
                        await self.embed_missing(pk, limit=_BACKFILL_PER_REQUEST)
                        assert self.embedder is not None
                        cache.extend(*await asyncio.to_thread(self.store.load_vectors, pk,
                                                              self.embedder.version_key, cache.last_id))
                    self._fit_cache()  # this request keeps its own reference, even if its session's entry goes
                    candidates = await self._rank(cache, await qvec, len(recent))
                except EmbedError as e:
                    # the model's process died (a new one is loading): compose as while it loads, not a 500
                    log.warning("memory: retrieval skipped, the embedding failed: %s", e)
                    candidates, note = [], RETRIEVAL_FAILED
        finally:
            if qvec is not None and not qvec.done():
                qvec.cancel()
            elif qvec is not None and not qvec.cancelled():
                qvec.exception()  # retrieved: an EmbedError the backfill's failure left unawaited is no warning
        return Loaded(session, summary, recent, candidates, (time.perf_counter() - t0) * 1000, note)

    def cache_bytes(self) -> int:
        return sum(c.nbytes for c in self._cache.values())

    def _fit_cache(self) -> None:
        """Drop the least recently used sessions' vectors until all fit the budget (a session larger than the
        budget on its own is not kept either: it reloads on each request)."""
        total = self.cache_bytes()
        while total > self._cache_budget and self._cache:
            _, dropped = self._cache.popitem(last=False)
            total -= dropped.nbytes
            self.cache_evictions += 1

    def _rows(self, session: Session, vectors_after: int | None
              ) -> tuple[Summary | None, list[Turn], np.ndarray, np.ndarray]:
        """Blocking: the summary, the recent turns and (``vectors_after`` not None) the vectors added since."""
        summary = self.store.summary(session.pk)
        after = _load_from(summary.last_seq if summary is not None else 0, session.n_turns,
                           self.cfg.recent_turns_max)
        recent = self.store.turns(session.pk, after_seq=after, newest=2 * self.cfg.recent_turns_max)
        if vectors_after is None or self.embedder is None:
            return summary, recent, np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        ids, mat = self.store.load_vectors(session.pk, self.embedder.version_key, vectors_after)
        return summary, recent, ids, mat

    async def _rank(self, cache: _VecCache, q: np.ndarray, n_recent: int) -> list[Scored]:
        """Older turns by similarity to the query, best first, ties by turn id (deterministic)."""
        ids, mat = cache.ids, cache.mat
        if not len(ids):
            return []
        scores = mat @ q  # (n,) cosine: both sides L2-normalised
        n_want = self.cfg.retrieve_top_k + n_recent  # the recent turns may take some of the best places
        top = np.argpartition(-scores, n_want - 1)[:n_want] if len(scores) > n_want else np.arange(len(scores))
        top = top[scores[top] >= self.cfg.retrieve_min_score]
        if not len(top):
            return []
        order = top[np.lexsort((ids[top], -scores[top]))]
        keep = [(int(ids[i]), float(scores[i])) for i in order]
        by_id = {t.id: t for t in await asyncio.to_thread(self.store.turns_by_id, [i for i, _ in keep])}
        return [Scored(by_id[i], s) for i, s in keep if i in by_id]

    async def embed_missing(self, pk: int, limit: int = 512) -> int:
        """Embed turns of the session that have no vector yet (background after each reply, bounded backfill)."""
        if self.embedder is None:
            return 0
        lock = self._locks.setdefault(pk, asyncio.Lock())
        async with lock:
            upto = self._embedded_upto.get(pk, 0)
            # before the check: no turn slips past
            last, last_seq = await asyncio.to_thread(self.store.last_turn, pk)
            if last == 0:  # no turns: the session was deleted (turns go only with it; callers follow a stored turn)
                self._forget(pk)
                return 0
            if last <= upto:
                self._embedded_seq[pk] = max(self._embedded_seq.get(pk, 0), last_seq)
                self._touch(pk)
                return 0
            todo = await asyncio.to_thread(self.store.missing_vectors, pk, self.embedder.version_key, limit, upto)
            n = 0
            if todo:
                vecs = await self.embedder.aencode([t.content[:4000] or " " for t in todo])
                n = await asyncio.to_thread(self.store.put_vectors, pk, self.embedder.version_key,
                                            [t.id for t in todo], vecs)
            if len(todo) < limit:  # every turn up to `last` has its vector now: later checks start there
                self._embedded_upto[pk] = last
                self._embedded_seq[pk] = max(self._embedded_seq.get(pk, 0), last_seq)
            self._touch(pk)
            return n

    def composed(self, loaded: Loaded, comp: Composition) -> None:
        """Note what the composition sent to the lane left out: summarisation folds only such turns."""
        if comp.dropped > 0:
            pk = loaded.session.pk
            self._left_out[pk] = max(self._left_out.get(pk, 0), loaded.recent[comp.dropped - 1].seq)
            self._touch(pk)

    # ------------------------------------------------------------ storing a reply
    async def remember(self, session: Session, user_messages: Sequence[dict[str, Any]], reply: str, *,
                       complete: bool, reply_tokens: int | None, request_id: str | None) -> list[Turn]:
        """Store the request's user message(s) and the reply in one transaction, then start the background
        work (vectors, summarisation). Shielded: a cancelled request still finishes the write."""
        items: list[tuple[str, str, int, bool]] = []
        for m in user_messages:
            content = m.get("content") if isinstance(m.get("content"), str) else _text(m.get("content"))
            items.append((str(m.get("role") or "user"), content[:self.cfg.max_turn_chars],
                          estimate_tokens(content), True))
        tokens = reply_tokens if reply_tokens is not None and complete else estimate_tokens(reply)
        items.append(("assistant", reply[:self.cfg.max_turn_chars], max(1, tokens), complete))
        try:
            stored = await asyncio.shield(asyncio.to_thread(self.store.append, session.pk, items, request_id))
        except KeyError:  # deleted while the request ran: drop what its loading and composition noted
            self._forget(session.pk)
            raise
        self._spawn(self._after(session.pk), f"memory-after-{session.pk}")
        return stored

    def _spawn(self, coro: Awaitable[Any], name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after(self, pk: int) -> None:
        try:
            await self.embed_missing(pk)
        except Exception as e:  # retried by the next request's backfill
            log.warning("memory: embedding turns of session pk=%d failed: %s: %s", pk, type(e).__name__, e)
        if self.cfg.summarize and self.complete is not None:
            await self.summarise(pk)

    # ------------------------------------------------------------ summarisation
    async def summarise(self, pk: int, *, force: bool = False) -> bool:
        """Fold the oldest unsummarised turns into the running summary when the history is long enough.
        True when a new summary was stored. Never raises: a failure schedules a retry."""
        if pk in self._summarising or self.complete is None:
            return False
        nxt = self._retry.get(pk)
        if nxt is not None and time.monotonic() < nxt[0] and not force:
            return False
        self._summarising.add(pk)
        try:
            return await self._summarise(pk, force)
        except SummaryDeferred as e:  # the key's limits: later, when it has room; its failure count stays
            fails = self._retry.get(pk, (0.0, 0))[1]
            self._retry[pk] = (time.monotonic() + e.retry_after, fails)
            self._touch(pk)
            self.summaries_deferred += 1
            log.info("memory: summarising session pk=%d waits %.0fs: %s", pk, e.retry_after, e)
            return False
        except Exception as e:
            fails = (self._retry.get(pk, (0.0, 0))[1]) + 1
            delay = self.cfg.summary_retry_s * min(16, 2 ** (fails - 1))
            self._retry[pk] = (time.monotonic() + delay, fails)
            self._touch(pk)
            self.summary_failures += 1
            log.warning("memory: summarising session pk=%d failed (%d in a row; retry in %.0fs): %s: %s", pk, fails,
                        delay, type(e).__name__, e)
            return False
        finally:
            self._summarising.discard(pk)

    async def _summarise(self, pk: int, force: bool) -> bool:
        assert self.complete is not None
        cfg = self.cfg
        prev = await asyncio.to_thread(self.store.summary, pk)
        after = prev.last_seq if prev is not None else 0
        n, tokens = await asyncio.to_thread(self.store.pending_tokens, pk, after)
        left_out = self._left_out.get(pk, 0)
        if n <= cfg.summary_keep_turns or (not force and (tokens < cfg.summarize_after_tokens or left_out <= after)):
            self._retry.pop(pk, None)
            return False
        pending = await asyncio.to_thread(self.store.turns, pk, after_seq=after)
        foldable = pending[:max(0, len(pending) - cfg.summary_keep_turns)]
        if not force:  # only what the verbatim window already leaves out: the turns the lane sees stay verbatim
            foldable = [t for t in foldable if t.seq <= left_out]
        fold: list[Turn] = []
        spent = 0
        for t in foldable:
            cost = min(t.tokens, _TURN_CHARS_IN_SUMMARY // 3) + 4
            if fold and spent + cost > cfg.summary_input_tokens:
                break
            fold.append(t)
            spent += cost
        if not fold:
            return False
        owner = await asyncio.to_thread(self.store.session_key, pk)
        if owner is None:  # deleted meanwhile
            self._retry.pop(pk, None)
            return False
        text = await asyncio.wait_for(self.complete(summary_prompt(prev, fold), cfg.summary_max_tokens,
                                                    cfg.summary_temperature, owner), cfg.summary_timeout_s)
        text = text.strip()
        if not text:
            raise ValueError("the lane returned an empty summary")
        first = prev.first_seq if prev is not None else fold[0].seq
        ok = await asyncio.to_thread(self.store.put_summary, pk, first, fold[-1].seq, text, estimate_tokens(text),
                                     after)
        self._retry.pop(pk, None)
        if ok:
            self.summaries_written += 1
            log.info("memory: session pk=%d summary now covers turns %d..%d", pk, first, fold[-1].seq)
        return ok

    async def sweep(self) -> None:
        """Retry failed summarisations whose back-off has passed (the gateway runs this periodically)."""
        now = time.monotonic()
        for pk, (when, _) in list(self._retry.items()):
            if when <= now:
                await self.summarise(pk)

    async def run_sweeper(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception as e:  # never let the loop die
                log.warning("memory: summary sweep failed: %s: %s", type(e).__name__, e)

    async def drain(self, timeout: float = 5.0) -> None:
        """Wait (bounded) for background work, then cancel what is left (shutdown, tests)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
        for t in list(self._tasks):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


def _load_from(summarised: int, n_turns: int, most: int) -> int:
    """The seq after which the recent turns are loaded: the summary's end, moved forward in steps of half of
    ``most`` when more than ``most`` turns are unsummarised. Steps, not a sliding window: the first turn
    loaded anchors the verbatim blocks (memory.compose), so it must stay put while the session grows."""
    excess = n_turns - summarised - most
    if excess <= 0:
        return summarised
    step = max(1, most // 2)
    return summarised + -(-excess // step) * step


def _text(content: Any) -> str:
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return "" if content is None else str(content)
