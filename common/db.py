"""SQL helpers shared by the gateway's tables (gateway.db) and session memory's (memory.store).

SQLAlchemy 2 Core; every call is blocking (callers run them in worker threads).
"""

from __future__ import annotations

from sqlalchemy import MetaData, Table, inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.schema import CreateTable

__all__ = ["rebuild_with_autoincrement"]


def rebuild_with_autoincrement(conn: Connection, tables: list[Table]) -> list[str]:
    """SQLite: rebuild each of ``tables`` that exists without AUTOINCREMENT; returns the names rebuilt.

    A plain ``INTEGER PRIMARY KEY`` hands a deleted highest id to the next row, so whatever refers
    to that id (a key's sessions and collections, a session's per-gateway state) would pass to a
    new row. The rebuild keeps every row and id (the columns both definitions have), the table's
    constraints and its indexes (under their own names), and starts the table's sequence at its
    highest id. Run it inside one transaction (SQLite: ``BEGIN IMMEDIATE``) so that a failure
    leaves the old table. Not SQLite: nothing to do (PostgreSQL's sequences never go back).
    """
    if conn.dialect.name != "sqlite":
        return []
    done = []
    for t in tables:
        ddl = conn.execute(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = :n"),
                           {"n": t.name}).scalar()
        if ddl is None or "AUTOINCREMENT" in ddl.upper():
            continue
        assert t.dialect_options["sqlite"]["autoincrement"], t.name
        new = t.to_metadata(MetaData(), name=f"{t.name}__rebuild")
        have = {c["name"] for c in inspect(conn).get_columns(t.name)}
        conn.execute(text(f'DROP TABLE IF EXISTS "{new.name}"'))
        conn.execute(CreateTable(new))  # the table alone: its indexes are made below, under the old names
        cols = ", ".join(f'"{c.name}"' for c in t.columns if c.name in have)
        conn.execute(text(f'INSERT INTO "{new.name}" ({cols}) SELECT {cols} FROM "{t.name}"'))
        conn.execute(text(f'DROP TABLE "{t.name}"'))
        conn.execute(text(f'ALTER TABLE "{new.name}" RENAME TO "{t.name}"'))
        pk = next(iter(t.primary_key.columns)).name
        conn.execute(text("DELETE FROM sqlite_sequence WHERE name IN (:a, :b)"), {"a": t.name, "b": new.name})
        conn.execute(text(f'INSERT INTO sqlite_sequence (name, seq) SELECT :n, COALESCE(MAX("{pk}"), 0) '
                          f'FROM "{t.name}"'), {"n": t.name})
        for ix in t.indexes:
            ix.create(conn, checkfirst=True)
        done.append(t.name)
    return done
