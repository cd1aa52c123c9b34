"""API keys: creation (shown once), listing, revocation, lookup by hash; and their CLI.

    python -m gateway.keys create --name alice [--admin] [--rpm 60] [--tpm 100000] [--max-concurrent 4]
                                  [--max-tokens 2048] [--default-max-tokens 512] [--log-prompts]
                                  [--limit searches_per_minute=60 --limit uploads_per_minute=none ...] [--json]
    python -m gateway.keys list [--json]
    python -m gateway.keys revoke 3

A key is ``sk-strata-`` + 43 url-safe characters (32 random bytes). Only its HMAC-SHA256
under a per-install pepper is stored, with 8 characters after ``sk-strata-`` for display.
:func:`main` takes ``argv`` so the ``strata`` CLI can mount it as ``strata keys ...``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sqlalchemy import Engine, insert, select, update

from gateway.config import KEY_LIMITS
from gateway.db import INT_MAX, INT_MIN, api_keys, check_text, get_pepper, open_db, safe_url

__all__ = ["KEY_PREFIX", "KeyRecord", "KeySpec", "KeyStore", "main"]

KEY_PREFIX = "sk-strata-"
_MAX_KEY_LEN = 256  # anything longer is not ours; refuse before hashing


@dataclass(frozen=True)
class KeyRecord:
    """A key's settings (never its secret or hash). ``id`` 0 is the admin key from env/file."""

    id: int
    name: str
    prefix: str
    admin: bool = False
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_tokens: int | None = None
    default_max_tokens: int | None = None
    log_prompts: bool = False
    created: float = 0.0
    revoked: float | None = None
    limits: dict[str, int | None] = field(default_factory=dict)  # its own limits ([limits] names; None: unlimited)

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d["display"] = f"{KEY_PREFIX}{self.prefix}…" if self.prefix else "(admin key from environment/file)"
        return d


class KeySpec(BaseModel):
    """What a new key may do (the admin API's POST body; the CLI's flags)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1, max_length=128)
    admin: bool = False
    rpm: int | None = Field(None, ge=1, le=INT_MAX)  # le: an SQL INTEGER on every backend
    tpm: int | None = Field(None, ge=1, le=INT_MAX)
    max_concurrent: int | None = Field(None, ge=1, le=INT_MAX)
    max_tokens: int | None = Field(None, ge=1, le=INT_MAX)
    default_max_tokens: int | None = Field(None, ge=1, le=INT_MAX)  # None: the gateway's default_max_tokens
    log_prompts: bool | None = None  # None: the gateway's log_prompts_default
    limits: dict[str, int | None] | None = None  # [limits] names -> this key's value (None: unlimited)

    @field_validator("name")
    @classmethod
    def _storable(cls, v: str) -> str:
        return check_text(v)

    @field_validator("limits")
    @classmethod
    def _known_limits(cls, v: dict[str, int | None] | None) -> dict[str, int | None] | None:
        for name, value in (v or {}).items():
            if name not in KEY_LIMITS:
                raise ValueError(f"unknown limit {name!r} (known: {', '.join(KEY_LIMITS)})")
            if value is not None and not 1 <= value <= INT_MAX:
                raise ValueError(f"limit {name} must be from 1 to {INT_MAX}, or null (unlimited)")
        return v


def _record(row: Any) -> KeyRecord:
    return KeyRecord(id=row.id, name=row.name, prefix=row.prefix, admin=bool(row.admin), rpm=row.rpm,
                     tpm=row.tpm, max_concurrent=row.max_concurrent, max_tokens=row.max_tokens,
                     default_max_tokens=row.default_max_tokens,
                     log_prompts=bool(row.log_prompts), created=row.created, revoked=row.revoked,
                     limits=_limits(row.limits))


def _limits(raw: str | None) -> dict[str, int | None]:
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return {k: v for k, v in value.items() if k in KEY_LIMITS} if isinstance(value, dict) else {}


_COLUMNS = [c for c in api_keys.c if c.name != "hash"]


class KeyStore:
    """Blocking database access for keys (the app calls it from worker threads)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pepper = get_pepper(engine)

    def hash(self, key: str) -> str:
        return hmac.new(self._pepper, key.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()

    def create(self, spec: KeySpec, log_prompts_default: bool = False) -> tuple[str, KeyRecord]:
        """A new key: the secret (to show once) and its record."""
        body = secrets.token_urlsafe(32)
        key = KEY_PREFIX + body
        values = dict(name=spec.name, hash=self.hash(key), prefix=body[:8], admin=spec.admin, rpm=spec.rpm,
                      tpm=spec.tpm, max_concurrent=spec.max_concurrent, max_tokens=spec.max_tokens,
                      default_max_tokens=spec.default_max_tokens,
                      log_prompts=log_prompts_default if spec.log_prompts is None else spec.log_prompts,
                      created=time.time(), revoked=None)
        limits = dict(spec.limits or {})
        with self.engine.begin() as conn:
            key_id = conn.execute(insert(api_keys).values(**values, limits=json.dumps(limits) if limits else None)
                                  ).inserted_primary_key[0]
        values.pop("hash")
        return key, KeyRecord(id=int(key_id), **values, limits=limits)

    def list(self) -> list[KeyRecord]:
        with self.engine.connect() as conn:
            return [_record(r) for r in conn.execute(select(*_COLUMNS).order_by(api_keys.c.id))]

    def get(self, key_id: int) -> KeyRecord | None:
        if not INT_MIN <= key_id <= INT_MAX:  # no such id (and PostgreSQL refuses the comparison)
            return None
        with self.engine.connect() as conn:
            row = conn.execute(select(*_COLUMNS).where(api_keys.c.id == key_id)).first()
        return _record(row) if row is not None else None

    def revoke(self, key_id: int) -> KeyRecord | None:
        """Revoke a key (idempotent: an already revoked key keeps its first revocation time)."""
        if not INT_MIN <= key_id <= INT_MAX:
            return None
        with self.engine.begin() as conn:
            conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked.is_(None))
                         .values(revoked=time.time()))
        return self.get(key_id)

    def lookup(self, key: str) -> KeyRecord | None:
        """The active key with this secret, or None (unknown, malformed or revoked)."""
        if not key.startswith(KEY_PREFIX) or len(key) > _MAX_KEY_LEN:
            return None
        return self.lookup_hash(self.hash(key))

    def lookup_hash(self, digest: str) -> KeyRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(*_COLUMNS).where(api_keys.c.hash == digest)).first()
        if row is None or row.revoked is not None:
            return None
        return _record(row)


# ---------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway.keys", description="Strata gateway API keys")
    p.add_argument("--config", type=Path, help="gateway TOML config (for db_url and log_prompts_default)")
    p.add_argument("--db-url", help="SQLAlchemy URL of the gateway database (overrides the config)")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("create", help="create a key and print it once")
    c.add_argument("--name", required=True)
    c.add_argument("--admin", action="store_true", help="may use /v1/admin/*")
    c.add_argument("--rpm", type=int, help="requests per minute (default: the gateway's [limits] rpm)")
    c.add_argument("--tpm", type=int, help="tokens (prompt + completion) per minute")
    c.add_argument("--max-concurrent", type=int, help="requests in flight at once")
    c.add_argument("--max-tokens", type=int, help="cap on max_tokens per request (larger values are clamped)")
    c.add_argument("--default-max-tokens", type=int,
                   help="max_tokens of a request that names none (default: the gateway's default_max_tokens)")
    c.add_argument("--log-prompts", action="store_true", default=None,
                   help="keep prompt and response text in the request log for this key")
    c.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                   help=f"this key's own value of a [limits] limit (none: unlimited); names: {', '.join(KEY_LIMITS)}")
    c.add_argument("--json", action="store_true", help="print the key and its record as JSON")
    ls = sub.add_parser("list", help="list keys (never their secrets)")
    ls.add_argument("--json", action="store_true")
    r = sub.add_parser("revoke", help="revoke a key by id (a running gateway notices within key_cache_s)")
    r.add_argument("id", type=int)
    return p


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway.keys`` / ``strata keys``. Exit 0 ok, 1 no such key, 2 bad config or arguments."""
    from gateway.config import ConfigError, load_config

    args = _parser().parse_args(argv)
    try:
        cfg = load_config(args.config, os.environ, {"db_url": args.db_url})
    except ConfigError as e:
        print(f"strata keys: {e}", file=sys.stderr)
        return 2
    try:
        store = KeyStore(open_db(cfg.db_url))
    except Exception as e:  # a bad URL or an unreachable server: one line, no traceback
        print(f"strata keys: cannot open the database {safe_url(cfg.db_url)!r}: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 2
    try:
        if args.cmd == "create":
            try:
                limits: dict[str, int | None] = {}
                for item in args.limit:
                    name, _, value = item.partition("=")
                    if not value or (value.lower() != "none" and not value.isdigit()):
                        print(f"strata keys: --limit {item!r}: expected NAME=NUMBER or NAME=none", file=sys.stderr)
                        return 2
                    limits[name] = None if value.lower() == "none" else int(value)
                spec = KeySpec(name=args.name, admin=args.admin, rpm=args.rpm, tpm=args.tpm,
                               max_concurrent=args.max_concurrent, max_tokens=args.max_tokens,
                               default_max_tokens=args.default_max_tokens,
                               log_prompts=args.log_prompts, limits=limits or None)
            except ValidationError as e:
                problems = "; ".join(f"--{'-'.join(str(x) for x in err['loc']).replace('_', '-')}: {err['msg']}"
                                     for err in e.errors())
                print(f"strata keys: {problems}", file=sys.stderr)
                return 2
            key, rec = store.create(spec, cfg.log_prompts_default)
            if args.json:
                print(json.dumps({"key": key, **rec.public()}))
            else:
                print(key)
                print(f"created key id={rec.id} name={rec.name!r} {KEY_PREFIX}{rec.prefix}… admin={rec.admin}; "
                      "it is shown only this once: store it now", file=sys.stderr)
            return 0
        if args.cmd == "list":
            keys = store.list()
            if args.json:
                print(json.dumps([k.public() for k in keys]))
                return 0
            print(f"{'id':>4}  {'name':<20} {'key':<22} {'admin':<5} {'rpm':>6} {'tpm':>8} {'conc':>4} "
                  f"{'maxtok':>6} {'deftok':>6} {'logp':<4} {'created':<19}  revoked")
            for k in keys:
                print(f"{k.id:>4}  {k.name[:20]:<20} {KEY_PREFIX + k.prefix + '…':<22} {'yes' if k.admin else 'no':<5} "
                      f"{k.rpm or '-':>6} {k.tpm or '-':>8} {k.max_concurrent or '-':>4} {k.max_tokens or '-':>6} "
                      f"{k.default_max_tokens or '-':>6} {'yes' if k.log_prompts else 'no':<4} {_fmt_time(k.created):<19}  {_fmt_time(k.revoked)}")
            return 0
        rec = store.revoke(args.id)
        if rec is None:
            print(f"strata keys: no key with id {args.id}", file=sys.stderr)
            return 1
        print(f"revoked key id={rec.id} name={rec.name!r} at {_fmt_time(rec.revoked)}")
        return 0
    finally:
        store.engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
