"""Who is calling: ``Authorization: Bearer KEY`` -> a :class:`KeyRecord`, or 401 / 403.

Database keys are found by their HMAC (one indexed lookup, in a worker thread) and the
answer is cached for ``key_cache_s`` so the hot path is one HMAC and a dict lookup; a key
revoked through the admin API leaves the cache at once, one revoked with the CLI within
``key_cache_s``. The admin key from ``STRATA_ADMIN_KEY`` or ``admin_key_file`` is checked in
constant time and acts as key id 0 with no limits. No key material is ever logged.

Made-up keys cost no database work once seen (a bounded LRU of their HMACs answers 401 for
``negative_cache_s``; creating a key through the admin API empties it) and each client
address may fail ``auth_fail_limit`` times per ``auth_fail_window_s`` before its *unknown*
keys get 429 with ``Retry-After`` (the address is the peer, or the ``X-Forwarded-For`` hop
added by a proxy listed in ``trusted_proxies``); all addresses together may fail
``auth_fail_global_limit`` times per window before every unknown key gets it (a flood from
many addresses), except the first lookup of an address with no failure in the window (a new
valid key from a clean address is never refused; a flood pays one lookup per address and
window). A failed budget never refuses a key that verifies: a key that verified in
the last ``known_key_s`` is looked up whatever the budgets say, and a key in use stays cached
(an entry past half its life is refreshed in the background while the request goes on; a
refresh that finds the key revoked drops it, one that finds the database down keeps it).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import os
import stat
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from common.config import ADMIN_ENV
from gateway.config import ConfigError, GatewayConfig
from gateway.errors import APIError
from gateway.keys import KEY_PREFIX, KeyRecord, KeyStore

__all__ = ["ADMIN_ENV", "Authenticator", "ClientAddress", "resolve_admin_key"]

MIN_ADMIN_KEY_LEN = 16
_CACHE_MAX = 10_000
_KNOWN_MAX = 100_000


def _read_admin_file(path: Path) -> str:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"admin_key_file={str(path)!r}: no such file") from None
    except OSError as e:
        raise ConfigError(f"admin_key_file={str(path)!r}: cannot stat: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"admin_key_file={str(path)!r}: not a regular file")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(f"admin_key_file={str(path)!r} has mode {mode:04o}: group/other may read it; "
                          f"refusing it (run: chmod 600 {path})")
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"admin_key_file={str(path)!r}: cannot read: {e}") from None


def resolve_admin_key(config: GatewayConfig, env: Mapping[str, str] | None = None) -> str | None:
    """The admin key: ``STRATA_ADMIN_KEY`` if set, else ``admin_key_file`` (mode 0600 or stricter)."""
    env = os.environ if env is None else env
    key, source = env.get(ADMIN_ENV), f"environment {ADMIN_ENV}"
    if not key and config.admin_key_file is not None:
        key, source = _read_admin_file(config.admin_key_file), f"admin_key_file {config.admin_key_file}"
    if not key:
        return None
    if len(key) < MIN_ADMIN_KEY_LEN or any(c.isspace() for c in key):
        raise ConfigError(f"the admin key from {source} must be at least {MIN_ADMIN_KEY_LEN} characters "
                          "without spaces")
    return key


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", type="invalid_request_error")


class ClientAddress:
    """The client's address as the limits see it: the peer, or the ``X-Forwarded-For`` entry added
    by the last trusted proxy. IPv6 clients are counted per /64 (one host usually owns the whole
    prefix, so rotating addresses inside it must not reset the count)."""

    def __init__(self, trusted: list[str]) -> None:
        self.trusted = [ipaddress.ip_network(t, strict=False) for t in trusted]

    def _is_trusted(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(addr in net for net in self.trusted)

    def is_trusted(self, peer: str) -> bool:
        """``peer`` (an address) is one of ``trusted_proxies``."""
        addr = self._parse(peer) if self.trusted else None
        return addr is not None and self._is_trusted(addr)

    @staticmethod
    def _parse(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        text = text.strip()
        if text.startswith("[") and "]" in text:  # [v6]:port
            text = text[1:text.index("]")]
        elif text.count(":") == 1:  # v4:port
            text = text.partition(":")[0]
        try:
            return ipaddress.ip_address(text)
        except ValueError:
            return None

    def of(self, peer: str | None, forwarded_for: str | None) -> str:
        addr = self._parse(peer) if peer else None
        if addr is None:
            return peer or "unknown"
        if forwarded_for and self.trusted and self._is_trusted(addr):
            # rightmost first: entries left of the last trusted hop are whatever the client wrote
            for hop in reversed(forwarded_for.split(",")):
                hop_addr = self._parse(hop)
                if hop_addr is None:
                    break
                addr = hop_addr
                if not self._is_trusted(hop_addr):
                    break
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is None:
            return str(ipaddress.ip_network(f"{addr}/64", strict=False))
        return str(addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else addr)


@dataclass
class _Failures:
    start: float  # the window's start
    count: int = 0  # failed authentications in this window
    # digest -> this address's requests waiting on its database lookup. The budget counts distinct
    # lookups (len), not waiters: 32 streams of one valid key whose cache entry just expired share
    # one lookup and must not spend 32 of a 30-failure budget.
    pending: dict[str, int] = field(default_factory=dict)
    blocked_until: float = 0.0
    trickle_at: float = 0.0  # while blocked, the next unknown key it may have looked up (slowed, not refused)


class Authenticator:
    """Keys to records, with three defences against a flood of made-up keys: a bounded cache of
    unknown keys' HMACs (401 from memory), one database lookup per key digest at a time, and a
    per-address budget of failed authentications (429 with Retry-After once spent, before any
    lookup). A key that is already cached as valid (or the admin key) passes even from a blocked
    address: it costs no database work."""

    def __init__(self, store: KeyStore, admin_key: str | None, cache_s: float, log_prompts_default: bool, *,
                 negative_size: int = 10_000, negative_s: float = 60.0, fail_limit: int = 30,
                 fail_window_s: float = 60.0, global_fail_limit: int = 1000, known_s: float = 86400.0,
                 max_addresses: int = 100_000, clock: Callable[[], float] = time.monotonic,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.store = store
        self._admin_digest = store.hash(admin_key) if admin_key else None
        self.admin_record = KeyRecord(id=0, name="admin", prefix="", admin=True, log_prompts=log_prompts_default)
        self.cache_s = cache_s
        self._cache: OrderedDict[str, tuple[KeyRecord, float]] = OrderedDict()  # digest -> (record, expiry), LRU
        self.known_s = known_s
        self._known: OrderedDict[str, float] = OrderedDict()  # digest -> when it last verified, oldest first
        self.global_fail_limit = global_fail_limit
        self._global_failures: deque[float] = deque()  # failure times in the last fail_window_s, all addresses
        self.negative_size = negative_size
        self.negative_s = negative_s
        self._negative: OrderedDict[str, float] = OrderedDict()  # digest -> expiry, oldest first
        self._lookups: dict[str, asyncio.Future[KeyRecord | None]] = {}  # digest -> its lookup in flight
        self.fail_limit = fail_limit
        self.fail_window_s = fail_window_s
        self.max_addresses = max_addresses
        self._failures: OrderedDict[str, _Failures] = OrderedDict()  # address -> counts, least recent first
        self._clock = clock
        self._on_event = on_event or (lambda event: None)
        self.db_lookups = 0  # key lookups that reached the database

    # ------------------------------------------------------------ per-address failure budget
    def _entry(self, address: str, now: float) -> _Failures:
        f = self._failures.get(address)
        if f is None:
            f = self._failures[address] = _Failures(start=now)
            while len(self._failures) > self.max_addresses:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(address)
            if now - f.start >= self.fail_window_s and f.blocked_until <= now:
                f.start, f.count = now, 0
        return f

    def _check_blocked(self, f: _Failures, now: float, lookup: bool) -> None:
        """429 when the address is blocked, or when a database lookup would exceed its budget. A blocked address
        still gets one lookup per ``fail_window_s / fail_limit`` (the budget's own rate): a new valid key behind
        it (a shared NAT or proxy) is slowed down, not refused until the block ends."""
        if f.blocked_until > now:
            if lookup and now >= f.trickle_at:
                f.trickle_at = now + self.fail_window_s / self.fail_limit
                return
            wait = f.blocked_until - now
        elif lookup and f.count + len(f.pending) >= self.fail_limit:
            wait = 1.0  # the lookups in flight may still succeed
        else:
            return
        self._on_event("blocked")
        raise APIError(429, f"too many failed authentications from this address; retry in {wait:.0f}s",
                           code="too_many_auth_failures", retry_after=max(1.0, wait))

    def _check_global(self, now: float) -> None:
        """429 for an unknown key's lookup while all addresses together have spent the global budget."""
        horizon = now - self.fail_window_s
        while self._global_failures and self._global_failures[0] <= horizon:
            self._global_failures.popleft()
        if len(self._global_failures) >= self.global_fail_limit:
            wait = self._global_failures[0] + self.fail_window_s - now
            self._on_event("blocked")
            raise APIError(429, f"too many failed authentications; retry in {wait:.0f}s",
                           code="too_many_auth_failures", retry_after=max(1.0, wait))

    def _is_known(self, digest: str, now: float) -> bool:
        seen = self._known.get(digest)
        return seen is not None and now - seen < self.known_s

    def _fail(self, f: _Failures, now: float, message: str) -> APIError:
        self._global_failures.append(now)
        f.count += 1
        if f.count >= self.fail_limit and f.blocked_until <= now:
            f.blocked_until = now + self.fail_window_s
            f.trickle_at = now + self.fail_window_s / self.fail_limit
        self._on_event("failed")
        return _unauthorized(message)

    # ------------------------------------------------------------ unknown keys
    def _negative_hit(self, digest: str, now: float) -> bool:
        expiry = self._negative.get(digest)
        if expiry is None:
            return False
        if expiry <= now:
            del self._negative[digest]
            return False
        return True

    def _remember_unknown(self, digest: str, now: float) -> None:
        if self.negative_size <= 0 or self.negative_s <= 0:
            return
        self._negative[digest] = now + self.negative_s
        self._negative.move_to_end(digest)
        while len(self._negative) > self.negative_size:
            self._negative.popitem(last=False)

    def key_created(self) -> None:
        """A key was created through the admin API: no cached "unknown" answer may hide it."""
        self._negative.clear()

    async def _lookup(self, digest: str) -> KeyRecord | None:
        """One database lookup per digest at a time: concurrent requests with the same key share it (a
        task of its own, so a waiter that goes away cancels nothing for the others)."""
        task = self._lookups.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._query(digest))
            self._lookups[digest] = task
            task.add_done_callback(lambda _: self._lookups.pop(digest, None))
        return await asyncio.shield(task)

    async def _query(self, digest: str) -> KeyRecord | None:
        self.db_lookups += 1
        return await asyncio.to_thread(self.store.lookup_hash, digest)

    # ------------------------------------------------------------ the entry point
    async def authenticate(self, authorization: str | None, address: str = "unknown") -> KeyRecord:
        now = self._clock()
        f = self._entry(address, now)
        if not authorization:
            self._check_blocked(f, now, lookup=False)
            raise self._fail(f, now, "no API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            self._check_blocked(f, now, lookup=False)
            raise self._fail(f, now, "the Authorization header must be 'Bearer <key>'")
        if len(key) > 256:
            self._check_blocked(f, now, lookup=False)
            raise self._fail(f, now, "invalid API key")
        digest = self.store.hash(key)
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return self.admin_record
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            self._cache.move_to_end(digest)
            if hit[1] - now < self.cache_s / 2:  # in use: refreshed before it expires, the request goes on
                self._refresh(digest)
            return hit[0]
        if self._negative_hit(digest, now) or not key.startswith(KEY_PREFIX):
            self._check_blocked(f, now, lookup=False)
            raise self._fail(f, now, "invalid or revoked API key")
        known = self._is_known(digest, now)
        if not known and digest not in f.pending:  # joining a lookup already in flight costs the budget nothing
            self._check_blocked(f, now, lookup=True)
            if f.count or f.pending:  # a clean address's first lookup passes the global budget
                self._check_global(now)
        f.pending[digest] = f.pending.get(digest, 0) + 1
        try:
            record = await self._lookup(digest)
        finally:
            if f.pending[digest] > 1:
                f.pending[digest] -= 1
            else:
                del f.pending[digest]
        now = self._clock()
        if record is None:
            self._cache.pop(digest, None)
            self._known.pop(digest, None)
            self._remember_unknown(digest, now)
            raise self._fail(f, now, "invalid or revoked API key")
        self._verified(digest, record, now)
        return record

    def _verified(self, digest: str, record: KeyRecord, now: float) -> None:
        self._cache[digest] = (record, now + self.cache_s)
        self._cache.move_to_end(digest)
        while len(self._cache) > _CACHE_MAX:
            self._cache.popitem(last=False)
        self._known[digest] = now
        self._known.move_to_end(digest)
        while len(self._known) > _KNOWN_MAX:
            self._known.popitem(last=False)

    def _refresh(self, digest: str) -> None:
        """Look a cached key up again in the background (once at a time per key)."""
        if digest in self._lookups:
            return

        def done(task: asyncio.Future[KeyRecord | None]) -> None:
            now = self._clock()
            if task.cancelled():
                return
            if task.exception() is not None:  # the database is down: the key stays usable meanwhile
                hit = self._cache.get(digest)
                if hit is not None:
                    self._cache[digest] = (hit[0], now + self.cache_s)
                return
            record = task.result()
            if record is None:  # revoked (the CLI) or gone
                self._cache.pop(digest, None)
                self._known.pop(digest, None)
            else:
                self._verified(digest, record, now)

        asyncio.ensure_future(self._lookup(digest)).add_done_callback(done)

    def forget(self, key_id: int) -> None:
        """Drop a key from the cache (revoked through the admin API)."""
        for digest, (rec, _) in list(self._cache.items()):
            if rec.id == key_id:
                del self._cache[digest]
                self._known.pop(digest, None)
