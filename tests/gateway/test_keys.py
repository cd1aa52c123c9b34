"""API keys: stored only as a peppered hash, looked up, revoked; the ``python -m gateway.keys`` CLI."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

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
