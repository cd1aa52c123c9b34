"""The Python face of the engine: open a GGUF model, run batched forward steps, generate.

Python schedules *steps*; one step (any mix of prefill chunks and decode tokens of
many sequences) is a single C call that releases the GIL.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.block_manager import BlockManager, KVCapacityError
from engine.gguf_model import ModelFile, build_desc, open_model
from engine.native import EngineError, check, ffi, lib, ptr

__all__ = ["Engine", "GenerationResult", "StepStats", "SeqSlot", "KVCapacityError", "EngineError"]


@dataclass
class StepStats:
    """Timing and routing figures of one forward step."""

    n_tokens: int
    t_total: float
    t_attn: float
    t_experts: float
    t_dense: float
    t_output: float
    n_expert_tokens: int
    n_active_experts: int


@dataclass
class SeqSlot:
    """One sequence's place in the paged KV cache."""

    blocks: list[int] = field(default_factory=list)
    n_tokens: int = 0  # tokens whose K/V are in the cache


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int


def _default_threads(cores: Sequence[int] | None) -> int:
    if cores:
        return len(cores)
    return len(os.sched_getaffinity(0))


class Engine:
    """A loaded model, its KV cache and thread pool."""

    def __init__(self, mf: ModelFile, threads: int, cores: Sequence[int] | None, kv_tokens: int,
                 block_size: int, prefill_chunk: int, max_model_len: int | None = None) -> None:
        self.model_file = mf
        self.hparams = mf.hparams
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.cores = list(cores) if cores else None
        self._desc, self._keep = build_desc(mf)
        pm = ffi.new("st_model **")
        check(lib.st_model_create(self._desc, pm), str(mf.path))
        self._model = pm[0]
        n_blocks = max(1, -(-kv_tokens // block_size))
        pk = ffi.new("st_kv **")
        rc = lib.st_kv_create(self._model, n_blocks, block_size, pk)
        if rc:
            lib.st_model_destroy(self._model)
            check(rc, "KV cache")
        self._kv = pk[0]
        pp = ffi.new("st_pool **")
        core_arr = ffi.new("int32_t[]", self.cores) if self.cores else ffi.NULL
        rc = lib.st_pool_create(threads, core_arr, len(self.cores) if self.cores else 0, pp)
        if rc:
            lib.st_kv_destroy(self._kv)
            lib.st_model_destroy(self._model)
            check(rc, "thread pool")
        self._pool = pp[0]
        self.blocks = BlockManager(n_blocks, block_size)
        self.kv_tokens = n_blocks * block_size
        self._tokenizer: Any = None
        self._template: Any = None
        self.last_stats: StepStats | None = None
        self._max_model_len = max_model_len
        self._step_lock = threading.Lock()
        # The metadata (a 49k-entry vocabulary, merges) lives as long as the engine; keep
        # the cyclic GC from re-walking it on every collection during decoding.
        gc.collect()
        gc.freeze()

    # ------------------------------------------------------------ lifecycle
    @classmethod
    def open(cls, path: str | os.PathLike[str] | None = None, *, threads: int | None = None,
             cores: Sequence[int] | None = None, kv_tokens: int = 4096, block_size: int = 16,
             prefill_chunk: int = 512, max_model_len: int | None = None) -> Engine:
        """Open a GGUF model (the embedded default model when path is None).

        max_model_len overrides the context window (default: the trained context,
        bounded by the KV capacity); beyond the trained context quality is not promised.
        """
        if path is None:
            from engine.default_model import build_default_model, default_model_path

            path = build_default_model(default_model_path())
        if kv_tokens < 1 or block_size < 1 or prefill_chunk < 1:
            raise ValueError("kv_tokens, block_size and prefill_chunk must be positive")
        n_threads = threads if threads is not None else _default_threads(cores)
        if n_threads < 1:
            raise ValueError(f"threads must be >= 1, got {n_threads}")
        if max_model_len is not None and max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        return cls(open_model(path), n_threads, cores, kv_tokens, block_size, prefill_chunk, max_model_len)

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            lib.st_pool_destroy(self._pool)
            lib.st_kv_destroy(self._kv)
            lib.st_model_destroy(self._model)
            self._pool = self._kv = self._model = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the contract
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ text side
    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from engine.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_metadata(self.model_file.metadata)
        return self._tokenizer

    @property
    def chat_template(self) -> Any:
        if self._template is None:
            from engine.chat_template import ChatTemplate

            self._template = ChatTemplate.from_metadata(self.model_file.metadata, self.tokenizer)
        return self._template

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    @property
    def n_ctx(self) -> int:
        """The context window: the trained context (or the override), bounded by the KV capacity."""
        return min(self._max_model_len or self.hparams.n_ctx_train, self.kv_tokens)

    # ------------------------------------------------------------ KV slots
    def new_slot(self) -> SeqSlot:
        return SeqSlot()

    def reserve(self, slot: SeqSlot, n_tokens: int) -> None:
        """Make sure slot has blocks for n_tokens positions."""
        need = -(-n_tokens // self.block_size) - len(slot.blocks)
        if need > 0:
            got = self.blocks.allocate(need)
            if got is None:
                raise KVCapacityError(f"need {need} KV blocks, {self.blocks.num_free} free of {self.blocks.n_blocks}")
            slot.blocks.extend(got)

    def free_slot(self, slot: SeqSlot) -> None:
        self.blocks.release(slot.blocks)
        slot.blocks = []
        slot.n_tokens = 0

    # ------------------------------------------------------------ the step
    def forward(self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int],
                block_tables: Sequence[Sequence[int]], logit_idx: Sequence[int],
                expert_hist: np.ndarray | None = None) -> np.ndarray:
        """One batched forward step; returns logits [len(logit_idx), n_vocab]."""
        if self._model is None:
            raise EngineError("engine is closed")
        n = len(tokens)
        if not (len(pos) == len(seq) == n):
            raise ValueError("tokens, pos and seq must have the same length")
        max_blocks = max(1, max((len(bt) for bt in block_tables), default=1))
        bt = np.full((len(block_tables), max_blocks), -1, dtype=np.int32)
        for i, row in enumerate(block_tables):
            bt[i, : len(row)] = row
        tok = np.ascontiguousarray(tokens, dtype=np.int32)
        ps = np.ascontiguousarray(pos, dtype=np.int32)
        sq = np.ascontiguousarray(seq, dtype=np.int32)
        li = np.ascontiguousarray(logit_idx, dtype=np.int32)
        logits = np.empty((len(li), self.hparams.n_vocab), dtype=np.float32)
        b = ffi.new("st_batch *")
        b.n_tokens = n
        b.tokens, b.pos, b.seq = ptr(tok, "int32_t *"), ptr(ps, "int32_t *"), ptr(sq, "int32_t *")
        b.n_seqs, b.max_blocks = len(block_tables), max_blocks
        b.block_tables = ptr(bt, "int32_t *")
        b.n_logits = len(li)
        b.logit_idx = ptr(li, "int32_t *") if len(li) else ffi.NULL
        b.logits = ptr(logits, "float *") if len(li) else ffi.NULL
        if expert_hist is not None:
            if expert_hist.dtype != np.int32 or expert_hist.shape != (self.hparams.n_layer, self.hparams.n_expert):
                raise ValueError("expert_hist must be int32 [n_layer, n_expert]")
            b.expert_hist = ptr(expert_hist, "int32_t *")
        else:
            b.expert_hist = ffi.NULL
        st = ffi.new("st_step_stats *")
        with self._step_lock:  # one step at a time: the model's scratch and the pool are shared
            check(lib.st_forward(self._model, self._kv, self._pool, b, st), "forward")
        self.last_stats = StepStats(int(st.n_tokens), st.t_total, st.t_attn, st.t_experts, st.t_dense,
                                    st.t_output, int(st.n_expert_tokens), int(st.n_active_experts))
        return logits

    def extend(self, slot: SeqSlot, token_ids: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens to one sequence (chunked); logits of the last token or of all."""
        if not token_ids:
            raise ValueError("no tokens to process")
        total = slot.n_tokens + len(token_ids)
        if total > self.kv_tokens:
            raise KVCapacityError(
                f"sequence of {total} tokens exceeds the KV cache capacity of {self.kv_tokens} tokens"
            )
        self.reserve(slot, total)
        outs = []
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = list(token_ids[start : start + self.prefill_chunk])
            pos = list(range(slot.n_tokens, slot.n_tokens + len(chunk)))
            want = list(range(len(chunk))) if all_logits else (
                [len(chunk) - 1] if start + len(chunk) == len(token_ids) else [])
            out = self.forward(chunk, pos, [0] * len(chunk), [slot.blocks], want)
            slot.n_tokens += len(chunk)
            if len(want):
                outs.append(out)
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def logits_for(self, token_ids: Sequence[int]) -> np.ndarray:
        """Logits at every position of a fresh sequence: [T, n_vocab]."""
        slot = self.new_slot()
        try:
            return self.extend(slot, token_ids, all_logits=True)
        finally:
            self.free_slot(slot)

    # ------------------------------------------------------------ generation
    def stream_tokens(self, prompt_ids: Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                      top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                      stop_ids: set[int] | None = None) -> Iterator[int]:
        """Yield generated token ids for one sequence (greedy when temperature == 0)."""
        from engine.sampling import sample_one

        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if len(prompt_ids) + 1 > self.kv_tokens:
            raise KVCapacityError(
                f"prompt of {len(prompt_ids)} tokens does not fit the KV cache ({self.kv_tokens} tokens)"
            )
        rng = np.random.default_rng(seed)
        stops = stop_ids if stop_ids is not None else self._default_stops()
        slot = self.new_slot()
        try:
            logits = self.extend(slot, prompt_ids)
            for _ in range(max_tokens):
                tok = sample_one(logits, temperature=temperature, top_k=top_k, top_p=top_p, rng=rng)
                yield tok
                if tok in stops or slot.n_tokens + 1 > self.kv_tokens:
                    return
                logits = self.extend(slot, [tok])
        finally:
            self.free_slot(slot)

    def _default_stops(self) -> set[int]:
        try:
            return set(self.tokenizer.eot_ids)
        except Exception:  # a model without tokenizer metadata: no stop tokens
            return set()

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> GenerationResult:
        """Generate from a text prompt or token ids (no chat template applied)."""
        ids = self.tokenizer.encode(prompt, add_special=True, parse_special=True) if isinstance(prompt, str) \
            else list(prompt)
        stops = self._default_stops()
        out: list[int] = []
        for tok in self.stream_tokens(ids, max_tokens, temperature, top_k, top_p, seed, stops):
            out.append(tok)
        finish = "stop" if out and out[-1] in stops else "length"
        gen = out[:-1] if finish == "stop" else out
        text = self.tokenizer.decode(gen) if self.has_tokenizer else ""
        return GenerationResult(token_ids=gen, text=text, finish_reason=finish, prompt_tokens=len(ids))

    def chat(self, messages: list[dict[str, Any]], max_tokens: int = 256, **kw: Any) -> GenerationResult:
        return self.generate(self.render_chat(messages), max_tokens=max_tokens, **kw)

    @property
    def has_tokenizer(self) -> bool:
        return "tokenizer.ggml.tokens" in self.model_file.metadata

    @property
    def model_path(self) -> Path:
        return self.model_file.path
