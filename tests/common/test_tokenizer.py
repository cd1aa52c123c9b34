"""common.tokenizer against llama.cpp (llama-cpp-python, vocab-only) on the same GGUF files.

The default SmolLM2 GGUF is checked directly. The other pre-tokenizers and the SentencePiece
path are checked on GGUFs written here: SmolLM2's vocabulary with another ``tokenizer.ggml.pre``
(the token ids then differ per regex set, and llama.cpp decides which are right), and a
SentencePiece-style vocabulary derived from it.
"""

from __future__ import annotations

import ctypes
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest

from common.tokenizer import SUPPORTED_PRE, Tokenizer, TokenizerError

CORPUS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！今天天气很好。",
    "こんにちは、カタカナ と ひらがな",
    "한국어 텍스트",
    "Ελληνικά και русский текст, العربية, हिन्दी",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    '{"key": [1, 2.5, null], "s": "a\\"b"}',
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "   leading spaces",
    " one leading space",
    "trailing spaces   ",
    "runs     of      spaces",
    "\n\n\nnewlines\n\n\n",
    "mixed \r\n line \r endings \n\r",
    "tabs\t\tand\u00a0nbsp\u3000ideographic\u2028sep",
    "digits 1234567890 12 3 4567",
    "don't I'll we've they're she's I'm he'd",
    "DON'T I'LL 'S 'tis rock 'n' roll",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|><|endoftext|>",
    "<|im_start <|im_end| |im_start|> partial markers",
    "<repo_name>strata<file_sep>common/tokenizer.py",
    "<s>hi</s><unk> <0x41>",
    "unicode numbers ٣٤٥ ² Ⅻ ½",
    "combining e\u0301 and zwj a\u200db",
    "control \x00\x01\x1f chars",
    "$+<=>^`|~ symbols ¡¿ «»",
    "",
    " ",
    "\n",
    "a",
]

_POOL = list(
    "abcdefghij ABCXYZ\n\r\t  0123456789'’.,!?-_()<>|$+^~`/你好世界こんにちはカタカナ한국어🙂éüßÅ"
    "\u00a0\u3000\u2028\u2029\u2003\u0085\x0b\x0c٣²Ⅻ\u0301\u200d\u1f7d\u03ceΩ。，、！"
) + ["'s", "'LL", "'ve", " '", "\r\n", "    ", "<|im_start|>", "<|im_end|>", "  \n", "12345", "\u3000\u3000"]


def _fuzz_corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def smollm_tok(smollm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(smollm_metadata)


def _oracle(llama: Any, text: str, add_bos: bool = False, special: bool = True) -> list[int]:
    return llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)


def _llama_piece(llama: Any, token_id: int, special: bool) -> bytes:
    import llama_cpp

    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(llama._model.vocab, token_id, buf, len(buf), 0, special)
    assert 0 <= n <= len(buf)
    return buf.raw[:n]


# -- the default model ----------------------------------------------------------------------------


@pytest.mark.parametrize("parse_special", [True, False])
@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_llama_cpp(
    smollm_tok: Tokenizer, smollm_llama: Any, text: str, parse_special: bool
) -> None:
    ours = smollm_tok.encode(text, add_special=False, parse_special=parse_special)
    assert ours == _oracle(smollm_llama, text, special=parse_special)


def test_encode_fuzz_matches_llama_cpp(smollm_tok: Tokenizer, smollm_llama: Any) -> None:
    for text in _fuzz_corpus(400, seed=7):
        for parse_special in (True, False):
            ours = smollm_tok.encode(text, add_special=False, parse_special=parse_special)
            assert ours == _oracle(smollm_llama, text, special=parse_special), (text, parse_special)


def test_add_special_follows_gguf(
    smollm_tok: Tokenizer, smollm_llama: Any, smollm_metadata: dict[str, Any]
) -> None:
    # SmolLM2 says add_bos_token = false: add_special adds nothing, exactly like llama.cpp.
    assert smollm_metadata["tokenizer.ggml.add_bos_token"] is False
    text = "Hello there"
    assert smollm_tok.encode(text, add_special=True) == _oracle(smollm_llama, text, add_bos=True)
    assert smollm_tok.encode(text, add_special=True) == smollm_tok.encode(text, add_special=False)


def test_encode_batch_equals_encode(smollm_tok: Tokenizer) -> None:
    texts = CORPUS[:12]
    assert smollm_tok.encode_batch(texts) == [smollm_tok.encode(t) for t in texts]


def test_token_pieces_match_llama_cpp(smollm_tok: Tokenizer, smollm_llama: Any) -> None:
    for i in range(smollm_tok.vocab_size):
        assert smollm_tok.token_bytes(i) == _llama_piece(smollm_llama, i, special=True), i
        assert smollm_tok.decode_bytes([i], skip_special=True) == _llama_piece(
            smollm_llama, i, special=False
        ), i


@pytest.mark.parametrize("text", CORPUS)
def test_decode_round_trip(smollm_tok: Tokenizer, smollm_llama: Any, text: str) -> None:
    ids = smollm_tok.encode(text, add_special=False)
    assert smollm_tok.decode_bytes(ids) == smollm_llama.detokenize(ids, special=True)
    assert smollm_tok.decode_bytes(ids, skip_special=True) == smollm_llama.detokenize(ids, special=False)
    assert smollm_tok.decode(ids) == text  # byte-level BPE is lossless


def test_decode_cut_utf8_is_replaced_not_raised(smollm_tok: Tokenizer) -> None:
    ids = smollm_tok.encode("🙂")
    assert len(ids) > 1  # the emoji is split over byte tokens
    assert b"".join(smollm_tok.token_bytes(i) for i in ids) == "🙂".encode()
    assert smollm_tok.decode(ids[:1]) == "\ufffd"


def test_special_ids_match_llama_cpp(smollm_tok: Tokenizer, smollm_llama: Any) -> None:
    import llama_cpp

    vocab = smollm_llama._model.vocab
    assert smollm_tok.vocab_size == smollm_llama.n_vocab() == 49152
    assert smollm_tok.bos_id == smollm_llama.token_bos() == 1
    assert smollm_tok.eos_id == smollm_llama.token_eos() == 2
    eog = {i for i in range(smollm_tok.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert smollm_tok.eot_ids == eog
    assert {
        smollm_tok.token_to_id("<|im_end|>"),
        smollm_tok.token_to_id("<|endoftext|>"),
    } <= smollm_tok.eot_ids
    assert smollm_tok.is_eog(2) and not smollm_tok.is_eog(1)


def test_token_lookup(smollm_tok: Tokenizer) -> None:
    assert smollm_tok.token_to_id("<|im_start|>") == 1
    assert smollm_tok.token_to_id("no such token") is None
    assert smollm_tok.id_to_token(1) == "<|im_start|>"
    assert smollm_tok.is_special(1) and not smollm_tok.is_special(100)
    with pytest.raises(TokenizerError):
        smollm_tok.token_bytes(smollm_tok.vocab_size)
    with pytest.raises(TokenizerError):
        smollm_tok.decode([0, -1])


def test_from_gguf_equals_from_metadata(smollm_gguf_path: Path, smollm_tok: Tokenizer, tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(smollm_gguf_path)
    for text in CORPUS:
        assert tok.encode(text) == smollm_tok.encode(text)
    with smollm_gguf_path.open("rb") as f:
        head = f.read(4096)  # cut inside the vocabulary
    for name, data in (("not.gguf", b"this is not a gguf file"), ("cut.gguf", head)):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(TokenizerError, match="cannot read GGUF"):  # typed, whatever the damage
            Tokenizer.from_gguf(tmp_path / name)
    with pytest.raises(TokenizerError, match="cannot read GGUF"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_encode_is_fast(smollm_tok: Tokenizer) -> None:
    text = " ".join(CORPUS) * 200  # ~200 KB of mixed text
    t0 = time.perf_counter()
    ids = smollm_tok.encode(text)
    elapsed = time.perf_counter() - t0
    assert len(ids) > 10_000
    assert elapsed < 5.0, f"encoding {len(text)} chars took {elapsed:.2f}s"


# -- other pre-tokenizers and SentencePiece, on GGUFs written here ---------------------------------


def _value_type(value: Any) -> tuple[gguf.GGUFValueType, gguf.GGUFValueType | None]:
    V = gguf.GGUFValueType
    scalar = {bool: V.BOOL, int: V.UINT32, float: V.FLOAT32, str: V.STRING}
    if isinstance(value, list):
        return V.ARRAY, {str: V.STRING, int: V.INT32, float: V.FLOAT32}[type(value[0])]
    return scalar[type(value)], None


def _write_gguf(path: Path, md: dict[str, Any]) -> None:
    """A tensor-less GGUF with metadata ``md``: enough for llama.cpp's vocab-only load."""
    writer = gguf.GGUFWriter(str(path), arch=md["general.architecture"])
    for key, value in md.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        writer.add_key_value(key, value, *_value_type(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_variant(
    smollm_metadata: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
    llama_vocab_loader: Callable[..., Any],
) -> Callable[[str, dict[str, Any]], tuple[Tokenizer, Any]]:
    """``(name, overrides) -> (our tokenizer, llama.cpp oracle)`` for SmolLM2 metadata with
    ``overrides`` applied (a None value drops the key)."""
    root = tmp_path_factory.mktemp("gguf_variants")

    def make(name: str, overrides: dict[str, Any]) -> tuple[Tokenizer, Any]:
        md = {k: v for k, v in smollm_metadata.items() if k not in overrides}
        md.update({k: v for k, v in overrides.items() if v is not None})
        path = root / f"{name}.gguf"
        _write_gguf(path, md)
        return Tokenizer.from_metadata(md), llama_vocab_loader(path)

    return make


@pytest.mark.parametrize(
    "pre",
    ["qwen2", "llama-bpe", "deepseek-llm", "deepseek-v3", "deepseek-coder", "gpt-2", "default", "starcoder"],
)
def test_pre_tokenizers_match_llama_cpp(gguf_variant: Callable[..., tuple[Tokenizer, Any]], pre: str) -> None:
    tok, llama = gguf_variant(pre, {"tokenizer.ggml.pre": pre})
    for text in CORPUS + _fuzz_corpus(250, seed=sum(map(ord, pre))):
        assert tok.encode(text, add_special=False) == _oracle(llama, text), (pre, text)


def test_llama3_adds_bos_by_default(gguf_variant: Callable[..., tuple[Tokenizer, Any]]) -> None:
    # llama-bpe defaults add_bos to true when the GGUF is silent about it.
    tok, llama = gguf_variant(
        "llama-bpe-bos", {"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": None}
    )
    text = "Hi there"
    assert tok.add_bos
    assert tok.encode(text) == _oracle(llama, text, add_bos=True)
    assert tok.encode(text)[0] == tok.bos_id


def _llama_eog(llama: Any, n_vocab: int) -> set[int]:
    import llama_cpp

    return {i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(llama._model.vocab, i)}


def test_eog_ids_named_in_metadata_match_llama_cpp(
    gguf_variant: Callable[..., tuple[Tokenizer, Any]],
) -> None:
    # An explicit FIM repo id replaces llama.cpp's text-based guess ("<reponame>", id 4).
    tok, llama = gguf_variant(
        "fim-ids", {"tokenizer.ggml.fim_rep_token_id": 3, "tokenizer.ggml.eot_token_id": 5}
    )
    assert tok.eot_ids == _llama_eog(llama, tok.vocab_size) == {0, 2, 3, 5}


def _spm_overrides(base: Tokenizer) -> dict[str, Any]:
    """A SentencePiece-style vocabulary built from SmolLM2's: control tokens, 256 byte tokens,
    then every decodable piece with spaces as "▁", scored by rank. Multi-character pieces are
    kept only if each of their characters is a piece too, as SentencePiece training guarantees."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, *([6] * 256), 3, 3]
    seen = set(tokens)
    pieces: list[str] = []
    for i in range(base.vocab_size):
        if base.is_special(i):
            continue
        try:
            text = base.token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace(" ", "\u2581")
        if text and text not in seen and "\x00" not in text:
            seen.add(text)
            pieces.append(text)
    chars = {p for p in pieces if len(p) == 1}
    for p in pieces:
        if all(c in chars for c in p):
            tokens.append(p)
            types.append(1)
    scores = [-float(i) if t == 1 else 0.0 for i, t in enumerate(types)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": None,
        "tokenizer.ggml.merges": None,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": True,
        "llama.vocab_size": len(tokens),
    }


def test_sentencepiece_matches_llama_cpp(
    gguf_variant: Callable[..., tuple[Tokenizer, Any]], smollm_tok: Tokenizer
) -> None:
    tok, llama = gguf_variant("spm", _spm_overrides(smollm_tok))
    assert tok.model == "llama" and tok.add_bos
    for text in CORPUS + _fuzz_corpus(250, seed=11):
        for parse_special in (True, False):
            ours = tok.encode(text, add_special=True, parse_special=parse_special)
            assert ours == _oracle(llama, text, add_bos=True, special=parse_special), (text, parse_special)
            assert tok.decode_bytes(ours) == llama.detokenize(ours, special=True)
    for i in range(tok.vocab_size):
        assert tok.token_bytes(i) == _llama_piece(llama, i, special=True), i


# -- errors ---------------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_a_typed_error(smollm_metadata: dict[str, Any]) -> None:
    md = dict(smollm_metadata, **{"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(TokenizerError, match="no-such-pre"):
        Tokenizer.from_metadata(md)
    assert issubclass(TokenizerError, ValueError)
    assert {
        "smollm",
        "gpt2",
        "default",
        "qwen2",
        "llama-bpe",
        "llama3",
        "deepseek-llm",
        "deepseek-v3",
    } <= SUPPORTED_PRE


def test_unsupported_model_and_missing_pieces(smollm_metadata: dict[str, Any]) -> None:
    with pytest.raises(TokenizerError, match="bert"):
        Tokenizer.from_metadata(dict(smollm_metadata, **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata({k: v for k, v in smollm_metadata.items() if k != "tokenizer.ggml.merges"})
    with pytest.raises(TokenizerError, match="tokens"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="scores"):
        Tokenizer.from_metadata(dict(smollm_metadata, **{"tokenizer.ggml.model": "llama"}))
