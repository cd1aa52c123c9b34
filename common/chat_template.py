"""Chat prompt rendering from the GGUF's ``tokenizer.chat_template`` (a Jinja2 template).

Templates come with model files, i.e. from outside, so they run in jinja2's immutable sandbox,
set up the way HF transformers (and llama-cpp-python, our reference) render chat templates:
``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a pass-through ``{% generation %}``
tag, a ``tojson`` that keeps non-ASCII text, and ``raise_exception``/``strftime_now`` globals.

One deliberate difference: reaching for an unsafe attribute (``''.__class__``) raises instead of
quietly rendering an empty string, so a hostile or broken template fails loudly. Every failure -
syntax error, undefined operation, ``raise_exception``, sandbox violation, bad message shape -
surfaces as :class:`ChatTemplateError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from common.chat_formats import ChatFormat, detect_format, shape_messages

if TYPE_CHECKING:
    from common.tokenizer import Tokenizer


class ChatTemplateError(ValueError):
    """The chat template could not be compiled or rendered, or the messages are malformed."""


# Used when the GGUF carries no template: ChatML is what most instruction-tuned models in our
# catalogue speak, and a prompt in a wrong-but-common format beats refusing to serve.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is iterable -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


class _TemplateRaised(Exception):
    """Carrier for a template's own ``raise_exception(...)`` call."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRaised(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson HTML-escapes (<, >, &, ') which would corrupt tool schemas in prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant spans for training masks in HF;
    for prompting it is a no-op wrapper around its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the 'generation' name token
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LoudSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that raises on unsafe attribute access instead of returning Undefined."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


def _make_environment() -> _LoudSandbox:
    env = _LoudSandbox(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check the OpenAI-style message shape templates rely on; return shallow copies."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of objects, got {type(messages).__name__}")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be an object, got {type(msg).__name__}")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" in msg:
            content = msg["content"]
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                        raise ChatTemplateError(
                            f"messages[{i}].content[{j}] must be an object with a string 'type'"
                        )
                    if part["type"] == "text" and not isinstance(part.get("text"), str):
                        raise ChatTemplateError(f"messages[{i}].content[{j}].text must be a string")
            elif content is not None and not isinstance(content, str):
                raise ChatTemplateError(
                    f"messages[{i}].content must be a string, a list of parts or null, got {type(content).__name__}"
                )
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None and (
            not isinstance(tool_calls, list) or not all(isinstance(c, Mapping) for c in tool_calls)
        ):
            raise ChatTemplateError(f"messages[{i}].tool_calls must be a list of objects")
        out.append(dict(msg))
    return out


class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    def __init__(
        self, source: str, bos_token: str = "", eos_token: str = "", *, is_fallback: bool = False
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.is_fallback = is_fallback
        self.format: ChatFormat = detect_format(source)  # what the template renders (common/chat_formats.py)
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template cannot be compiled: {e}") from e

    @classmethod
    def from_metadata(
        cls, md: Mapping[str, Any], tokenizer: Tokenizer, name: str | None = None
    ) -> ChatTemplate:
        """Template from ``tokenizer.chat_template`` (or ``tokenizer.chat_template.<name>``).

        Without one in the GGUF the ChatML template :data:`CHATML_TEMPLATE` is used and
        ``is_fallback`` is set. ``bos_token``/``eos_token`` are the vocabulary texts of the
        tokenizer's BOS/EOS ids, as llama.cpp passes them.
        """
        key = "tokenizer.chat_template" if name is None else f"tokenizer.chat_template.{name}"
        source = md.get(key)
        if source is not None and not isinstance(source, str):
            raise ChatTemplateError(f"{key} must be a string, got {type(source).__name__}")
        if name is not None and not source:
            raise ChatTemplateError(f"GGUF has no chat template named {name!r}")
        bos = tokenizer.id_to_token(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        if not source:
            return cls(CHATML_TEMPLATE, bos, eos, is_fallback=True)
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Prompt text for ``messages``; ``extra`` reaches the template as variables (``tools``,
        ``enable_thinking``, ...), and may override ``bos_token``/``eos_token``. Messages are shaped
        for the template's format first (:func:`common.chat_formats.shape_messages`)."""
        msgs = shape_messages(self.format, _validate_messages(messages))
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "tools": None,
        }
        context.update(extra)
        context["messages"] = msgs
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**context)
        except _TemplateRaised as e:
            raise ChatTemplateError(f"chat template rejected the conversation: {e}") from e
        except SecurityError as e:
            raise ChatTemplateError(f"chat template violated the sandbox: {e}") from e
        except jinja2.UndefinedError as e:
            raise ChatTemplateError(f"chat template used an undefined value: {e}") from e
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        except Exception as e:  # template code is untrusted: any runtime failure is its failure
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    @property
    def supports_tools(self) -> bool:
        """The template renders ``tools`` itself (it reads the variable); otherwise
        :func:`with_tools` writes the documented fallback prompt."""
        return "tools" in self.source

    def render_with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                          add_generation_prompt: bool = True) -> str:
        """``render`` for a chat that may define tools and hold tool calls and tool results."""
        if self.supports_tools:
            return self.render(messages, add_generation_prompt, tools=tools or None)
        return self.render(with_tools(messages, tools), add_generation_prompt)

    def __repr__(self) -> str:
        return f"ChatTemplate(fallback={self.is_fallback}, {len(self.source)} chars)"


TOOL_PROMPT = (
    "You can call these functions (JSON schema of each one's arguments):\n{tools}\n"
    "To call one, answer with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <object of arguments>}} and nothing else; '
    "to call several at once, answer with only a JSON array of such objects. "
    "A function's result comes back in a message with the role 'tool'; then answer the user."
)


def _call_text(calls: list[Any]) -> str:
    out: list[dict[str, Any]] = []
    for c in calls:
        fn = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(fn, Mapping):
            continue
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        out.append({"name": fn.get("name"), "arguments": parsed})
    # the form the model is told to answer in: one object, or an array of several
    return json.dumps(out[0] if len(out) == 1 else out, ensure_ascii=False) if out else ""


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The fallback for templates that do not render tools: the tool definitions go into the
    system message (:data:`TOOL_PROMPT`), an assistant's ``tool_calls`` become its text in the
    same ``{"name", "arguments"}`` form the model is asked to answer in, and ``tool`` results
    are plain messages of role ``tool``. Messages without tools pass through (content None
    becomes "")."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + _call_text(calls)
        if m.get("content") is None:
            m["content"] = ""
        m.pop("tool_call_id", None)
        m.pop("name", None)
        out.append(m)
    if tools:
        lines = []
        for t in tools:
            fn = t.get("function", {}) if isinstance(t, Mapping) else {}
            lines.append(json.dumps({"name": fn.get("name"), "description": fn.get("description", ""),
                                     "parameters": fn.get("parameters", {"type": "object"})}, ensure_ascii=False))
        prompt = TOOL_PROMPT.format(tools="\n".join(lines))
        if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
            out[0] = {**out[0], "role": "system", "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
