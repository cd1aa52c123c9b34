"""Which field carries a request's completion-token limit: one rule for the lane (which generates to it) and
the gateway's window precheck (which clamps it), so both read and name the same field."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["token_limit_field"]


def token_limit_field(body: Mapping[str, Any], *, chat: bool) -> str:
    """The client's own name for the limit: a chat request's ``max_completion_tokens`` (OpenAI's current name)
    wins over ``max_tokens`` when it is set; a completion request has only ``max_tokens``."""
    if chat and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return "max_tokens"
