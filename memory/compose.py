"""Context composition: a session's history fitted to a token budget, deterministically.

The composed chat, in order (docs/memory.md):

1. **head** — one system message: the system prompt (the request's, else the session's) and
   the running summary in a delimited block. It changes only when the summary does, so a lane's
   prefix cache (the session keeps its lane by affinity) serves it turn after turn;
2. **recent turns verbatim** — the newest turns no summary covers, oldest first. When they do not
   all fit, the first one kept is the start of a *block*: the turns are cut into blocks of about
   ``block`` estimated tokens (half the budget by default), each starting at a user turn and
   counted from the first turn loaded, so the boundaries stay where they are as the conversation
   grows. The oldest block start that lets the rest fit is kept: the start stays put while the
   conversation grows by a block, then jumps by one, instead of sliding by a turn or two every
   request (each move changes the prompt right after the head and costs a full prefill). Appending
   a turn leaves everything before it byte-identical. When the turns do not all fit, a share of the
   budget is kept for retrieved turns whether or not this request finds any, so the verbatim room
   does not depend on the new message's retrieval results;
3. **retrieved turns** — older turns most similar to the new message (cosine of the embedding
   model's vectors), in turn order, in one system message placed after the verbatim turns (so it
   never disturbs the cached prefix) that says they are older than the conversation above, which
   wins where they disagree, and that among them the later turn wins (a corrected fact wins);
4. the request's own messages (the new user message).

The budget is in estimated tokens (:func:`estimate_tokens`, deliberately high for English); the
gateway then counts the result with the lane's own tokenizer and composes again with a smaller
budget when it does not fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memory.store import Summary, Turn

__all__ = ["BLOCK_SHARE", "RETRIEVED_BEGIN", "RETRIEVED_END", "SUMMARY_BEGIN", "SUMMARY_END", "Composition",
           "Scored", "compose", "estimate_tokens", "render_turn"]

SUMMARY_BEGIN = "<<<CONVERSATION SUMMARY>>>"
SUMMARY_END = "<<<END OF CONVERSATION SUMMARY>>>"
RETRIEVED_BEGIN = "<<<EARLIER TURNS>>>"
RETRIEVED_END = "<<<END OF EARLIER TURNS>>>"
_SUMMARY_INTRO = "Summary of the earlier part of this conversation (older turns, condensed):"
_RETRIEVED_INTRO = ("Older turns of this conversation that may matter for the next message, in the order they were "
                    "said; all of them come before the conversation above. Where they disagree with the conversation "
                    "above, the conversation above is correct; among them, the later turn is the correct one.")
BLOCK_SHARE = 0.5  # default block size, as a share of the budget: how far the verbatim start jumps when it moves
MIN_BLOCK = 32  # smallest block tried before a start at any turn
MESSAGE_OVERHEAD = 6  # role markers and separators a chat template adds per message (estimated tokens)


def estimate_tokens(text: str) -> int:
    """An upper-leaning token estimate (UTF-8 bytes / 3): BPE vocabularies average ~4 bytes per token on
    English, so this over-counts and the exact count seldom needs a second composition."""
    return len(text.encode("utf-8", "replace")) // 3 + 1


@dataclass(frozen=True)
class Scored:
    turn: Turn
    score: float


@dataclass
class Composition:
    messages: list[dict[str, Any]]
    summary_turns: int  # turns the summary in the head covers (0: no summary)
    recent: int  # turns verbatim
    retrieved: int  # older turns retrieved by similarity
    dropped: int  # unsummarised turns left out for the budget (retrievable)
    total_turns: int  # stored turns in the session
    estimated_tokens: int
    head: str  # the head system message's text (byte-stable between summaries)
    note: str = ""  # why a part was skipped, e.g. retrieval while the embedding model loads

    def header(self) -> str:
        return (f"turns={self.total_turns}; summary={self.summary_turns}; recent={self.recent}; "
                f"retrieved={self.retrieved}; dropped={self.dropped}") + (f"; {self.note}" if self.note else "")


def render_turn(t: Turn) -> str:
    cut = "" if t.complete else " (interrupted)"
    return f"[turn {t.seq}, {t.role}{cut}] {t.content}"


def _head(system: str | None, summary: Summary | None) -> str:
    parts = [system.rstrip()] if system and system.strip() else []
    if summary is not None and summary.text.strip():
        body = summary.text.strip().replace("<<<", "‹‹‹").replace(">>>", "›››")
        parts.append(f"{_SUMMARY_INTRO}\n{SUMMARY_BEGIN}\n{body}\n{SUMMARY_END}")
    return "\n\n".join(parts)


def _retrieved_block(chosen: list[Turn]) -> str:
    lines = [_RETRIEVED_INTRO, RETRIEVED_BEGIN]
    lines += [render_turn(t).replace("<<<", "‹‹‹").replace(">>>", "›››") for t in sorted(chosen, key=lambda t: t.seq)]
    lines.append(RETRIEVED_END)
    return "\n".join(lines)


def _block_starts(recent: Sequence[Turn], block: int) -> list[int]:
    """Indices where a block starts: the first turn, then the first user turn after at least ``block``
    estimated tokens. Counted from the first turn, so appending turns never moves an earlier boundary."""
    starts = [0] if recent else []
    acc = 0
    for i, t in enumerate(recent):
        if i and acc >= block and t.role == "user":
            starts.append(i)
            acc = 0
        acc += t.tokens + MESSAGE_OVERHEAD
    return starts


def _fit_recent(recent: Sequence[Turn], room: int, block: int) -> list[Turn]:
    """The newest turns that fit ``room``, in order, from the oldest block start that lets the rest fit. When
    even the newest block is too long (a long system prompt or message leaves little room), blocks of half
    the size, and so on down to :data:`MIN_BLOCK`; then the oldest user turn that fits, else any turn."""
    costs = [t.tokens + MESSAGE_OVERHEAD for t in recent]
    total = sum(costs)
    if total <= room:
        return list(recent)
    suffix = [0] * (len(recent) + 1)
    for i in range(len(recent) - 1, -1, -1):
        suffix[i] = suffix[i + 1] + costs[i]
    size = block
    while size >= MIN_BLOCK:
        for i in _block_starts(recent, size):
            if suffix[i] <= room:
                return list(recent[i:])
        size //= 2
    fits = [i for i in range(len(recent)) if suffix[i] <= room]
    users = [i for i in fits if recent[i].role == "user"]
    if users or fits:
        return list(recent[(users or fits)[0]:])
    return []


def compose(*, system: str | None, summary: Summary | None, recent: Sequence[Turn], candidates: Sequence[Scored],
            new_messages: Sequence[dict[str, Any]], budget: int, top_k: int, retrieve_share: float,
            total_turns: int, block: int | None = None) -> Composition:
    """Fit the session into ``budget`` estimated tokens (the new messages included).

    ``recent``: the newest unsummarised turns in seq order; ``candidates``: older turns with their
    similarity to the new message, best first (ties broken by seq, so the result is deterministic);
    ``block``: the verbatim start's step in estimated tokens (default: :data:`BLOCK_SHARE` of the budget).
    """
    head = _head(system, summary)
    used = sum(estimate_tokens(str(m.get("content") or "")) + MESSAGE_OVERHEAD for m in new_messages)
    if head:
        used += estimate_tokens(head) + MESSAGE_OVERHEAD
    room = max(0, budget - used)
    # the budget rounded down to 256 first: a request naming another max_tokens keeps the same boundaries
    step = max(1, int(budget // 256 * 256 * BLOCK_SHARE) if block is None else block)
    verbatim_room = room
    if top_k > 0 and sum(t.tokens + MESSAGE_OVERHEAD for t in recent) > room:
        # the history has outgrown the budget: keep the retrieval share whatever this request retrieves, so
        # the verbatim start does not move with the new message's search results
        verbatim_room = room - int(room * retrieve_share)
    take = _fit_recent(recent, verbatim_room, step)
    spent = sum(t.tokens + MESSAGE_OVERHEAD for t in take)
    dropped = len(recent) - len(take)
    kept_ids = {t.id for t in take}
    # retrieved turns: the best first, within what is left (a turn shown verbatim is not repeated)
    chosen: list[Turn] = []
    left = room - spent - estimate_tokens(_RETRIEVED_INTRO) - 24 - MESSAGE_OVERHEAD
    for c in candidates:
        if len(chosen) >= top_k:
            break
        if c.turn.id in kept_ids:
            continue
        cost = estimate_tokens(render_turn(c.turn)) + 1
        if cost <= left:
            chosen.append(c.turn)
            left -= cost
    messages: list[dict[str, Any]] = []
    if head:
        messages.append({"role": "system", "content": head})
    messages += [{"role": t.role, "content": t.content} for t in take]
    if chosen:  # after the verbatim turns: what changes from request to request comes last
        text = _retrieved_block(chosen)
        messages.append({"role": "system", "content": text})
        spent += estimate_tokens(text) + MESSAGE_OVERHEAD
    messages += [dict(m) for m in new_messages]
    return Composition(messages, summary.last_seq if summary is not None else 0, len(take), len(chosen), dropped,
                       total_turns, used + spent, head)
