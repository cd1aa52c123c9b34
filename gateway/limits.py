"""Per-key limits, in memory: requests per minute, tokens per minute, concurrent requests.

Both rates are sliding 60-second windows of exact events (a deque per key), so a burst is
refused as soon as the window holds ``rpm`` requests and ``Retry-After`` is the exact time
until the oldest one leaves it. Tokens are charged twice: the prompt (counted by the window
precheck) when the request is admitted, the completion when it ends. One gateway process
holds the counters; several gateways behind a balancer each enforce the limit on their own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import APIError
from gateway.keys import KeyRecord

__all__ = ["WINDOW_S", "Limiter", "Ticket"]

WINDOW_S = 60.0


@dataclass
class _KeyState:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0
    concurrent: int = 0

    def prune(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self.requests and self.requests[0] <= horizon:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= horizon:
            self.token_sum -= self.tokens.popleft()[1]


@dataclass
class Ticket:
    """One admitted request; :meth:`Limiter.release` gives its concurrency slot back (once)."""

    key_id: int
    released: bool = False


def _limited(message: str, retry_after: float, reason: str) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", retry_after=max(1.0, retry_after), limit=reason)


class Limiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_limited: Callable[[str], None] | None = None) -> None:
        self._clock = clock
        self._keys: dict[int, _KeyState] = {}
        self._on_limited = on_limited or (lambda reason: None)

    def _state(self, key_id: int) -> _KeyState:
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        return st

    def admit(self, key: KeyRecord) -> Ticket:
        """Count a new request against rpm and max_concurrent; 429 when either is exhausted."""
        now = self._clock()
        st = self._state(key.id)
        st.prune(now)
        if key.max_concurrent is not None and st.concurrent >= key.max_concurrent:
            self._on_limited("concurrency")
            raise _limited(f"this key already has {st.concurrent} request(s) in flight "
                           f"(max_concurrent={key.max_concurrent})", 1.0, "concurrency")
        if key.rpm is not None and len(st.requests) >= key.rpm:
            self._on_limited("rpm")
            wait = st.requests[0] + WINDOW_S - now
            raise _limited(f"this key's limit of {key.rpm} requests per minute is reached; retry in {wait:.0f}s",
                           wait, "rpm")
        st.requests.append(now)
        st.concurrent += 1
        return Ticket(key.id)

    def charge_prompt(self, key: KeyRecord, tokens: int) -> None:
        """Admit ``tokens`` prompt tokens against tpm (429 when the window is full), and count them.

        A key whose window is empty is always let through, so a single prompt larger than
        the whole tpm allowance is slow rather than refused forever.
        """
        now = self._clock()
        st = self._state(key.id)
        st.prune(now)
        if key.tpm is not None and st.token_sum > 0 and st.token_sum + tokens > key.tpm:
            self._on_limited("tpm")
            need = st.token_sum + tokens - key.tpm
            freed, wait = 0, WINDOW_S
            for t, n in st.tokens:  # the time until enough tokens have left the window
                freed += n
                if freed >= need:
                    wait = t + WINDOW_S - now
                    break
            raise _limited(f"this key's limit of {key.tpm} tokens per minute is reached "
                           f"({st.token_sum} used, this prompt has {tokens}); retry in {wait:.0f}s", wait, "tpm")
        self.charge(key.id, tokens)

    def charge(self, key_id: int, tokens: int) -> None:
        """Count tokens already spent (the completion, once the request ends)."""
        if tokens > 0:
            st = self._state(key_id)
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self._state(ticket.key_id).concurrent -= 1

    def usage(self, key_id: int) -> dict[str, int]:
        st = self._state(key_id)
        st.prune(self._clock())
        return {"requests_last_minute": len(st.requests), "tokens_last_minute": st.token_sum,
                "in_flight": st.concurrent}
