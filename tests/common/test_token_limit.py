"""The completion-token limit's field: one rule (common.token_limit) that the lane's request models and the
gateway's window precheck both apply, so the gateway clamps the field the lane generates to."""

from __future__ import annotations

from typing import Any

import pytest

from common.token_limit import token_limit_field
from gateway.window import max_tokens_field
from lanes.protocol import ChatRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("fields", "want"), [
    ({}, "max_tokens"),
    ({"max_tokens": 5}, "max_tokens"),
    ({"max_completion_tokens": 7}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": 7}, "max_completion_tokens"),
    ({"max_tokens": 5, "max_completion_tokens": None}, "max_tokens"),
])
def test_chat_prefers_max_completion_tokens_in_lane_and_gateway(fields: dict[str, Any], want: str) -> None:
    assert token_limit_field(fields, chat=True) == want
    assert max_tokens_field(fields, "chat") == want
    req = ChatRequest(messages=MESSAGES, **fields)
    assert req.max_tokens_param == (want, fields.get(want))


def test_completion_has_only_max_tokens() -> None:
    fields = {"max_tokens": 5, "max_completion_tokens": 7}
    assert token_limit_field(fields, chat=False) == "max_tokens"
    assert max_tokens_field(fields, "completion") == "max_tokens"
    assert CompletionRequest(prompt="hi", max_tokens=5).max_tokens_param == ("max_tokens", 5)
