"""The gateway's SQL database (SQLAlchemy 2 Core): API keys and the request log.

SQLite (WAL, the default, under ``var/``) or any SQLAlchemy URL (PostgreSQL for more than
one gateway, e.g. ``postgresql+psycopg://user:password@host/db``). Every call here is
blocking: the app runs them in worker threads. Values are kept within what every backend
stores (``INT_MIN``..``INT_MAX`` for integers, text without NUL): PostgreSQL refuses the rest.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    Engine,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    create_engine,
    event,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.exc import IntegrityError

from common.db import rebuild_with_autoincrement

__all__ = ["INT_MAX", "INT_MIN", "api_keys", "check_text", "get_pepper", "meta", "metadata", "open_db",
           "rebuild_with_autoincrement", "requests", "safe_url"]

INT_MIN, INT_MAX = -(2**31), 2**31 - 1  # an SQL INTEGER column (PostgreSQL int4)
_SCHEMA_LOCK = 0x5374726174610001  # pg_advisory_xact_lock key: gateways starting at once create tables in turn

metadata = MetaData()

api_keys = Table(
    "api_keys", metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(128), nullable=False),
    Column("hash", String(64), nullable=False, unique=True),  # hex HMAC-SHA256(pepper, key)
    Column("prefix", String(16), nullable=False),  # 8 characters after "sk-strata-", for display
    Column("admin", Boolean, nullable=False, default=False),
    Column("rpm", Integer, nullable=True),  # None: unlimited
    Column("tpm", Integer, nullable=True),
    Column("max_concurrent", Integer, nullable=True),
    Column("max_tokens", Integer, nullable=True),  # per-request cap on max_tokens (clamped)
    Column("default_max_tokens", Integer, nullable=True),  # max_tokens of a request naming none (None: gateway's)
    Column("log_prompts", Boolean, nullable=False, default=False),
    Column("limits", Text, nullable=True),  # JSON {limit name: value or null (unlimited)}: the key's own limits
    Column("created", Float, nullable=False),  # unix seconds
    Column("revoked", Float, nullable=True),  # unix seconds; None: active
    # ids are never reused: a key's id owns its sessions and collections (see rebuild_with_autoincrement)
    sqlite_autoincrement=True,
)

requests = Table(
    "requests", metadata,
    Column("id", String(64), primary_key=True),  # the gateway request id (gw-...)
    Column("time", Float, nullable=False),  # arrival, unix seconds
    Column("key_id", Integer, nullable=True),  # 0: the admin key from env/file
    Column("lane", String(32), nullable=True),
    Column("model", String(256), nullable=True),
    Column("endpoint", String(64), nullable=False),
    Column("stream", Boolean, nullable=False),
    Column("prompt_tokens", Integer, nullable=True),
    Column("cached_tokens", Integer, nullable=True),
    Column("completion_tokens", Integer, nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("duration_ms", Float, nullable=False),
    Column("status", Integer, nullable=False),
    Column("error_type", String(64), nullable=True),
    Column("clamped_from", Integer, nullable=True),
    Column("clamped_to", Integer, nullable=True),
    Column("retried", Boolean, nullable=False, default=False),
    Column("prompt_text", Text, nullable=True),  # only for keys with log_prompts
    Column("response_text", Text, nullable=True),
    Column("memory", String(128), nullable=True),  # session memory counts of the composed prompt
    Index("ix_requests_time", "time"),
    Index("ix_requests_key_time", "key_id", "time"),
)

meta = Table(
    "gateway_meta", metadata,
    Column("key", String(64), primary_key=True),
    Column("value", String(256), nullable=False),
)


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")  # readers (admin queries) never block the log writer
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute("PRAGMA busy_timeout=5000")
    cur.close()


def check_text(value: str) -> str:
    """``value`` if every backend can store it (PostgreSQL refuses NUL and unencodable surrogates)."""
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (a lone surrogate is not)") from None
    return value


def safe_url(url: str) -> str:
    """A database URL without its password (for logs and error messages)."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparsable url>"


def open_db(url: str) -> Engine:
    """An engine with the tables created. A new SQLite file is created 0600 and a directory made for it
    0700 (key hashes live there; an existing directory keeps its mode);
    the WAL pragmas and the file mode are for SQLite only."""
    u = make_url(url)
    is_sqlite = u.get_backend_name() == "sqlite"
    db_path: Path | None = None
    if is_sqlite and u.database and u.database != ":memory:" and not u.database.startswith("file:"):
        db_path = Path(u.database)
        if not db_path.parent.exists():
            db_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(db_path.parent, 0o700)  # whatever the umask
        if not db_path.exists():
            fd = os.open(db_path, os.O_CREAT | os.O_WRONLY, 0o600)  # key hashes live here
            os.close(fd)
    # hide_parameters: a failed insert must not print prompt text into the server log
    engine = create_engine(url, pool_pre_ping=not is_sqlite, hide_parameters=True)
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_pragmas)
    with engine.begin() as conn:
        if u.get_backend_name() == "postgresql":
            # CREATE TABLE is not atomic with its existence check: two gateways starting on an empty
            # database would both create (one fails); the lock lasts until this transaction ends
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _SCHEMA_LOCK})
        elif is_sqlite and not conn.connection.driver_connection.in_transaction:
            # Python's sqlite3 runs DDL outside a transaction unless one is open: open it with the write lock,
            # so a table rebuild below is all or nothing and gateways starting together go in turn
            conn.exec_driver_sql("BEGIN IMMEDIATE")
        metadata.create_all(conn)
        _add_missing_columns(conn)
        rebuild_with_autoincrement(conn, [api_keys])
    return engine


def _add_missing_columns(conn: Connection) -> None:
    """Columns added since a table was first created (create_all never alters an existing table).
    Each must be nullable, so existing rows stay valid."""
    for table in (api_keys, requests):
        have = {c["name"] for c in inspect(conn).get_columns(table.name)}
        for col in table.columns:
            if col.name not in have:
                assert col.nullable, col.name
                kind = col.type.compile(dialect=conn.dialect)
                conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{col.name}" {kind}'))


def get_pepper(engine: Engine) -> bytes:
    """The per-install secret mixed into key hashes, created on first use and kept in the database.

    Keys are 256-bit random, so the hash needs no slow KDF; the pepper only makes a stolen
    hash table useless against key lists from another install.
    """
    query = select(meta.c.value).where(meta.c.key == "pepper")
    with engine.connect() as conn:
        value = conn.execute(query).scalar()
    if value is None:
        try:
            with engine.begin() as conn:
                conn.execute(insert(meta).values(key="pepper", value=secrets.token_hex(32)))
        except IntegrityError:  # another process created it first
            pass
        with engine.connect() as conn:
            value = conn.execute(query).scalar_one()
    return bytes.fromhex(value)
