"""Memory test fixtures: a store on SQLite (a temp file) and on PostgreSQL (a fresh schema per test).

PostgreSQL comes from ``STRATA_TEST_PG_URL`` (``.ci/run`` starts a server and sets it); without it
the PostgreSQL cases skip, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from memory.store import MemoryStore, open_engine

PG_ENV = "STRATA_TEST_PG_URL"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def pg_base_url() -> str:
    url = os.environ.get(PG_ENV, "").strip()
    if not url:
        why = f"{PG_ENV} is not set: no PostgreSQL server to test session memory against"
        if _in_ci():
            pytest.fail(f"{why}, and CI is set: CI must provide one (.ci/run runs .ci/postgres.sh)", pytrace=False)
        pytest.skip(why)
    return url


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """A URL whose search_path is a fresh schema, dropped at the end."""
    base = pg_base_url()
    schema = f"strata_mem_{uuid.uuid4().hex[:12]}"
    admin = create_engine(base)
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'mem.db'}"
    return request.getfixturevalue("pg_schema_url")


@pytest.fixture
def store(db_url: str) -> Iterator[MemoryStore]:
    s = MemoryStore(open_engine(db_url))
    yield s
    s.engine.dispose()
