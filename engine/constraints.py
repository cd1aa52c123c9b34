"""Constrained decoding: grammars (JSON schema, JSON object, tool calls) as per-token masks.

The grammar engine is llguidance (chosen by measured mask time on the default model's 49k
vocabulary, see docs/engine.md "Sampling"). Its token trie is built once per tokenizer from
the model's own vocabulary (``Tokenizer.token_bytes``) and our own ``encode``, so the mask
speaks exactly the token ids the engine samples.

Lifecycle of one constrained request:

* the lane compiles the request's grammar (:func:`json_schema_grammar`, ...) and checks it
  with :meth:`GrammarCompiler.check` (a schema the library rejects is a 400 with its message);
* the scheduler makes a :class:`Constraint` (one ``LLMatcher``) when the request is added;
  it lives on the request, so preemption (recompute of the same tokens) leaves it valid and
  prefix caching, which only changes what is recomputed, never sees it;
* every step that samples the request: :meth:`Constraint.fill` writes the allowed-token
  bitmask (in a worker thread while the C forward step runs: both release the GIL), the
  mask is applied to that row's logits only, and :meth:`Constraint.consume` advances it.
"""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer

__all__ = ["Constraint", "GrammarCompiler", "GrammarError", "any_json_grammar", "apply_mask",
           "json_schema_grammar", "mask_words", "text_or_json_grammar"]


class GrammarError(ValueError):
    """The grammar (or JSON schema) cannot be compiled by the grammar library."""


def mask_words(n_vocab: int) -> int:
    """int32 words of one row's bitmask (one bit per token id)."""
    return (n_vocab + 31) // 32


def json_schema_grammar(schema: dict[str, Any] | bool) -> str:
    """llguidance grammar text for values valid under ``schema`` (whitespace kept compact)."""
    import llguidance

    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), overrides={"whitespace_flexible": False})  # type: ignore[arg-type]
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


# free text of a tool-enabled answer: not empty, and not starting with white space, "{" or "[" (the
# start of a call), so an answer that begins like a call must be a well-formed one
_FREE_TEXT = r"/[^{\[ \t\r\n](?s:.)*/"


def text_or_json_grammar(schema: dict[str, Any] | bool) -> str:
    """Either a JSON value valid under ``schema`` (compact) or free text that cannot be mistaken
    for its beginning (see ``_FREE_TEXT``): a chat answer under ``tool_choice: auto``."""
    import llguidance

    if not isinstance(schema, dict | bool):
        raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
    body = {**schema, "x-guidance": {"whitespace_flexible": False}} if isinstance(schema, dict) else schema
    lark = f"start: value | text\nvalue: %json {json.dumps(body)}\ntext: FREE\nFREE: {_FREE_TEXT}\n"
    try:
        return llguidance.LLMatcher.grammar_from_lark(lark)
    except ValueError as e:
        raise GrammarError(f"invalid JSON schema: {e}") from None


def any_json_grammar() -> str:
    """Any JSON object (``response_format: json_object``)."""
    return json_schema_grammar({"type": "object"})


class _VocabAdapter:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS/BOS, and a bytes -> ids encoder."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        eos = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        self.eos_token_id = eos[0] if eos else 0
        self.bos_token_id = tok.bos_id
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = [i for i in range(tok.vocab_size) if tok.is_special(i)]

    def __call__(self, s: bytes | str) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.encode(text, add_special=False, parse_special=False)


class GrammarCompiler:
    """One tokenizer's llguidance vocabulary (built once, ~0.5 s for 49k tokens) and grammar checks."""

    _cache: dict[int, GrammarCompiler] = {}
    _cache_lock = threading.Lock()

    def __init__(self, tok: Tokenizer) -> None:
        import llguidance

        self.tokenizer = tok
        self.n_vocab = tok.vocab_size
        eos = sorted(tok.eot_ids) or ([tok.eos_id] if tok.eos_id is not None else [])
        self.eos_ids = eos
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabAdapter(tok)),
                                         n_vocab=tok.vocab_size, eos_token=eos or None)

    @classmethod
    def for_tokenizer(cls, tok: Tokenizer) -> GrammarCompiler:
        """The shared compiler of ``tok`` (built on first use, thread-safe)."""
        with cls._cache_lock:
            c = cls._cache.get(id(tok))
            if c is None or c.tokenizer is not tok:
                c = cls(tok)
                cls._cache[id(tok)] = c
            return c

    def check(self, grammar: str) -> None:
        """Raise :class:`GrammarError` with the library's message if ``grammar`` does not compile."""
        import llguidance

        is_err, msgs = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.ll)
        if is_err:
            raise GrammarError(msgs[0] if msgs else "the grammar does not compile")

    def matcher(self, grammar: str) -> Constraint:
        return Constraint(self, grammar)


class Constraint:
    """One request's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        import llguidance

        self.compiler = compiler
        self.m = llguidance.LLMatcher(compiler.ll, grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(self.m.get_error())
        self.words = mask_words(compiler.n_vocab)

    def fill(self, out: np.ndarray) -> None:
        """Write the next-token bitmask into ``out`` (int32 [>= words], C-contiguous); drops the GIL.

        Words past the tokenizer's vocabulary (a model with padded logits) stay as they are."""
        if out.dtype != np.int32 or out.ndim != 1 or out.size < self.words or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask buffer must be C-contiguous int32 of >= {self.words} words")
        self.m.unsafe_compute_mask_ptr(out.ctypes.data, self.words * 4)

    def consume(self, token: int) -> bool:
        """Advance past ``token``; False if the grammar rejected it (the matcher is then in error)."""
        return bool(self.m.consume_token(int(token)))

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing but end-of-generation."""
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str | None:
        return self.m.get_error() if self.m.is_error() else None


def apply_mask(row: np.ndarray, bits: np.ndarray) -> int:
    """Set disallowed tokens of one logits row to -inf in place; returns how many stay allowed.

    ``bits`` is int32 [ceil(V/32)]: bit j of word w allows token 32*w + j. A mask that allows
    nothing leaves the row untouched (the caller ends that request instead of sampling it).
    """
    v = row.shape[0]
    # little-endian words: byte 4w + j//8, bit j%8 is token 32w + j
    allowed = np.unpackbits(bits.view(np.uint8), bitorder="little")[:v].view(bool)
    n = int(np.count_nonzero(allowed))
    if n:
        row[~allowed] = -np.inf
    return n
