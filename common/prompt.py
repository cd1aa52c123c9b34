"""How a chat or a prompt becomes token ids: the lane's rendering, shared with the gateway's local count.

The lane's ``/tokenize`` and its generation requests render and encode through
:func:`chat_ids` / :func:`text_ids`; the gateway's window precheck (gateway/tokencount.py)
calls the same functions with a tokenizer and template built from the same metadata (served by
the lane at ``GET /v1/lane/tokenizer``), so both count the same tokens by construction, not by
a second implementation. Like all of ``common`` it imports neither the engine nor the lanes: the
gateway must import without the C build (tests/common/test_layering.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, Protocol

from common.errors import APIError

__all__ = ["ROLES", "TOKENIZER_PREFIX", "check_messages", "check_text", "chat_ids", "normalize_messages", "short",
           "text_ids", "tokenizer_document"]

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TOKENIZER_PREFIX = "tokenizer."  # the GGUF metadata keys the tokenizer and the chat template are built from


class _Tokenizer(Protocol):
    def encode(self, text: str, add_special: bool = ..., parse_special: bool = ...) -> list[int]: ...


class _Template(Protocol):
    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = ..., **extra: Any) -> str: ...

    def render_with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          add_generation_prompt: bool = ...) -> str: ...


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_text(value: Any, where: str, param: str) -> None:
    """Every string inside ``value`` must be encodable Unicode (no lone UTF-16 surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise APIError(400, f"{where} contains text that is not valid Unicode (a lone UTF-16 surrogate "
                           f"at character {e.start})", param=param, code="invalid_text") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_text(k, where, param)
            check_text(v, f"{where}.{k}", param)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_text(v, f"{where}[{i}]", param)


def check_messages(messages: list[dict[str, Any]]) -> None:
    """Known roles and valid Unicode text only; ``tool`` messages need a ``tool_call_id``."""
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"messages[{i}].role must be a string, got {short(role)}", param="messages")
        if role not in ROLES:
            raise APIError(400, f"messages[{i}]: unknown role {short(role)} (expected one of "
                           f"{', '.join(ROLES)})", param="messages", code="invalid_role")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise APIError(400, f"messages[{i}]: a tool message needs a string tool_call_id", param="messages")
        check_text(msg, f"messages[{i}]", "messages")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Text content parts become one string (templates expect strings); other parts are refused."""
    out = []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content[{j}]: only text content parts are supported",
                                   param="messages")
                texts.append(part["text"])
            msg = {**msg, "content": "\n".join(texts)}
        out.append(msg)
    return out


def chat_ids(tokenizer: _Tokenizer, template: _Template, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None, add_generation_prompt: bool) -> list[int]:
    """The prompt ids of checked, normalised ``messages``: the tool-aware rendering when tools are offered
    or the conversation already holds tool calls or results, the model's own template otherwise."""
    if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
        text = template.render_with_tools(messages, tools, add_generation_prompt)
    else:
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
    return tokenizer.encode(text, add_special=True, parse_special=True)


def text_ids(tokenizer: _Tokenizer, text: str, add_special: bool = True) -> list[int]:
    """A completion prompt's ids (special-token texts in it are parsed as the special tokens)."""
    return tokenizer.encode(text, add_special, True)


def tokenizer_document(metadata: Mapping[str, Any]) -> tuple[bytes, str]:
    """The model's ``tokenizer.*`` metadata as canonical JSON and its SHA-256: what the lane serves at
    ``GET /v1/lane/tokenizer`` and names in its model card, so a gateway can tell when a lane's tokenizer
    changed (another model) without fetching it again."""
    md = {k: v for k, v in metadata.items() if k.startswith(TOKENIZER_PREFIX)}
    raw = json.dumps(md, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()
    return raw, hashlib.sha256(raw).hexdigest()
