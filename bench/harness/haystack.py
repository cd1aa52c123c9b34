"""Filler text for the long-context scenarios (passkey, babilong, long_prefill), generated here, and
fitting a prompt to a token length with the lane's own tokenizer."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

# Neutral sentences with none of the world simulator's names, rooms or objects, nor any digits.
_SUBJECTS = ["The committee", "A traveller", "The old clock", "Every morning the baker", "The river",
             "A quiet student", "The lighthouse keeper", "The orchestra", "The mountain road", "A small boat"]
_VERBS = ["considered", "remembered", "followed", "described", "admired", "ignored", "painted", "measured"]
_OBJECTS = ["the distant hills", "a long letter", "the evening light", "the slow tide", "an old map",
            "the autumn leaves", "a forgotten song", "the narrow bridge", "the winter market", "a silver coin"]
_TAILS = ["before the rain began.", "with great patience.", "as the sun went down.", "without saying a word.",
          "for the second time that week.", "while the town slept.", "in the usual way."]


def filler_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
            for _ in range(n)]


def passkey_prompt(n_filler: int, depth: float, key: str, seed: int = 0) -> str:
    """``n_filler`` filler sentences with the needle after ``depth`` (0..1) of them, then the question."""
    fill = filler_sentences(n_filler, seed)
    at = round(depth * n_filler)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    body = " ".join(fill[:at] + [needle] + fill[at:])
    return ("There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
            f"{body}\n\nWhat is the pass key? Answer with the number only.")


async def fit(count: Callable[[int], Awaitable[int]], target: int, max_n: int = 200_000) -> tuple[int, int]:
    """The largest ``n`` (filler units) whose prompt ``count(n)`` tokens stays <= ``target``, and its
    count. Two measurements give the slope, then at most a few corrections."""
    base = await count(0)
    if base > target:
        return 0, base
    probe = 64
    per = max(1e-6, (await count(probe) - base) / probe)
    n = max(0, min(max_n, int((target - base) / per)))
    got = await count(n)
    for _ in range(6):  # walk down (or up) by the measured slope until just under the target
        if got > target:
            n = max(0, n - max(1, int((got - target) / per) + 1))
        elif target - got > per * 1.5 and n < max_n:
            n = min(max_n, n + max(1, int((target - got) / per) - 1))
        else:
            break
        got = await count(n)
    while got > target and n > 0:
        n -= 1
        got = await count(n)
    return n, got
