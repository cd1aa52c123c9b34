"""API keys: stored only as a peppered hash, looked up, revoked; the ``python -m gateway.keys`` CLI."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

import gateway.db
from gateway.db import open_db
from gateway.keys import KEY_PREFIX, KeySpec, KeyStore, main


def test_create_lookup_revoke(tmp_path: Path) -> None:
    db = tmp_path / "k.db"
    store = KeyStore(open_db(f"sqlite:///{db}"))
    key, rec = store.create(KeySpec(name="alice", rpm=10, log_prompts=None), log_prompts_default=True)
    assert key.startswith(KEY_PREFIX) and len(key) == len(KEY_PREFIX) + 43
    assert rec.prefix == key[len(KEY_PREFIX):][:8] and rec.log_prompts is True and rec.rpm == 10
    assert store.lookup(key) == rec
    assert store.lookup(key + "x") is None and store.lookup("sk-other") is None
    other, _ = store.create(KeySpec(name="bob"))
    assert other != key and store.lookup(other).name == "bob"  # type: ignore[union-attr]
    revoked = store.revoke(rec.id)
    assert revoked is not None and revoked.revoked is not None
    assert store.lookup(key) is None
    assert store.revoke(rec.id).revoked == revoked.revoked  # type: ignore[union-attr]
    assert store.revoke(999) is None
    store.engine.dispose()
    blob = b"".join(p.read_bytes() for p in tmp_path.glob("k.db*"))
    assert key.encode() not in blob and other.encode() not in blob
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600


def test_pepper_is_per_install(tmp_path: Path) -> None:
    s1 = KeyStore(open_db(f"sqlite:///{tmp_path / 'one.db'}"))
    s2 = KeyStore(open_db(f"sqlite:///{tmp_path / 'two.db'}"))
    assert s1.hash("sk-strata-same") != s2.hash("sk-strata-same")
    assert KeyStore(s1.engine).hash("sk-strata-same") == s1.hash("sk-strata-same")  # stable across restarts


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("STRATA_GATEWAY_")]:
        monkeypatch.delenv(var)
    db = ["--db-url", f"sqlite:///{tmp_path / 'cli.db'}"]
    assert main([*db, "create", "--name", "ops", "--admin", "--rpm", "30", "--max-concurrent", "2"]) == 0
    out, err = capsys.readouterr()
    key = out.strip()
    assert key.startswith(KEY_PREFIX) and "\n" not in key and "shown only this once" in err and key not in err
    assert main([*db, "create", "--name", "bot", "--log-prompts", "--default-max-tokens", "256", "--json"]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["log_prompts"] is True and made["key"].startswith(KEY_PREFIX) and made["default_max_tokens"] == 256
    assert main([*db, "list"]) == 0
    listing = capsys.readouterr().out
    assert "ops" in listing and "bot" in listing and key not in listing and made["key"] not in listing
    assert main([*db, "revoke", "1"]) == 0
    assert "revoked key id=1" in capsys.readouterr().out
    assert main([*db, "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["revoked"] is not None and rows[1]["revoked"] is None and rows[0]["admin"] is True
    assert main([*db, "revoke", "42"]) == 1
    assert main([*db, "create", "--name", "x", "--rpm", "0"]) == 2
    assert "--rpm" in capsys.readouterr().err
    assert main([*db, "create", "--name", "x", "--default-max-tokens", "0"]) == 2
    assert "--default-max-tokens" in capsys.readouterr().err


def test_key_ids_are_never_reused_after_a_delete(tmp_path: Path) -> None:
    """A key's id owns its sessions and collections: a key row deleted by hand must not hand its id (and with
    it that data) to the next key, as a plain SQLite INTEGER PRIMARY KEY would."""
    store = KeyStore(open_db(f"sqlite:///{tmp_path / 'k.db'}"))
    store.create(KeySpec(name="a"))
    _, top = store.create(KeySpec(name="b"))
    with store.engine.begin() as c:
        c.execute(text("DELETE FROM api_keys WHERE id = :i"), {"i": top.id})
    _, new = store.create(KeySpec(name="c"))
    assert new.id > top.id
    store.engine.dispose()


# api_keys as SQLite databases made before AUTOINCREMENT (and before default_max_tokens) hold it
_OLD_SQLITE = """
CREATE TABLE api_keys (id INTEGER NOT NULL, name VARCHAR(128) NOT NULL, hash VARCHAR(64) NOT NULL,
    prefix VARCHAR(16) NOT NULL, admin BOOLEAN NOT NULL, rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,
    max_tokens INTEGER, log_prompts BOOLEAN NOT NULL, created FLOAT NOT NULL, revoked FLOAT,
    PRIMARY KEY (id), UNIQUE (hash));
CREATE TABLE gateway_meta ("key" VARCHAR(64) NOT NULL, value VARCHAR(256) NOT NULL, PRIMARY KEY ("key"));
INSERT INTO gateway_meta VALUES ('pepper', '00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff');
INSERT INTO api_keys VALUES (2, 'kept', '{h2}', 'abcdefgh', 1, 10, NULL, 2, 64, 1, 1.5, NULL);
INSERT INTO api_keys VALUES (5, 'newest', '{h5}', 'ijklmnop', 0, NULL, 100, NULL, NULL, 0, 2.5, 3.5);
"""


def _old_sqlite(path: Path) -> None:
    import hashlib
    import hmac
    import sqlite3

    pepper = bytes.fromhex("00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff")
    h2, h5 = (hmac.new(pepper, k.encode(), hashlib.sha256).hexdigest() for k in ("sk-strata-two", "sk-strata-five"))
    with sqlite3.connect(path) as raw:
        raw.executescript(_OLD_SQLITE.format(h2=h2, h5=h5))


def test_an_old_sqlite_key_table_keeps_every_row_and_id(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    _old_sqlite(path)
    with sqlite3.connect(path) as c:
        before = c.execute("SELECT * FROM api_keys ORDER BY id").fetchall()
    store = KeyStore(open_db(f"sqlite:///{path}"))
    with sqlite3.connect(path) as c:
        after = c.execute("SELECT id, name, hash, prefix, admin, rpm, tpm, max_concurrent, max_tokens, log_prompts, "
                          "created, revoked FROM api_keys ORDER BY id").fetchall()
        ddl = dict(c.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'").fetchall())
        seqs = dict(c.execute("SELECT name, seq FROM sqlite_sequence").fetchall())
    assert after == before  # every row, every id
    assert "AUTOINCREMENT" in ddl["api_keys"] and "default_max_tokens" in ddl["api_keys"]
    assert not any(n.endswith("__rebuild") for n in ddl) and seqs == {"api_keys": 5}
    rec = store.lookup("sk-strata-two")  # the stored hashes still find their keys
    assert rec is not None and (rec.id, rec.name, rec.rpm, rec.max_concurrent) == (2, "kept", 10, 2)
    with pytest.raises(IntegrityError), store.engine.begin() as c:  # hash stayed unique
        c.execute(text("INSERT INTO api_keys (name, hash, prefix, admin, log_prompts, created) "
                       "SELECT 'dup', hash, 'x', 0, 0, 0 FROM api_keys WHERE id = 2"))
    with store.engine.begin() as c:
        c.execute(text("DELETE FROM api_keys WHERE id = 5"))  # the highest id, which the old table handed out again
    assert store.create(KeySpec(name="next"))[1].id == 6
    store.engine.dispose()
    again = open_db(f"sqlite:///{path}")  # a second start: nothing left to rebuild
    with again.connect() as c:
        assert c.execute(text("SELECT count(*) FROM api_keys")).scalar_one() == 2
    again.dispose()


def test_a_failed_key_table_rebuild_leaves_the_database_as_it_was(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema creation, new columns and the rebuild are one transaction: a failure after the rebuild leaves the
    old table (rows, ids, DDL) intact, and the next start migrates."""
    import sqlite3

    path = tmp_path / "old.db"
    _old_sqlite(path)

    def state() -> list[tuple[object, ...]]:
        with sqlite3.connect(path) as c:
            return c.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall() + \
                c.execute("SELECT * FROM api_keys ORDER BY id").fetchall()

    before = state()
    rebuild = gateway.db.rebuild_with_autoincrement

    def crash(conn: object, tables: object) -> None:
        assert rebuild(conn, tables) == ["api_keys"]  # type: ignore[arg-type]
        raise RuntimeError("killed half way")

    monkeypatch.setattr(gateway.db, "rebuild_with_autoincrement", crash)
    with pytest.raises(RuntimeError, match="half way"):
        open_db(f"sqlite:///{path}")
    assert state() == before
    monkeypatch.undo()
    store = KeyStore(open_db(f"sqlite:///{path}"))
    assert [k.id for k in store.list()] == [2, 5]
    store.engine.dispose()
