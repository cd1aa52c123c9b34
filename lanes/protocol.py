"""Request bodies of the lane API (pydantic), and their translation to engine parameters.

Unknown fields are tolerated (OpenAI clients send extras such as ``user`` metadata or new
options); fields we cannot honour and that would change the answer (``echo``, ``suffix``,
``best_of`` > ``n``) are rejected with a 400 naming them. Value ranges of sampling parameters
are checked by ``SamplingParams.parse``.

Structured output: ``response_format`` (``json_object``, ``json_schema``) and ``tools`` with a
``tool_choice`` of ``required``, a named function, ``allowed_tools`` or ``auto`` become a grammar
(engine.constraints, lanes.tools) the engine enforces token by token; object schemas that leave
``additionalProperties`` unsaid are closed first (lanes.schemas). A tool call is generated as ``{"name": ...,
"arguments": {...}}`` (several as a JSON array unless ``parallel_tool_calls`` is false) and
returned as ``message.tool_calls``; with ``auto`` the answer may instead be text (see
docs/gateway.md). A model whose format has a tool-call syntax of its own (gpt-oss's harmony,
GLM-4.5: ``native_tool_calls``) answers ``auto`` unconstrained, in that syntax (lanes/chat_parsers.py).

Strict input: message roles are OpenAI's (``system``, ``developer``, ``user``, ``assistant``,
``tool``, ``function``), anything else is a 400 naming it; text that is not valid Unicode (a lone
UTF-16 surrogate escaped in the JSON) is a 400 naming where it is.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from common.prompt import check_messages, check_text
from common.prompt import short as _short
from common.token_limit import token_limit_field
from engine.constraints import GrammarError, json_schema_grammar
from engine.sampling import SamplingParams, SamplingParamsError
from lanes.errors import APIError
from lanes.schemas import close_objects
from lanes.tools import tools_grammar

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
        self.engine_logit_bias()

    def engine_logit_bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (JSON object keys are strings)."""
        out: dict[int, float] = {}
        for k, v in (self.logit_bias or {}).items():
            try:
                tid = int(k)
            except ValueError:
                raise APIError(400, f"invalid logit_bias: key {_short(k)} is not a token id",
                               param="logit_bias") from None
            if tid < 0:
                raise APIError(400, f"invalid logit_bias: token id {tid} must be >= 0", param="logit_bias")
            out[tid] = v
        return out

    def grammar(self) -> tuple[str | None, str]:
        """The llguidance grammar this request is decoded under (None: free text) and the
        parameter it comes from (for error messages)."""
        return None, "response_format"

    def _sampling_kwargs(self) -> dict[str, Any]:
        kw = {k: v for k in _SAMPLING_KEYS if (v := getattr(self, k)) is not None}
        if self.logit_bias:
            kw["logit_bias"] = self.engine_logit_bias()
        grammar, _ = self.grammar()
        if grammar is not None:
            kw["grammar"] = grammar
        return kw


def _choice_name(choice: Any) -> str | None:
    """The function a tool_choice entry names: ``{"function": {"name"}}`` (chat) or ``{"name"}`` (Responses)."""
    if not isinstance(choice, dict):
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else choice.get("name")
    return name if isinstance(name, str) and name else None


def _tool_names(tools: list[Any]) -> list[str]:
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                           param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, f"tools[{i}].function.name must be a non-empty string", param="tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        names.append(name)
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    return names


class ChatRequest(_GenerationBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # None: true (OpenAI's default)
    response_format: dict[str, Any] | None = None
    # object schemas (tool parameters, json_schema) that do not say additionalProperties: false (the
    # default, see lanes/schemas.py) closes them, true leaves them open; None: the lane config's
    additional_properties_default: bool | None = None
    # set by the lane, never by the client: the model writes tool calls in a syntax of its own
    # (common/chat_formats.py), so ``auto`` leaves the answer free and its parser reads the calls
    _native_tool_calls: bool = PrivateAttr(default=False)

    @property
    def native_tool_calls(self) -> bool:
        return self._native_tool_calls

    @native_tool_calls.setter
    def native_tool_calls(self, value: bool) -> None:
        self._native_tool_calls = value

    @property
    def max_tokens_param(self) -> tuple[str, int | None]:
        """The client's own name for the token limit (for error messages) and its value."""
        name = token_limit_field({"max_completion_tokens": self.max_completion_tokens}, chat=True)
        return name, getattr(self, name)

    def check(self) -> None:
        self._common_checks()
        check_messages(self.messages)
        check_text(self.tools, "tools", "tools")
        self.tool_mode()
        self.grammar()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")

    def tool_mode(self) -> tuple[Literal["none", "auto", "forced"], list[dict[str, Any]]]:
        """(mode, tools the model may call): mode is "none" (no tools), "auto" (the model may
        answer with a call), or "forced" (``required``, a named function or ``allowed_tools`` in
        mode ``required``: a call is enforced).

        ``tool_choice`` forms: ``"none"``, ``"auto"``, ``"required"`` (``"any"``, the Messages API's
        word, is taken as ``"required"``), ``{"type": "function", "function": {"name": ...}}`` (the
        Responses API's flat ``{"type": "function", "name": ...}`` too) and ``{"type":
        "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": [...]}}``."""
        tools = self.tools or []
        names = _tool_names(tools)
        choice = self.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if choice == "any":
            choice = "required"
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise APIError(400, f"invalid tool_choice {_short(choice)}: expected 'none', 'auto', 'required' "
                               "or {\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
            if choice != "none" and not tools:
                raise APIError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
            if choice == "none" or not tools:
                return "none", []
            return ("forced" if choice == "required" else "auto"), tools
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "allowed_tools":
            return self._allowed_tools(choice, tools, names)
        name = _choice_name(choice)
        if kind != "function" or name is None:
            raise APIError(400, "invalid tool_choice: expected 'none', 'auto', 'required', "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}} or "
                           "{\"type\": \"allowed_tools\", \"allowed_tools\": {\"mode\": ..., \"tools\": [...]}}",
                           param="tool_choice")
        if name not in names:
            raise APIError(400, f"tool_choice names function {name!r}, which is not in tools", param="tool_choice")
        return "forced", [tools[names.index(name)]]

    @staticmethod
    def _allowed_tools(choice: dict[str, Any], tools: list[Any], names: list[str],
                       ) -> tuple[Literal["auto", "forced"], list[dict[str, Any]]]:
        spec = choice.get("allowed_tools", choice)  # chat nests it; the Responses API writes it flat
        mode = spec.get("mode") if isinstance(spec, dict) else None
        listed = spec.get("tools") if isinstance(spec, dict) else None
        if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
            raise APIError(400, "invalid tool_choice allowed_tools: expected {\"mode\": \"auto\" | \"required\", "
                           "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": ...}}, ...]}",
                           param="tool_choice")
        chosen = []
        for i, t in enumerate(listed):
            name = _choice_name(t)
            if not isinstance(t, dict) or t.get("type") != "function" or name is None:
                raise APIError(400, f"invalid tool_choice allowed_tools.tools[{i}]: expected a function by name",
                               param="tool_choice")
            if name not in names:
                raise APIError(400, f"tool_choice allows function {name!r}, which is not in tools",
                               param="tool_choice")
            if tools[names.index(name)] not in chosen:
                chosen.append(tools[names.index(name)])
        return ("forced" if mode == "required" else "auto"), chosen

    def _closed(self, schema: Any) -> Any:
        return schema if self.additional_properties_default else close_objects(schema)

    def grammar(self) -> tuple[str | None, str]:
        mode, tools = self.tool_mode()
        parallel = self.parallel_tool_calls is not False
        answer = self._answer_schema()
        tools = [{**t, "function": {**t["function"], "parameters": self._closed(t["function"].get("parameters")
                                                                                 or {"type": "object"})}}
                 for t in tools]
        param = "tools" if mode == "forced" or (mode == "auto" and answer is None) else "response_format"
        try:
            if mode == "none" or (mode == "auto" and answer is None and self.native_tool_calls):
                return (None if answer is None else json_schema_grammar(answer)), param
            return tools_grammar(mode, tools, parallel, answer if mode == "auto" else None), param
        except GrammarError as e:
            raise APIError(400, f"the schema cannot be used: {e}", param=param, code="invalid_schema") from None

    def _answer_schema(self) -> dict[str, Any] | bool | None:
        """The JSON schema ``response_format`` asks for (None: free text)."""
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise APIError(400, "response_format json_schema needs {\"name\": ..., \"schema\": {...}}",
                               param="response_format")
            schema = spec.get("schema", {})
            if not isinstance(schema, dict | bool):
                raise APIError(400, "response_format json_schema.schema must be a JSON schema object",
                               param="response_format")
            return self._closed(schema)
        raise APIError(400, f"invalid response_format type {_short(kind)}: expected 'text', 'json_object' or "
                       "'json_schema'", param="response_format")

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
        check_text(self.prompt, "prompt", "prompt")
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
    tools: list[Any] | None = None  # counted in the prompt as the chat request would render them
    tool_choice: Any = None
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
