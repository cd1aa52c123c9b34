"""Incremental detokenization for streaming, with stop strings.

Tokens contribute raw bytes (``Tokenizer.token_bytes``); a multi-byte UTF-8 character may be
split across tokens, so bytes go through an incremental UTF-8 decoder that holds an incomplete
sequence until it completes (never a half character or a premature U+FFFD in a delta).

Stop strings are matched on the decoded text, across token boundaries. The match and anything
after it are never returned. Text that might still be the start of a stop string is held back
until the next tokens decide: released if it turns out not to be one, dropped if it is.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["DetokStep", "IncrementalDetokenizer"]


class _TokenSource(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


@dataclass(frozen=True, slots=True)
class DetokStep:
    """Result of one pushed token: new text to send, and whether a stop string has ended it."""

    delta: str
    stopped: bool


class IncrementalDetokenizer:
    """Token ids in, text deltas out, one token at a time.

    ``tokenizer`` needs ``token_bytes(id)``; ``is_special(id)`` is used when present, so
    control tokens add no text when ``skip_special`` (their vocabulary text otherwise).
    """

    def __init__(self, tokenizer: _TokenSource, stop: Sequence[str] | None = None,
                 skip_special: bool = True) -> None:
        self._tok = tokenizer
        self._stops = [s for s in (stop or []) if s]
        # Longest text that may be held back: one less than the longest stop string.
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._is_special = getattr(tokenizer, "is_special", None) if skip_special else None
        # errors="replace": bytes that can never be valid become U+FFFD at once; an incomplete
        # trailing sequence is held until it completes (or until finish()).
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # decoded but not yet emitted (a possible stop-string prefix)
        self._emitted: list[str] = []
        self._stopped = False
        self._finished = False
        self.matched_stop: str | None = None
        """The stop string that ended the text, if any."""

    @property
    def text(self) -> str:
        """All text emitted so far (the concatenation of every delta)."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def stopped(self) -> bool:
        return self._stopped

    def push(self, token_id: int) -> DetokStep:
        """Add one generated token; returns the text that is now safe to emit.

        After a stop string matched, further tokens are ignored (``stopped`` stays True).
        """
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self._stopped:
            return DetokStep("", True)
        if self._is_special is not None and self._is_special(token_id):
            return DetokStep("", False)
        new = self._decoder.decode(self._tok.token_bytes(token_id))
        if not new:
            return DetokStep("", False)  # only part of a character so far
        return DetokStep(self._advance(self._pending + new, final=False), self._stopped)

    def finish(self) -> str:
        """End of generation: flush held text (an incomplete final character becomes U+FFFD)."""
        if self._finished:
            return ""
        self._finished = True
        if self._stopped:
            return ""
        tail = self._decoder.decode(b"", final=True)
        return self._advance(self._pending + tail, final=True)

    def _advance(self, buf: str, *, final: bool) -> str:
        """Emit what of ``buf`` is safe; keep the rest in ``_pending``."""
        cut = self._find_stop(buf)
        if cut is not None:
            out, self._pending, self._stopped = buf[:cut], "", True
        elif final or not self._stops:
            out, self._pending = buf, ""
        else:
            hold = self._stop_prefix_len(buf)
            out, self._pending = buf[: len(buf) - hold], buf[len(buf) - hold:]
        if out:
            self._emitted.append(out)
        return out

    def _find_stop(self, buf: str) -> int | None:
        """Start of the earliest stop-string match in ``buf`` (all earlier text was emitted
        only after it was proven not to start a stop string, so searching ``buf`` suffices)."""
        best: int | None = None
        for s in self._stops:
            i = buf.find(s)
            if i >= 0 and (best is None or i < best):
                best = i
                self.matched_stop = s
        return best

    def _stop_prefix_len(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
