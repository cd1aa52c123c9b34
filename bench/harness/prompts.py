"""Prompts of a given token length, measured with the lane's tokenizer."""

from __future__ import annotations

from bench.harness.client import Target
from bench.harness.haystack import filler_sentences, fit


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def prompt_of_length(target: Target, tokens: int, tail: str = "Summarise the text above in one line.",
                           seed: int = 0) -> tuple[str, int]:
    """Filler text plus ``tail`` whose chat prompt is at most ``tokens`` tokens (and as close as the
    sentence granularity allows); returns (text, measured tokens)."""
    sentences = filler_sentences(8192, seed)

    def text(n: int) -> str:
        return " ".join(sentences[:n]) + "\n\n" + tail

    async def count(n: int) -> int:
        return await target.count_tokens(chat(text(n)))

    n, got = await fit(count, tokens, max_n=len(sentences))
    return text(n), got
