"""Tokenizer built from GGUF metadata, matching llama.cpp's tokenisation of the same file.

The heavy lifting (regex pre-splitting, BPE merges, special-token matching) is done by the HF
``tokenizers`` library; this module translates llama.cpp's rules for a GGUF vocabulary into a
``tokenizers`` pipeline:

* ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE): the regex list llama.cpp uses for the
  file's ``tokenizer.ggml.pre`` becomes a sequence of ``Split(..., "isolated")`` pre-tokenizers
  (llama.cpp applies each regex to the pieces the previous one produced, keeping unmatched text as
  pieces of its own), then GPT-2 byte-to-unicode mapping, then BPE over ``tokenizer.ggml.merges``.
* ``tokenizer.ggml.model == "llama"`` (SentencePiece vocab): llama.cpp merges adjacent symbols
  greedily by the *score* of the merged token, falling back to ``<0xXX>`` byte tokens. That is BPE
  whose merge ranks are the score order, so merges are derived from the scores.
* Special tokens: llama.cpp pulls control, user-defined and unknown tokens out of the text before
  the regexes run (user-defined ones even when ``parse_special`` is false); they become
  ``tokenizers`` added tokens, ``special=True`` for control/unknown.

Decoding does not go through ``tokenizers``: each id's bytes come from a precomputed table that
follows llama.cpp's ``token_to_piece`` (byte-level or ``▁``-unescaped text for normal tokens, raw
text for special ones, one byte for ``<0xXX>``), so streaming can work on exact bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """The GGUF vocabulary cannot be turned into a tokenizer (unsupported or malformed)."""


# GGUF token types (llama.cpp's LLAMA_TOKEN_TYPE_*).
TT_NORMAL = 1
TT_UNKNOWN = 2
TT_CONTROL = 3
TT_USER_DEFINED = 4
TT_UNUSED = 5
TT_BYTE = 6

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes, per tokenizer.ggml.pre, as llama.cpp (src/llama-vocab.cpp) defines them.
# Each list is applied in order, every regex splitting the pieces left by the previous one.
# ---------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's case-insensitive contractions spelt without (?i:) so every regex engine agrees.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Regexes without \p{..} run through std::wregex in llama.cpp, on text whose non-ASCII whitespace
# was first replaced by U+000B; so a literal class such as [\u0800-\u4e00] never matches U+2028 or
# U+3000 there. _ws_free() subtracts those characters from such classes to reproduce that.
_NON_ASCII_WS = "\u0085\u00a0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _ws_free(cls_body: str) -> str:
    return f"[{cls_body}&&[^{_NON_ASCII_WS}]]"


# Non-ASCII characters are written as escapes: editors and tools may NFC-normalise literal text,
# which turns e.g. U+1F7D into U+03CE and silently breaks a range.
_DEEPSEEK_LLM = (
    "[\r\n]",
    "\\s?"
    + _ws_free(
        "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
        "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
        "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
        "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
        "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
        "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
        "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
        "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
        "\U0001e900-\U0001e943"
    )
    + "+",
    "\\s?" + _ws_free("!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002") + "+",
    # The earlier [\r\n] split leaves no newline inside a piece, so Onig's line-end `$` is the
    # piece end here, as std::regex's `$` is in llama.cpp.
    "\\s+$",
    _ws_free("\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff") + "+",
    "\\p{N}+",
)
_DEEPSEEK3_LLM = (
    "\\p{N}{1,3}",
    _ws_free("\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff") + "+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
)
_DEEPSEEK_CODER = (
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    _ws_free("\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff") + "+",
    "\\p{N}",
)
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _PreSpec:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a pre-token that is itself in the vocab is emitted whole
    add_bos: bool = False  # llama.cpp's default when the GGUF has no add_bos_token key
    default_bos: bool = True  # without a bos_token_id key the BPE default id (11) is BOS; False: no BOS


_PRE_SPECS: dict[str, _PreSpec] = {}


def _register(names: Iterable[str], spec: _PreSpec) -> None:
    for name in names:
        _PRE_SPECS[name] = spec


_register(["default"], _PreSpec(_DEFAULT))
# "gpt2" is not a llama.cpp spelling (it uses "gpt-2"); accepted as an alias of the same rules.
_register(["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion"], _PreSpec((_GPT2,)))
_register(
    ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
    _PreSpec((r"\p{N}", _GPT2)),
)
_register(
    ["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan"],
    _PreSpec((_QWEN2,)),
)
_register(
    ["llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"],
    _PreSpec((_LLAMA3,), ignore_merges=True, add_bos=True),
)
_register(["dbrx", "smaug-bpe"], _PreSpec((_LLAMA3,)))
# GLM-4 / GLM-4.5: the same regex as Llama 3 (cl100k's), merges always applied, and no BOS unless the
# file names one (its prompts start with the template's "[gMASK]<sop>").
_register(["glm4", "chatglm-bpe"], _PreSpec((_LLAMA3,), default_bos=False))
# o200k (gpt-4o, gpt-oss, Llama 4): cased-word splits with optional contractions, digits in threes,
# punctuation runs that keep trailing newlines and slashes.
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_register(["gpt-4o", "llama4"], _PreSpec((_GPT4O,)))
_register(["deepseek-llm"], _PreSpec(_DEEPSEEK_LLM))
_register(["deepseek-v3"], _PreSpec(_DEEPSEEK3_LLM))
_register(["deepseek-coder"], _PreSpec(_DEEPSEEK_CODER))

SUPPORTED_PRE = frozenset(_PRE_SPECS)

# Token texts llama.cpp treats as end-of-generation and forces to control type
# (llama-vocab.cpp, "special_eog_ids").
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
        "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
        "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
        "<｜end▁of▁sentence｜>", "[e~[",
    }
)  # fmt: skip
# FIM pad / repo / sep markers, which llama.cpp also stops on unless the GGUF names them by id.
_FIM_EOG_TEXTS: dict[str, frozenset[str]] = {
    "tokenizer.ggml.fim_pad_token_id": frozenset({"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"}),
    "tokenizer.ggml.fim_rep_token_id": frozenset(
        {"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"}
    ),
    "tokenizer.ggml.fim_sep_token_id": frozenset({"<|file_sep|>"}),
}
_FIM_OTHER_TEXTS = frozenset(
    {
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
        "<|code_prefix|>", "<|prefix|>",
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
        "<|code_suffix|>", "<|suffix|>",
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
        "<|code_middle|>", "<|middle|>",
    }
)  # fmt: skip
# gpt-oss markers llama.cpp always renders, even when special tokens are skipped.
_FORCED_USER_DEFINED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})

_SPM_SPACE = "\u2581"  # "▁", SentencePiece's visible space


def _gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes are shifted to U+0100 onwards in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_GPT2_U2B = _gpt2_unicode_to_byte()
# str.translate table that turns byte-level text into latin-1 text with the same byte values.
_GPT2_TRANSLATE = {ord(ch): b for ch, b in _GPT2_U2B.items()}


def _byte_level_decode(text: str) -> bytes:
    try:
        return text.translate(_GPT2_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        # A character outside the byte alphabet (a malformed vocab entry): keep it as UTF-8
        # rather than fail; llama.cpp emits an "[UNK_BYTE_...]" marker there instead.
        return b"".join(bytes([_GPT2_U2B[ch]]) if ch in _GPT2_U2B else ch.encode("utf-8") for ch in text)


def _parse_byte_token(text: str) -> int | None:
    """The byte value of a ``<0xXX>`` token, or None."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _opt_id(md: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    value = md.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None


class Tokenizer:
    """GGUF vocabulary → token ids and back, with llama.cpp's semantics (see module docstring)."""

    def __init__(self, md: Mapping[str, Any]) -> None:
        model = md.get("tokenizer.ggml.model")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(model, str):
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model")
        if not isinstance(tokens, Sequence) or not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        # llama.cpp reads token texts as C strings (cut at a NUL) and renames empty ones so the
        # text -> id map stays one-to-one; do the same so both see the same vocabulary.
        self._tokens: list[str] = [t.partition("\x00")[0] or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        raw_types = md.get("tokenizer.ggml.token_type")
        if raw_types is not None and len(raw_types) < n:
            raise TokenizerError(f"tokenizer.ggml.token_type has {len(raw_types)} entries for {n} tokens")
        types = [int(t) for t in raw_types[:n]] if raw_types is not None else [TT_NORMAL] * n
        self._model = model
        self._pre = str(md.get("tokenizer.ggml.pre") or "")
        # Later duplicates win, as in llama.cpp's token_to_id map.
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(self._tokens)}

        if model == "gpt2":
            spec = self._pre_spec()
            default_add_bos = spec.add_bos
            default_bos, default_eos = 11, 11  # llama.cpp's defaults for BPE vocabularies
        elif model == "llama":
            spec = None
            default_add_bos = True
            default_bos, default_eos = 1, 2
        else:
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r} (supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
            )

        self._bos_id = _opt_id(md, "tokenizer.ggml.bos_token_id", n)
        self._eos_id = _opt_id(md, "tokenizer.ggml.eos_token_id", n)
        if "tokenizer.ggml.bos_token_id" not in md and default_bos < n and (spec is None or spec.default_bos):
            self._bos_id = default_bos
        if "tokenizer.ggml.eos_token_id" not in md and default_eos < n:
            self._eos_id = default_eos
        self._unk_id = _opt_id(md, "tokenizer.ggml.unknown_token_id", n)
        self._add_bos = bool(md.get("tokenizer.ggml.add_bos_token", default_add_bos))
        self._add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
        # llama.cpp always prefixes a space for SentencePiece vocabularies unless the file says not.
        self._add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", model == "llama"))

        self._eog_ids = self._promote_and_collect_eog(md, types)
        self._types = types

        self._pieces = [self._piece_bytes(i) for i in range(n)]
        self._special_mask = [t in (TT_CONTROL, TT_UNKNOWN) for t in types]

        self._spec = spec
        self._scores = md.get("tokenizer.ggml.scores")
        self._merges = md.get("tokenizer.ggml.merges")
        if model == "gpt2" and not self._merges:
            raise TokenizerError("byte-level BPE vocabulary has no tokenizer.ggml.merges")
        self._hf = self._build_hf(parse_special=True)
        self._hf_plain: HFTokenizer | None = None  # built on first parse_special=False call
        self._lock = threading.Lock()

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from ``{key: field.contents()}`` of a ``gguf.GGUFReader``."""
        return cls(md)

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read only the tokenizer keys of a GGUF file and build the tokenizer."""
        return cls(read_tokenizer_metadata(path))

    def _pre_spec(self) -> _PreSpec:
        if not self._pre:
            # llama.cpp does the same, with a loud warning: old conversions lack the key.
            log.warning("GGUF has no tokenizer.ggml.pre; using llama.cpp's 'default' pre-tokenizer")
            return _PRE_SPECS["default"]
        spec = _PRE_SPECS.get(self._pre)
        if spec is None:
            raise TokenizerError(
                f"unknown pre-tokenizer tokenizer.ggml.pre={self._pre!r}; supported: {', '.join(sorted(SUPPORTED_PRE))}"
            )
        return spec

    def _promote_and_collect_eog(self, md: Mapping[str, Any], types: list[int]) -> frozenset[int]:
        """Apply llama.cpp's text-based fix-ups of token types and collect end-of-generation ids."""
        n = len(self._tokens)
        eog: set[int] = {
            i for i in (self._eos_id, _opt_id(md, "tokenizer.ggml.eot_token_id", n)) if i is not None
        }
        eom_id = _opt_id(md, "tokenizer.ggml.eom_token_id", n)
        if eom_id is not None:
            eog.add(eom_id)
        fim_texts: set[str] = set()
        for key, texts in _FIM_EOG_TEXTS.items():
            fim_id = _opt_id(md, key, n)
            if fim_id is not None:
                eog.add(fim_id)
            else:
                # llama.cpp takes the first match in hash-map order; all matches is the
                # deterministic superset (vocabularies rarely hold two).
                fim_texts |= texts
        for text, i in self._token_to_id.items():
            if text in _EOG_TEXTS or text in fim_texts:
                eog.add(i)
                types[i] = TT_CONTROL  # llama.cpp forces these to control type
            elif text in _FIM_OTHER_TEXTS:
                types[i] = TT_CONTROL
            if text in _FORCED_USER_DEFINED:
                types[i] = TT_USER_DEFINED
        # o200k_harmony / solar-open: "<|end|>" ends a message there, not the generation.
        eog_texts = {self._tokens[i] for i in eog}
        end_id = self._token_to_id.get("<|end|>")
        if (
            end_id is not None
            and end_id in eog
            and ({"<|return|>", "<|call|>"} <= eog_texts or {"<|calls|>", "<|flush|>"} <= eog_texts)
        ):
            eog.discard(end_id)
            types[end_id] = TT_USER_DEFINED
        return frozenset(eog)

    def _piece_bytes(self, i: int) -> bytes:
        """What llama.cpp's token_to_piece(special=True) gives for token i."""
        text, ttype = self._tokens[i], self._types[i]
        if ttype in (TT_CONTROL, TT_UNKNOWN, TT_USER_DEFINED):
            return text.encode("utf-8")
        if ttype == TT_NORMAL:
            if self._model == "llama":
                return text.replace(_SPM_SPACE, " ").encode("utf-8")
            return _byte_level_decode(text)
        if ttype == TT_BYTE:
            b = _parse_byte_token(text)
            return bytes([b]) if b is not None else b""
        return b""  # unused / undefined types render as nothing

    def _build_hf(self, parse_special: bool) -> HFTokenizer:
        if self._model == "gpt2":
            assert self._spec is not None
            hf = self._build_bpe(self._spec)
        else:
            hf = self._build_spm()
        added: list[AddedToken] = []
        for i, (text, ttype) in enumerate(zip(self._tokens, self._types, strict=True)):
            if self._token_to_id[text] != i:
                continue  # shadowed duplicate; llama.cpp matches the text to the last id
            if ttype == TT_USER_DEFINED:
                added.append(AddedToken(text, special=False, normalized=False))
            elif parse_special and ttype in (TT_CONTROL, TT_UNKNOWN):
                added.append(AddedToken(text, special=True, normalized=False))
        if added:
            hf.add_tokens(added)
        return hf

    def _build_bpe(self, spec: _PreSpec) -> HFTokenizer:
        vocab = self._token_to_id
        merges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for m in self._merges or ():
            # llama.cpp splits at the first space after the first character.
            cut = m.find(" ", 1)
            if cut < 0:
                continue
            a, b = m[:cut], m[cut + 1 :]
            # tokenizers rejects merges whose parts or result are not tokens (llama.cpp would
            # fall back to bytes for such a result anyway); a repeated merge keeps its first,
            # best rank, as llama.cpp's map insert does.
            if (a, b) not in seen and a in vocab and b in vocab and a + b in vocab:
                seen.add((a, b))
                merges.append((a, b))
        model = BPE(vocab=vocab, merges=merges, ignore_merges=spec.ignore_merges, byte_fallback=False)
        hf = HFTokenizer(model)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in spec.regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        return hf

    def _build_spm(self) -> HFTokenizer:
        scores = self._scores
        n = len(self._tokens)
        if scores is None or len(scores) < n:
            raise TokenizerError("SentencePiece vocabulary needs tokenizer.ggml.scores for every token")
        vocab = self._token_to_id
        # llama.cpp merges the adjacent pair whose concatenation is the highest-scoring token;
        # as BPE that is every (left, right) split of a token, ranked by that token's score.
        # Ties between different tokens of equal score are ordered by id (llama.cpp takes the
        # leftmost pair instead) - a rare divergence for vocabularies with repeated scores.
        candidates: list[tuple[float, int, str, str]] = []
        for text, i in vocab.items():
            if len(text) < 2 or self._types[i] == TT_BYTE:
                continue
            s = float(scores[i])
            for cut in range(1, len(text)):
                left, right = text[:cut], text[cut:]
                if left in vocab and right in vocab:
                    candidates.append((-s, i, left, right))
        candidates.sort(key=lambda c: (c[0], c[1]))
        merges = [(left, right) for _, _, left, right in candidates]
        unk = self._tokens[self._unk_id] if self._unk_id is not None else None
        model = BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True, fuse_unk=False)
        hf = HFTokenizer(model)
        steps: list[normalizers.Normalizer] = []
        if self._add_space_prefix:
            # llama.cpp prefixes a space to every text fragment that starts the input or follows
            # a special token - i.e. to every fragment, which is what Prepend does per segment.
            steps.append(normalizers.Prepend(_SPM_SPACE))
        steps.append(normalizers.Replace(" ", _SPM_SPACE))
        hf.normalizer = normalizers.Sequence(steps)
        return hf

    def _plain(self) -> HFTokenizer:
        with self._lock:
            if self._hf_plain is None:
                self._hf_plain = self._build_hf(parse_special=False)
            return self._hf_plain

    # -- public API -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eot_ids(self) -> frozenset[int]:
        """Ids that end a turn/generation (llama.cpp's EOG set: eos, eot, eom, <|im_end|>, ...)."""
        return self._eog_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def model(self) -> str:
        return self._model

    @property
    def pre(self) -> str:
        return self._pre

    def is_eog(self, token_id: int) -> bool:
        return token_id in self._eog_ids

    def token_to_id(self, text: str) -> int | None:
        """Id of the token whose vocabulary text is exactly ``text``, or None."""
        return self._token_to_id.get(text)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary text of a token (byte-level / ``▁`` form, not decoded)."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control or unknown token: hidden by ``decode(skip_special=True)``."""
        self._check_id(token_id)
        return self._special_mask[token_id]

    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` as ``llama_tokenize(text, add_special, parse_special)`` gives them.

        ``add_special`` adds BOS (and EOS) only where the GGUF asks for it; ``parse_special``
        lets control tokens such as ``<|im_start|>`` written in the text become their ids.
        """
        hf = self._hf if parse_special else self._plain()
        ids: list[int] = hf.encode(text, add_special_tokens=False).ids if text else []
        if add_special:
            if self._add_bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if self._add_eos and self._eos_id is not None:
                ids.append(self._eos_id)
        return ids

    def encode_batch(
        self, texts: Sequence[str], add_special: bool = True, parse_special: bool = True
    ) -> list[list[int]]:
        """``encode`` for many texts; ``tokenizers`` spreads the work over threads."""
        hf = self._hf if parse_special else self._plain()
        encs = hf.encode_batch(list(texts), add_special_tokens=False)
        out: list[list[int]] = []
        for text, enc in zip(texts, encs, strict=True):
            ids = list(enc.ids) if text else []
            if add_special:
                if self._add_bos and self._bos_id is not None:
                    ids.insert(0, self._bos_id)
                if self._add_eos and self._eos_id is not None:
                    ids.append(self._eos_id)
            out.append(ids)
        return out

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes token ``token_id`` contributes to the text (special tokens: their text).

        A multi-byte character may be split across tokens, so streaming must join bytes before
        decoding UTF-8.
        """
        self._check_id(token_id)
        return self._pieces[token_id]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        """Concatenated ``token_bytes``; with ``skip_special`` control/unknown tokens add nothing
        (llama.cpp's ``token_to_piece(special=False)``)."""
        pieces = self._pieces
        n = len(pieces)
        out: list[bytes] = []
        for i in ids:
            if not 0 <= i < n:
                raise TokenizerError(f"token id {i} out of range [0, {n})")
            if skip_special and self._special_mask[i]:
                continue
            out.append(pieces[i])
        return b"".join(out)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 (a cut character) become U+FFFD.

        This is the plain concatenation of token pieces, as llama-cpp-python's ``detokenize``
        and llama-server's streaming produce it: no ``clean_up_tokenization_spaces`` pass, and
        for SentencePiece vocabularies the space prefixed at encode time stays in the text.
        """
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._tokens):
            raise TokenizerError(f"token id {token_id} out of range [0, {len(self._tokens)})")

    def __repr__(self) -> str:
        return f"Tokenizer(model={self._model!r}, pre={self._pre!r}, vocab_size={self.vocab_size})"


def read_tokenizer_metadata(path: str | Path) -> dict[str, Any]:
    """The ``tokenizer.*`` keys of a GGUF file as ``{key: field.contents()}`` of gguf-py's reader.

    Read by common/gguf_meta.py (the engine's walk: 0.3 s for a 49k-token vocabulary, gguf-py's reader 5 s).
    """
    from common.gguf_meta import GGUFError, read_metadata  # local: numpy, not needed by callers with metadata

    try:
        md = read_metadata(path)
    except (OSError, GGUFError) as e:
        raise TokenizerError(f"cannot read GGUF {path}: {e}") from e
    return {k: v for k, v in md.items() if k.startswith("tokenizer.")}
