"""Who is calling: ``Authorization: Bearer KEY`` -> a :class:`KeyRecord`, or 401 / 403.

Database keys are found by their HMAC (one indexed lookup, in a worker thread) and the
answer is cached for ``key_cache_s`` so the hot path is one HMAC and a dict lookup; a key
revoked through the admin API leaves the cache at once, one revoked with the CLI within
``key_cache_s``. The admin key from ``STRATA_ADMIN_KEY`` or ``admin_key_file`` is checked in
constant time and acts as key id 0 with no limits. No key material is ever logged.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import stat
import time
from collections.abc import Mapping
from pathlib import Path

from common.config import ADMIN_ENV
from gateway.config import ConfigError, GatewayConfig
from gateway.errors import APIError
from gateway.keys import KeyRecord, KeyStore

__all__ = ["ADMIN_ENV", "Authenticator", "resolve_admin_key"]

MIN_ADMIN_KEY_LEN = 16
_CACHE_MAX = 10_000


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


class Authenticator:
    def __init__(self, store: KeyStore, admin_key: str | None, cache_s: float, log_prompts_default: bool) -> None:
        self.store = store
        self._admin_digest = store.hash(admin_key) if admin_key else None
        self.admin_record = KeyRecord(id=0, name="admin", prefix="", admin=True, log_prompts=log_prompts_default)
        self.cache_s = cache_s
        self._cache: dict[str, tuple[KeyRecord, float]] = {}  # digest -> (record, expiry)

    async def authenticate(self, authorization: str | None) -> KeyRecord:
        if not authorization:
            raise _unauthorized("no API key: send 'Authorization: Bearer <key>'")
        scheme, _, key = authorization.strip().partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _unauthorized("the Authorization header must be 'Bearer <key>'")
        if len(key) > 256:
            raise _unauthorized("invalid API key")
        digest = self.store.hash(key)
        if self._admin_digest is not None and hmac.compare_digest(digest, self._admin_digest):
            return self.admin_record
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        record = await asyncio.to_thread(self.store.lookup, key)
        if record is None:
            self._cache.pop(digest, None)
            raise _unauthorized("invalid or revoked API key")
        if len(self._cache) >= _CACHE_MAX:
            self._cache.clear()
        self._cache[digest] = (record, now + self.cache_s)
        return record

    def forget(self, key_id: int) -> None:
        """Drop a key from the cache (revoked through the admin API)."""
        for digest, (rec, _) in list(self._cache.items()):
            if rec.id == key_id:
                del self._cache[digest]
