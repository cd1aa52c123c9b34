"""A throwaway stack for ``make bench``: the repo's supervisord.conf rendered into a temp folder by
deploy/stack.py (state, logs, socket, SQLite database and a random 0600 admin key there; free loopback
ports; one core per lane), run with the venv's supervisord, ready when both lanes answer /health and the
gateway sees them ready; shut down through supervisorctl on the way out.

The repo's lane and gateway files are the source: only ports, cores, the KV size and state paths
change, so the bench measures what ``make run`` serves.
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

if (_root := str(Path(__file__).resolve().parents[2])) not in sys.path:  # deploy/ is not an installed package
    sys.path.append(_root)

from deploy.stack import (  # noqa: E402
    PROGRAMS,
    REPO,
    StackError,
    Supervised,
    free_port,
    one_core_each,
    render,
    supervised,
)

__all__ = ["REPO", "Stack", "StackError", "free_port", "throwaway_stack"]

Stack = Supervised


@contextlib.contextmanager
def throwaway_stack(tmp: Path, kv_tokens: int = 4096, timeout: float = 180.0,
                    gateway: Mapping[str, Any] | None = None) -> Iterator[Stack]:
    """Both lanes and the gateway under supervisord in ``tmp``; shut down (and checked) on the way out.
    ``gateway``: more settings of the gateway's file (``db_url`` of a PostgreSQL database, ...)."""
    from engine.default_model import build_default_model, default_model_path

    build_default_model(default_model_path())  # once, before two lanes would race to build it
    ports = {p: free_port() for p in (*PROGRAMS, "gateway")}
    cores = one_core_each()
    key = "bench-admin-" + secrets.token_urlsafe(24)
    # a window-long prompt on a one-core lane: 8,192 tokens took ~130 s to the first token with a
    # neighbour on the other core, past the 120 s default (the gateway then retried on the other
    # lane and failed there too)
    conf = render(tmp, ports, key, {p: {"cores": cores[p], "kv_tokens": kv_tokens, "ping_interval_s": 1.0}
                                    for p in PROGRAMS},
                  gateway={"shutdown_timeout_s": 5.0, "first_token_timeout_s": max(120.0, 0.06 * kv_tokens),
                           **(gateway or {})})
    with supervised(Supervised(tmp, conf, ports, key), timeout) as st:
        yield st
