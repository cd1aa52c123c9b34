"""The PostgreSQL server the storage tests run against, and a fresh schema per test.

``STRATA_TEST_PG_URL`` names the server: a ``postgresql+psycopg://user:password@host:port/db`` URL of a
database where the tests may create schemas (.ci/postgres.sh makes one in CI). Without the variable the
tests skip, except in CI (``CI`` set, as .ci/run does), where they fail: CI must provide it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

__all__ = ["PG_ENV", "fresh_schema", "server_url"]

PG_ENV = "STRATA_TEST_PG_URL"


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def server_url(what: str) -> str:
    """The server's URL; skips without one (a developer without PostgreSQL), fails in CI. ``what`` names what
    the skipped tests would have tested."""
    url = os.environ.get(PG_ENV, "").strip()
    if not url:
        why = f"{PG_ENV} is not set: no PostgreSQL server to test {what} against"
        if _in_ci():
            pytest.fail(f"{why}, and CI={os.environ['CI']!r}: CI must provide one (.ci/run runs .ci/postgres.sh)",
                        pytrace=False)
        pytest.skip(f"{why} (set it to postgresql+psycopg://user:password@127.0.0.1:5432/db to run these)")
    if make_url(url).get_backend_name() != "postgresql":
        pytest.fail(f"{PG_ENV} must be a postgresql+psycopg:// URL, got {make_url(url).drivername!r}", pytrace=False)
    return url


@contextmanager
def fresh_schema(server: str, prefix: str) -> Iterator[tuple[str, str, Engine]]:
    """A new schema on ``server``: (a URL whose ``search_path`` is that schema, its name, an engine on the
    plain URL for looking from outside); the schema and everything in it is dropped on the way out."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server)
    with admin.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    url = make_url(server).update_query_dict({"options": f"-csearch_path={schema}"})
    try:
        yield url.render_as_string(hide_password=False), schema, admin
    finally:
        with admin.begin() as c:
            c.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()
