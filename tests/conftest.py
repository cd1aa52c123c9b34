"""Suite-wide collection order (the longest test files first) and the fixtures every directory shares.

``make test`` runs two pytest-xdist workers with ``--dist loadfile --no-loadscope-reorder``: one
file is one unit of work, handed out in collection order. xdist's own order (most tests first)
put the few-but-long integration files last, so the run ended with one worker busy for minutes
while the other idled. Starting the long files first lets the many short files fill in behind
them. The list comes from CI's ``--durations`` output (seconds per file, setup included, at
2-core CI speed); a stale entry costs only some parallelism, never a result.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

# slowest first; each ~30 s or more of one worker in CI (seconds: the fresh-clone runs of session 7, setup
# included; the documents files vary most: the first of them on a worker starts its embedding model)
LONG_FILES = (
    "tests/integration/test_memory.py",  # ~200 s
    "tests/integration/test_gateway_stack.py",  # ~135 s
    "tests/engine/test_gpu_cpu_side.py",  # ~125 s (the CUDA compile check, where nvcc exists)
    "tests/integration/test_rag.py",  # ~100 s
    "tests/gateway/documents/test_embed_process.py",  # 25-145 s
    "tests/lanes/test_structured.py",  # ~60 s
    "tests/common/test_layering.py",  # 45-80 s (fresh interpreters importing the gateway)
    "tests/integration/test_web_ui.py",  # ~55 s
    "tests/gateway/documents/test_embed_backends.py",  # ~55 s
    "tests/memory/test_durability.py",  # ~50 s
    "tests/gateway/documents/test_embed_crash.py",  # 20-55 s
    "tests/integration/test_supervisord.py",  # ~40 s
    "tests/engine/test_default_model.py",  # ~35 s
    "tests/integration/test_engine_failure_stack.py",  # ~30 s
    "tests/engine/test_gguf_fuzz.py",  # ~30 s
    "tests/engine/test_loading.py",  # ~30 s
)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONG_FILES)}
    per_file: dict[str, int] = {}
    for item in items:
        per_file[item.location[0]] = per_file.get(item.location[0], 0) + 1
    order = {id(item): i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        path = item.location[0]  # relative to rootdir, '/'-separated
        # the long files by rank; after them xdist's default (files with more tests first)
        return (rank.get(path, len(rank)), -per_file[path], order[id(item)])

    items.sort(key=key)


# The default dense GGUF, its metadata and llama.cpp as the tokenizer oracle: the engine's tests and
# the tokenizer / chat template tests of tests/common.
@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    from engine.assets import smollm2_dense_gguf  # here, not at the top: gateway tests need no engine

    return smollm2_dense_gguf()


@pytest.fixture(scope="session")
def smollm_metadata(smollm_gguf_path: Path) -> dict[str, Any]:
    """Every metadata field of the default GGUF as ``{key: field.contents()}`` of gguf-py's reader, read by
    common/gguf_meta.py (0.35 s instead of gguf-py's 5 s; tests/engine/test_gguf_reader.py holds the two equal)."""
    from common.gguf_meta import read_metadata

    return read_metadata(smollm_gguf_path)


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


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """One HTTP client session per test module (the lane and gateway tests' requests)."""
    async with aiohttp.ClientSession() as s:
        yield s
