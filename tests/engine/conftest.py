"""Shared fixtures for engine tests: the default dense GGUF, its metadata, llama.cpp as oracle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.assets import smollm2_dense_gguf
from engine.default_model import build_default_model, default_model_path
from engine.engine import Engine


@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    return smollm2_dense_gguf()


@pytest.fixture(scope="session")
def smollm_metadata(smollm_gguf_path: Path) -> dict[str, Any]:
    """Every metadata field of the default GGUF as ``{key: field.contents()}``."""
    import gguf

    reader = gguf.GGUFReader(str(smollm_gguf_path))
    return {key: field.contents() for key, field in reader.fields.items()}


def _load_llama_vocab(path: Path | str) -> Any:
    """llama-cpp-python over a GGUF with only its vocabulary loaded: the tokenizer oracle.

    llama-cpp-python is a required test dependency: without it the oracle tests fail, never skip.
    """
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - environment problem
        pytest.fail(f"llama_cpp (llama-cpp-python) is required for the tokenizer oracle tests: {e}")
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def llama_vocab_loader() -> Callable[[Path | str], Any]:
    """``path -> llama_cpp.Llama(vocab_only=True)``, for GGUFs a test writes itself."""
    return _load_llama_vocab


@pytest.fixture(scope="session")
def smollm_llama(smollm_gguf_path: Path) -> Any:
    """Cached ``llama_cpp.Llama(vocab_only=True)`` for the default GGUF."""
    return _load_llama_vocab(smollm_gguf_path)


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
