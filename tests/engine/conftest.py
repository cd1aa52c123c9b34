"""Shared fixtures for engine tests: the default MoE model and one engine on it (the dense GGUF, its
metadata and llama.cpp as oracle are in tests/conftest.py, shared with tests/common)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine
from tests.engine.gguf_factory import make_tiny_gguf
from tests.engine.parity import open_llama


# The default MoE model and one engine on it per module (the scheduler and constraint tests). Modules
# that need another model or engine settings define their own ``model_path`` / ``engine``.
@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_default_model(default_model_path())


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[Engine]:
    eng = Engine.open(model_path, threads=2, kv_tokens=8192)
    yield eng
    eng.close()


# A 2-layer random Q8_0 model of TINY_VOCAB ids (cheap on the CPU) and one engine on it (1 thread, 1,024 tokens
# in blocks of 16) per module: the greedy-pick, overlap and scheduler tests.
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def eng(tiny_path: Path) -> Iterator[Engine]:
    e = Engine.open(tiny_path, threads=1, kv_tokens=1024, block_size=16)
    yield e
    e.close()


# llama.cpp (the oracle) on the module's `variant` file: the parity modules' `variant` fixtures yield a tuple
# whose last item is the GGUF path.
@pytest.fixture(scope="module")
def llama(variant: tuple) -> Iterator[Any]:
    llm = open_llama(variant[-1])
    yield llm
    llm.close()
