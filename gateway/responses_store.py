"""Stored answers of ``/v1/responses`` (``previous_response_id``, ``GET``/``DELETE /v1/responses/{id}``).

One row per response made with ``store`` true (the API's default), in the gateway's own database
beside the request log (the table is created with the others by ``gateway.db.open_db``). A row
holds the response object as the client got it and the conversation that continues from it (the
chat messages of the whole chain plus this answer, without ``instructions``, which OpenAI does
not carry over). Rows belong to the key that made them: another key's id is "not found". Rows
older than ``responses_retention_days`` are deleted hourly. Every call is blocking: the handlers
run them in worker threads.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy import Column, Engine, Float, Index, Integer, String, Table, Text, delete, insert, select

from gateway.db import metadata

__all__ = ["ResponseStore", "StoredResponse", "responses"]

responses = Table(
    "responses", metadata,
    Column("id", String(64), primary_key=True),  # resp_...
    Column("key_id", Integer, nullable=False),
    Column("created", Float, nullable=False),  # unix seconds
    Column("response", Text, nullable=False),  # the response object (JSON)
    Column("history", Text, nullable=False),  # the chat messages a follow-up continues from (JSON)
    Index("ix_responses_created", "created"),
)


class StoredResponse:
    def __init__(self, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        self.response = response
        self.history = history


class ResponseStore:
    def __init__(self, engine: Engine, retention_days: float) -> None:
        self.engine = engine
        self.retention_s = retention_days * 86400.0

    def put(self, key_id: int, response: dict[str, Any], history: list[dict[str, Any]]) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(responses).values(
                id=response["id"], key_id=key_id, created=time.time(),
                response=json.dumps(response, ensure_ascii=False), history=json.dumps(history, ensure_ascii=False)))

    def get(self, key_id: int, response_id: str) -> StoredResponse | None:
        """The key's own response ``response_id`` (None: unknown, expired or another key's)."""
        cutoff = time.time() - self.retention_s
        with self.engine.connect() as conn:
            row = conn.execute(select(responses.c.response, responses.c.history).where(
                responses.c.id == response_id, responses.c.key_id == key_id,
                responses.c.created >= cutoff)).first()
        if row is None:
            return None
        return StoredResponse(json.loads(row.response), json.loads(row.history))

    def delete(self, key_id: int, response_id: str) -> bool:
        with self.engine.begin() as conn:
            n = conn.execute(delete(responses).where(responses.c.id == response_id,
                                                     responses.c.key_id == key_id)).rowcount
        return bool(n)

    def purge(self, now: float | None = None) -> int:
        cutoff = (time.time() if now is None else now) - self.retention_s
        with self.engine.begin() as conn:
            return conn.execute(delete(responses).where(responses.c.created < cutoff)).rowcount or 0
