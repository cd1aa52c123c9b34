"""The [rag] table of the gateway config: defaults, overrides, and one-line errors naming the right keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.documents.api import default_data_dir


def test_rag_table_from_toml_and_env(tmp_path: Path) -> None:
    f = tmp_path / "gw.toml"
    f.write_text("[rag]\ntop_k = 3\nmax_upload_bytes = 4096\n")
    cfg = load_config(f, env={"STRATA_GATEWAY_RAG": '{"top_k": 6}'})
    assert cfg.rag.top_k == 6 and cfg.rag.max_upload_bytes == 20 * 1024 * 1024  # env replaces the table
    cfg = load_config(f, env={})
    assert cfg.rag.top_k == 3 and cfg.rag.max_upload_bytes == 4096 and cfg.rag.enabled


def test_rag_errors_name_the_rag_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rag\.bogus=1 .*unknown key \(known: enabled, data_dir"):
        load_config(env={"STRATA_GATEWAY_RAG": '{"bogus": 1}'})
    with pytest.raises(ConfigError, match="chunk_overlap .* must be below chunk_tokens"):
        load_config(env={"STRATA_GATEWAY_RAG": '{"chunk_tokens": 32, "chunk_overlap": 32}'})


def test_default_data_dir_sits_beside_the_sqlite_file(tmp_path: Path) -> None:
    assert default_data_dir(f"sqlite:///{tmp_path / 'x' / 'gw.db'}") == (tmp_path / "x" / "rag").resolve()
    assert default_data_dir("postgresql+psycopg://u@h/db").parts[-2:] == ("var", "rag")
