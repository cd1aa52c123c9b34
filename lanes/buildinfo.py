"""Identities a lane reports: the engine build and a cheap model fingerprint.

The build id lets the gateway and the lane-switch script tell two engine builds apart
(A/B rollouts): a hash of the compiled C extension plus the git revision when known.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["engine_build_id", "model_fingerprint"]

_REPO = Path(__file__).resolve().parent.parent


def _git_rev() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_REPO), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                             text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    rev = out.stdout.strip()
    return rev if out.returncode == 0 and rev else None


@functools.cache
def engine_build_id() -> str:
    """``strata-<sha256(_strata_c.so)[:12]>[-g<git rev>]``; computed once per process."""
    spec = importlib.util.find_spec("engine._strata_c")
    digest = "nobuild"
    if spec is not None and spec.origin:
        h = hashlib.sha256()
        with open(spec.origin, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()[:12]
    rev = _git_rev()
    return f"strata-{digest}" + (f"-g{rev}" if rev else "")


def model_fingerprint(path: Path) -> dict[str, Any]:
    """Path, size and sha256 of the first MiB: enough to tell files apart without reading GBs."""
    with open(path, "rb") as f:
        head = f.read(1 << 20)
    return {"path": str(path), "size": path.stat().st_size, "sha256_first_mib": hashlib.sha256(head).hexdigest()}
