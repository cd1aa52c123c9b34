"""Memory test fixtures: a store on SQLite (a temp file) and on PostgreSQL (a fresh schema per test).

PostgreSQL comes from ``STRATA_TEST_PG_URL`` (``.ci/run`` starts a server and sets it); without it
the PostgreSQL cases skip, except in CI (``CI`` set), where they fail.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from memory.store import MemoryStore, open_engine
from tests.pg import fresh_schema, server_url


@pytest.fixture
def pg_schema_url() -> Iterator[str]:
    """A URL whose search_path is a fresh schema, dropped at the end."""
    with fresh_schema(server_url("session memory"), "strata_mem") as (url, _, _):
        yield url


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
