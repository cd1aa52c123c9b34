"""engine.detokenizer: streaming UTF-8 and stop strings with the default model's tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from common.tokenizer import Tokenizer
from engine.detokenizer import DetokStep, IncrementalDetokenizer

TEXTS = [
    "你好，世界！今天天气很好。",
    "emoji 😀👍🏽 family 👨‍👩‍👧 and flags 🇯🇵 done",
    "Mixed: café naïve — 日本語のテキスト, 한국어, Ελληνικά 🎉",
]


@pytest.fixture(scope="module")
def tok(smollm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(smollm_metadata)


def _stream(tok: Tokenizer, ids: list[int], stop: list[str] | None = None,
            skip_special: bool = True) -> tuple[list[DetokStep], str, IncrementalDetokenizer]:
    d = IncrementalDetokenizer(tok, stop or [], skip_special=skip_special)
    steps = [d.push(i) for i in ids]
    tail = d.finish()
    return steps, tail, d


@pytest.mark.parametrize("text", TEXTS)
def test_multibyte_never_broken(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special=False)
    # The point of the test: some characters really are split across tokens here.
    assert any(_not_utf8(tok.token_bytes(i)) for i in ids)
    steps, tail, d = _stream(tok, ids)
    for s in steps:
        assert "\ufffd" not in s.delta
        assert not s.stopped
    assert tail == ""
    assert "".join(s.delta for s in steps) == text == tok.decode(ids) == d.text


def _not_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_incomplete_char_at_end_becomes_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀", add_special=False)
    assert _not_utf8(tok.token_bytes(ids[-1]))
    steps, tail, d = _stream(tok, ids[:-1])  # stream cut mid-character
    assert "".join(s.delta for s in steps) == "ok "  # the space is out, the 3 bytes held
    assert tail == "\ufffd"
    assert d.text == "ok \ufffd"


def test_stop_spanning_two_tokens_cut_exactly(tok: Tokenizer) -> None:
    text = "Hello world, the end. STOP here and more"
    ids = tok.encode(text, add_special=False)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b" ST" in pieces and b"OP" in pieces  # "STOP" really spans two tokens
    steps, tail, d = _stream(tok, ids, stop=["STOP"])
    out = "".join(s.delta for s in steps) + tail
    assert out == "Hello world, the end. "
    assert d.text == out and d.stopped and d.matched_stop == "STOP"
    stop_at = next(k for k, s in enumerate(steps) if s.stopped)
    assert tok.token_bytes(ids[stop_at]) == b"OP"
    assert all(s.stopped and s.delta == "" for s in steps[stop_at + 1:])
    assert tail == ""


def test_stop_inside_one_token_and_earliest_wins(tok: Tokenizer) -> None:
    text = "one two three four"
    ids = tok.encode(text, add_special=False)
    steps, tail, d = _stream(tok, ids, stop=["four", "wo t"])
    assert "".join(s.delta for s in steps) + tail == "one t"
    assert d.matched_stop == "wo t"


def test_partial_stop_held_then_released(tok: Tokenizer) -> None:
    text = "Hello world, the end. STOP here"
    ids = tok.encode(text, add_special=False)
    d = IncrementalDetokenizer(tok, ["STOPPED"])
    deltas = []
    held_seen = False
    for i in ids:
        step = d.push(i)
        deltas.append(step.delta)
        assert not step.stopped
        if tok.token_bytes(i) == b" ST":
            assert not step.delta.endswith("ST")  # "ST" could begin "STOPPED": held back
            held_seen = True
        if tok.token_bytes(i) == b"OP":
            assert step.delta == ""  # "STOP" is still a prefix of "STOPPED"
    assert held_seen
    assert "".join(deltas) == text  # " here" disambiguated: the held "STOP" came out
    assert d.finish() == ""
    assert d.text == text and not d.stopped


def test_held_prefix_released_by_finish(tok: Tokenizer) -> None:
    ids = tok.encode("the end. ST", add_special=False)
    d = IncrementalDetokenizer(tok, ["STOP"])
    streamed = "".join(d.push(i).delta for i in ids)
    assert streamed == "the end. "
    assert d.finish() == "ST"
    assert d.text == "the end. ST"


def test_stop_with_multibyte_text(tok: Tokenizer) -> None:
    text = "你好，世界！今天天气很好。"
    ids = tok.encode(text, add_special=False)
    steps, tail, d = _stream(tok, ids, stop=["天气"])
    assert "".join(s.delta for s in steps) + tail == "你好，世界！今天"
    assert d.stopped
    assert all("\ufffd" not in s.delta for s in steps)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nHi<|im_end|>", add_special=False)
    assert tok.is_special(ids[0]) and tok.is_special(ids[-1])
    _, tail, d = _stream(tok, ids)
    assert d.text == "assistant\nHi" and tail == ""
    _, _, d = _stream(tok, ids, skip_special=False)
    assert d.text == "<|im_start|>assistant\nHi<|im_end|>"


def test_stop_string_on_special_token_text(tok: Tokenizer) -> None:
    ids = tok.encode("Hi<|im_end|>more", add_special=False)
    _, _, d = _stream(tok, ids, stop=["<|im_end|>"], skip_special=False)
    assert d.text == "Hi" and d.stopped
    _, _, d = _stream(tok, ids, stop=["<|im_end|>"], skip_special=True)
    assert d.text == "Himore" and not d.stopped  # skipped tokens add no text to match


def test_no_stops_streams_immediately(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world", add_special=False)
    d = IncrementalDetokenizer(tok, [])
    assert [d.push(i).delta for i in ids] == ["Hello", " world"]


def test_push_after_finish_raises(tok: Tokenizer) -> None:
    d = IncrementalDetokenizer(tok, ["x"])
    d.finish()
    with pytest.raises(RuntimeError):
        d.push(tok.encode("a", add_special=False)[0])
    assert d.finish() == ""


def test_random_cut_points_roundtrip(tok: Tokenizer) -> None:
    """Every stop position in a mixed text: output is exactly the text before the stop."""
    text = TEXTS[1] + " " + TEXTS[0]
    ids = tok.encode(text, add_special=False)
    for start in range(0, len(text) - 2, 3):
        stop = text[start:start + 2]
        _, tail, d = _stream(tok, ids, stop=[stop])
        assert d.text == text[: text.find(stop)], stop
        assert d.stopped
