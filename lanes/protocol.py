"""Request bodies of the lane API (pydantic), and their translation to engine parameters.

Unknown fields are tolerated (OpenAI clients send extras such as ``user`` metadata or new
options); fields we cannot honour and that would change the answer (``tools``, ``logit_bias``,
``echo``, ``suffix``, a JSON ``response_format``, ``best_of`` > ``n``) are rejected with a 400
naming them. Value ranges of sampling parameters are checked by ``SamplingParams.parse``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling import SamplingParams, SamplingParamsError
from lanes.errors import APIError

__all__ = ["MAX_CHOICES", "MAX_N", "ChatRequest", "CompletionRequest", "DetokenizeRequest", "TokenizeRequest",
           "parse_body"]

MAX_N = 16  # choices per prompt
MAX_CHOICES = 64  # engine requests one HTTP request may start (prompts x n)

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens")


class _Body(BaseModel):
    # strict: "0.5" is not a number and 1 is not true; extra: clients send fields we do not know
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = None


class _GenerationBody(_Body):
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_N)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _common_checks(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias",
                           code="unsupported_parameter")

    def _sampling_kwargs(self) -> dict[str, Any]:
        return {k: v for k in _SAMPLING_KEYS if (v := getattr(self, k)) is not None}


class ChatRequest(_GenerationBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @property
    def max_tokens_param(self) -> tuple[str, int | None]:
        """The client's own name for the token limit (for error messages) and its value."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    def check(self) -> None:
        self._common_checks()
        if self.tools:
            raise APIError(400, "tools (function calling) are not supported by this server", param="tools",
                           code="unsupported_parameter")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format",
                           code="unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_GenerationBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def max_tokens_param(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    def check(self) -> None:
        self._common_checks()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo", code="unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix (insertion) is not supported by this server", param="suffix",
                           code="unsupported_parameter")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError(400, "best_of is not supported (it must equal n)", param="best_of",
                           code="unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def engine_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
    skip_special_tokens: bool = False


M = TypeVar("M", bound=BaseModel)


_EXPECTED = {  # union-typed fields: one plain sentence instead of one pydantic error per branch
    "stop": "a string or a list of strings",
    "prompt": "a string, a list of token ids, or a list of strings or of token-id lists",
}


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _path(node: Any, loc: list[Any]) -> str:
    """``[0].content``-style suffix of an error location: real list indexes and object keys only
    (pydantic adds type-branch tags such as ``str`` or ``list[int]`` for unions)."""
    out = []
    for seg in loc:
        if isinstance(seg, int) and isinstance(node, list) and 0 <= seg < len(node):
            out.append(f"[{seg}]")
            node = node[seg]
        elif isinstance(seg, str) and isinstance(node, dict) and seg in node:
            out.append(f".{seg}")
            node = node[seg]
    return "".join(out)


def parse_body(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; the first problem becomes a 400 naming its parameter."""
    if not isinstance(body, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors()
        err = errors[0]
        loc = [x for x in err.get("loc", ())]
        param = str(loc[0]) if loc else None
        if param is None:
            raise APIError(400, f"invalid request body: {err.get('msg', 'invalid value')}") from None
        if err.get("type") == "missing":
            raise APIError(400, f"missing required parameter {param!r}", param=param) from None
        if param in _EXPECTED and len([x for x in errors if x.get("loc", ())[:1] == (param,)]) > 1:
            raise APIError(400, f"invalid {param}: expected {_EXPECTED[param]}, got {_short(body.get(param))}",
                           param=param) from None
        where = param + _path(body.get(param), loc[1:])
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"invalid {where}: {msg} (got {_short(err.get('input'))})", param=param) from None


def sampling_params(req: ChatRequest | CompletionRequest, max_tokens: int) -> SamplingParams:
    """Engine parameters for one choice; errors name the client's parameter."""
    kw = req._sampling_kwargs()
    kw["max_tokens"] = max_tokens
    kw["logprobs"] = req.engine_logprobs()
    try:
        return SamplingParams.parse(**kw)
    except SamplingParamsError as e:
        param = e.param
        if param == "max_tokens":
            param = req.max_tokens_param[0]
        elif param == "logprobs" and isinstance(req, ChatRequest):
            param = "top_logprobs"
        raise APIError(400, e.message, param=param) from None
