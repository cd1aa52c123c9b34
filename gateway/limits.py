"""Per-key limits, in memory: requests per minute, tokens per minute, concurrent requests, and the
rates of the other endpoints that cost work (embedding inputs, searches, uploads, session requests).

Each limit's value for a key is the key's own (its ``limits``, else its rpm / tpm /
max_concurrent columns), else the ``[limits]`` default of the gateway config; admin keys have
none. ``max_concurrent`` counts every request in progress that costs work (generation,
embeddings, search, uploads, session requests); the summaries session memory writes count as the
generation requests of the session's key (gateway.memory_chat.lane_completer).

Both rates are sliding 60-second windows of exact events (a deque per key), so a burst is
refused as soon as the window holds ``rpm`` requests and ``Retry-After`` is the exact time
until the oldest one leaves it. Tokens are *reserved* when a request is admitted: its prompt
(counted by the window precheck) plus everything it may generate (``max_tokens`` per choice),
so requests running in parallel cannot overshoot ``tpm``; when the request ends the
reservation shrinks to what it used (prompt + completion) and the rest is refunded, also
after an error or a client that went away. One gateway process holds the counters; several
gateways behind a balancer each enforce the limit on their own.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.config import LimitsConfig
from gateway.errors import APIError
from gateway.keys import KeyRecord

__all__ = ["WINDOW_S", "Limiter", "Reservation", "Ticket"]

_LEGACY = ("rpm", "tpm", "max_concurrent")  # limits a key may also carry in their own columns

WINDOW_S = 60.0


@dataclass(eq=False)
class Reservation:
    """Tokens held in a key's tpm window for one request; :meth:`Limiter.settle` sets what it really used."""

    key_id: int
    time: float
    tokens: int
    in_window: bool = True  # False once it is older than the window (nothing left to refund)
    settled: bool = False


@dataclass
class _KeyState:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[Reservation] = field(default_factory=deque)
    token_sum: int = 0
    concurrent: int = 0
    rates: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)  # limit -> (time, amount)
    rate_sums: dict[str, int] = field(default_factory=dict)

    def prune(self, now: float) -> None:
        horizon = now - WINDOW_S
        while self.requests and self.requests[0] <= horizon:
            self.requests.popleft()
        while self.tokens and self.tokens[0].time <= horizon:
            r = self.tokens.popleft()
            r.in_window = False
            self.token_sum -= r.tokens


@dataclass
class Ticket:
    """One admitted request; :meth:`Limiter.release` gives its concurrency slot back (once)."""

    key_id: int
    released: bool = False


def _limited(message: str, retry_after: float, reason: str) -> APIError:
    return APIError(429, message, code="rate_limit_exceeded", retry_after=max(1.0, retry_after), limit=reason)


class Limiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 on_limited: Callable[[str], None] | None = None, config: LimitsConfig | None = None) -> None:
        self._clock = clock
        self._keys: dict[int, _KeyState] = {}
        self._on_limited = on_limited or (lambda reason: None)
        self.config = config or LimitsConfig(rpm=None, max_concurrent=None, embedding_inputs_per_minute=None,
                                             searches_per_minute=None, uploads_per_minute=None,
                                             session_requests_per_minute=None)

    def value(self, key: KeyRecord, name: str) -> int | None:
        """``name``'s limit for ``key``: its own, else the configured default; None: unlimited."""
        if key.admin:
            return None
        if name in key.limits:
            return key.limits[name]
        own = getattr(key, name, None) if name in _LEGACY else None
        return own if own is not None else getattr(self.config, name)

    def rate(self, key: KeyRecord, name: str, amount: int = 1, what: str = "requests") -> None:
        """Count ``amount`` against the key's per-minute limit ``name``; 429 (with the wait) when it does not fit.
        An amount larger than the whole limit passes when the window is empty (slow, not refused forever)."""
        limit = self.value(key, name)
        if limit is None:
            return
        now = self._clock()
        st = self._state(key.id)
        events = st.rates.setdefault(name, deque())
        total = st.rate_sums.get(name, 0)
        horizon = now - WINDOW_S
        while events and events[0][0] <= horizon:
            total -= events.popleft()[1]
        if total and total + amount > limit:
            self._on_limited(name)
            need, freed, wait = total + amount - limit, 0, WINDOW_S
            for t, n in events:
                freed += n
                if freed >= need:
                    wait = t + WINDOW_S - now
                    break
            st.rate_sums[name] = total
            raise _limited(f"this key's limit of {limit} {what} per minute is reached ({name}); retry in "
                           f"{wait:.0f}s", wait, name)
        events.append((now, amount))
        st.rate_sums[name] = total + amount

    def _state(self, key_id: int) -> _KeyState:
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        return st

    def admit(self, key: KeyRecord, generation: bool = True) -> Ticket:
        """Count a new request against max_concurrent and (``generation``) rpm; 429 when either is exhausted."""
        now = self._clock()
        st = self._state(key.id)
        st.prune(now)
        concurrent = self.value(key, "max_concurrent")
        if concurrent is not None and st.concurrent >= concurrent:
            self._on_limited("concurrency")
            raise _limited(f"this key already has {st.concurrent} request(s) in flight "
                           f"(max_concurrent={concurrent})", 1.0, "concurrency")
        rpm = self.value(key, "rpm") if generation else None
        if rpm is not None and len(st.requests) >= rpm:
            self._on_limited("rpm")
            wait = st.requests[0] + WINDOW_S - now
            raise _limited(f"this key's limit of {rpm} requests per minute is reached; retry in {wait:.0f}s",
                           wait, "rpm")
        if generation:
            st.requests.append(now)
        st.concurrent += 1
        return Ticket(key.id)

    def reserve(self, key: KeyRecord, prompt_tokens: int, max_new_tokens: int) -> Reservation:
        """Hold ``prompt_tokens + max_new_tokens`` in the key's tpm window, or 429 when they do not fit.

        A key whose window is empty is always let through, so a single request larger than
        the whole tpm allowance is slow rather than refused forever.
        """
        now = self._clock()
        st = self._state(key.id)
        st.prune(now)
        want = max(0, prompt_tokens) + max(0, max_new_tokens)
        tpm = self.value(key, "tpm")
        if tpm is not None and st.token_sum > 0 and st.token_sum + want > tpm:
            self._on_limited("tpm")
            need = st.token_sum + want - tpm
            freed, wait = 0, WINDOW_S
            for r in st.tokens:  # the time until enough tokens have left the window
                freed += r.tokens
                if freed >= need:
                    wait = r.time + WINDOW_S - now
                    break
            raise _limited(f"this key's limit of {tpm} tokens per minute is reached ({st.token_sum} used or "
                           f"reserved; this request needs {want}: {prompt_tokens} prompt + up to {max_new_tokens} "
                           f"to generate); retry in {wait:.0f}s", wait, "tpm")
        r = Reservation(key.id, now, want)
        st.tokens.append(r)
        st.token_sum += want
        return r

    def settle(self, r: Reservation, used_tokens: int) -> None:
        """The request ended having used ``used_tokens``: the rest of its reservation is refunded (once)."""
        if r.settled:
            return
        r.settled = True
        used = max(0, used_tokens)
        if r.in_window:
            self._state(r.key_id).token_sum += used - r.tokens
            r.tokens = used

    def release(self, ticket: Ticket) -> None:
        if not ticket.released:
            ticket.released = True
            self._state(ticket.key_id).concurrent -= 1
