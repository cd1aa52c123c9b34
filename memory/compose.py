"""Context composition: a session's history fitted to a token budget, deterministically.

The composed chat, in order (docs/memory.md):

1. **head** — one system message: the system prompt (the request's, else the session's) and
   the running summary in a delimited block. It changes only when the summary does, so a lane's
   prefix cache (the session keeps its lane by affinity) serves it turn after turn;
2. **recent turns verbatim** — the newest turns no summary covers, oldest first. When they do not
   all fit, the first one kept is the oldest whose turn number is 1 modulo :data:`STRIDE` that
   lets the rest fit: the start stays put for several turns and then jumps, instead of sliding by
   one turn every request (which would change the prompt right after the head each time and cost
   a full prefill). Appending a turn leaves everything before it byte-identical;
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

__all__ = ["RETRIEVED_BEGIN", "RETRIEVED_END", "SUMMARY_BEGIN", "SUMMARY_END", "STRIDE", "Composition", "Scored",
           "compose", "estimate_tokens", "render_turn"]

SUMMARY_BEGIN = "<<<CONVERSATION SUMMARY>>>"
SUMMARY_END = "<<<END OF CONVERSATION SUMMARY>>>"
RETRIEVED_BEGIN = "<<<EARLIER TURNS>>>"
RETRIEVED_END = "<<<END OF EARLIER TURNS>>>"
_SUMMARY_INTRO = "Summary of the earlier part of this conversation (older turns, condensed):"
_RETRIEVED_INTRO = ("Older turns of this conversation that may matter for the next message, in the order they were "
                    "said; all of them come before the conversation above. Where they disagree with the conversation "
                    "above, the conversation above is correct; among them, the later turn is the correct one.")
STRIDE = 8  # the verbatim window's start moves in steps of this many turns (prefix-cache friendly)
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

    def header(self) -> str:
        return (f"turns={self.total_turns}; summary={self.summary_turns}; recent={self.recent}; "
                f"retrieved={self.retrieved}; dropped={self.dropped}")


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


def _fit_recent(recent: Sequence[Turn], room: int) -> list[Turn]:
    """The newest turns that fit ``room``, in order, starting at an aligned turn (seq % STRIDE == 1) when
    one lets the rest fit, else at whatever turn does."""
    costs = [t.tokens + MESSAGE_OVERHEAD for t in recent]
    total = sum(costs)
    if total <= room:
        return list(recent)
    suffix = total
    first_fit = None
    for i, t in enumerate(recent):
        if suffix <= room:
            if t.seq % STRIDE == 1:
                return list(recent[i:])
            if first_fit is None:
                first_fit = i
        suffix -= costs[i]
    return list(recent[first_fit:]) if first_fit is not None else []


def compose(*, system: str | None, summary: Summary | None, recent: Sequence[Turn], candidates: Sequence[Scored],
            new_messages: Sequence[dict[str, Any]], budget: int, top_k: int, retrieve_share: float,
            total_turns: int) -> Composition:
    """Fit the session into ``budget`` estimated tokens (the new messages included).

    ``recent``: the newest unsummarised turns in seq order; ``candidates``: older turns with their
    similarity to the new message, best first (ties broken by seq, so the result is deterministic).
    """
    head = _head(system, summary)
    used = sum(estimate_tokens(str(m.get("content") or "")) + MESSAGE_OVERHEAD for m in new_messages)
    if head:
        used += estimate_tokens(head) + MESSAGE_OVERHEAD
    room = max(0, budget - used)
    take = _fit_recent(recent, room)
    # room for retrieval: the best candidates that the verbatim turns leave out, up to a share of the budget
    kept = {t.id for t in take}
    want = [c for c in candidates if c.turn.id not in kept][:top_k]
    if want and top_k > 0:
        need = sum(estimate_tokens(render_turn(c.turn)) + 1 for c in want) + estimate_tokens(_RETRIEVED_INTRO) \
            + 24 + MESSAGE_OVERHEAD
        take = _fit_recent(recent, room - min(need, int(room * retrieve_share)))
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
        block = _retrieved_block(chosen)
        messages.append({"role": "system", "content": block})
        spent += estimate_tokens(block) + MESSAGE_OVERHEAD
    messages += [dict(m) for m in new_messages]
    return Composition(messages, summary.last_seq if summary is not None else 0, len(take), len(chosen), dropped,
                       total_turns, used + spent, head)
