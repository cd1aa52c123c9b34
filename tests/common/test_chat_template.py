"""common.chat_template: rendering equals llama-cpp-python's Jinja2ChatFormatter; failures are typed."""

from __future__ import annotations

from typing import Any

import pytest

from common.chat_template import CHATML_TEMPLATE, ChatTemplate, ChatTemplateError
from common.tokenizer import Tokenizer

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "hi"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hello 你好 🙂"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me\na joke\n\n"},
    ],
    "assistant_first": [{"role": "assistant", "content": "I start."}, {"role": "user", "content": "ok"}],
}


@pytest.fixture(scope="module")
def smollm_tok(smollm_metadata: dict[str, Any]) -> Tokenizer:
    return Tokenizer.from_metadata(smollm_metadata)


@pytest.fixture(scope="module")
def smollm_template(smollm_metadata: dict[str, Any], smollm_tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate.from_metadata(smollm_metadata, smollm_tok)


def _llama_cpp_prompt(
    md: dict[str, Any], llama: Any, messages: list[dict[str, Any]], add_generation_prompt: bool
) -> str:
    import llama_cpp
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = llama._model.vocab
    formatter = Jinja2ChatFormatter(
        template=md["tokenizer.chat_template"],
        eos_token=llama_cpp.llama_vocab_get_text(vocab, llama.token_eos()).decode(),
        bos_token=llama_cpp.llama_vocab_get_text(vocab, llama.token_bos()).decode(),
        add_generation_prompt=add_generation_prompt,
    )
    return formatter(messages=messages).prompt


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_render_matches_llama_cpp(
    smollm_template: ChatTemplate,
    smollm_metadata: dict[str, Any],
    smollm_llama: Any,
    conversation: str,
    add_generation_prompt: bool,
) -> None:
    messages = CONVERSATIONS[conversation]
    ours = smollm_template.render(messages, add_generation_prompt=add_generation_prompt)
    assert ours == _llama_cpp_prompt(smollm_metadata, smollm_llama, messages, add_generation_prompt)


# A template written for this test exercising what real ones use: whitespace control, trimmed
# blocks, namespace(), loop variables, tojson on tool schemas, content parts and raise_exception.
RICH_TEMPLATE = """\
{%- set ns = namespace(system=none) -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}
{%- endif -%}
{{ bos_token }}
{%- if tools %}
<tools>
    {%- for tool in tools %}
{{ tool | tojson }}
    {%- endfor %}
</tools>
{% endif %}
{%- if ns.system %}[SYS] {{ ns.system }}
{% endif %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- if message.role not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('bad role ' + message.role) }}
    {%- endif %}
    {%- if message.content is string %}
[{{ message.role | upper }}] {{ message.content | trim }}
    {%- else %}
[{{ message.role | upper }}] {% for part in message.content %}{{ part.text }}{% if not loop.last %} {% endif %}{% endfor %}
    {%- endif %}
    {%- if message.role == 'assistant' %}{{ eos_token }}{% endif %}
{% endfor %}
{%- if add_generation_prompt %}[ASSISTANT]{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("with_tools", [True, False])
def test_rich_template_matches_llama_cpp(add_generation_prompt: bool, with_tools: bool) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    tools = (
        [
            {
                "type": "function",
                "function": {"name": "wetter", "description": "Wetter für <Ort> & Zeit", "parameters": {}},
            }
        ]
        if with_tools
        else None
    )
    messages = [
        {"role": "system", "content": "Sys prompt"},
        {"role": "user", "content": "  padded question  "},
        {"role": "assistant", "content": "answer"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
    ]
    ours = ChatTemplate(RICH_TEMPLATE, bos_token="<s>", eos_token="</s>").render(
        messages, add_generation_prompt=add_generation_prompt, tools=tools
    )
    theirs = Jinja2ChatFormatter(
        template=RICH_TEMPLATE, eos_token="</s>", bos_token="<s>", add_generation_prompt=add_generation_prompt
    )(messages=messages, tools=tools).prompt
    assert ours == theirs
    assert ("Wetter für <Ort> & Zeit" in ours) is with_tools  # tojson keeps non-ASCII and <>&
    with pytest.raises(ChatTemplateError, match="bad role narrator"):
        ChatTemplate(RICH_TEMPLATE).render([{"role": "narrator", "content": "x"}])


def test_default_model_prompt_shape(
    smollm_template: ChatTemplate, smollm_tok: Tokenizer, smollm_llama: Any
) -> None:
    assert not smollm_template.is_fallback
    assert (smollm_template.bos_token, smollm_template.eos_token) == ("<|im_start|>", "<|im_end|>")
    prompt = smollm_template.render(CONVERSATIONS["user_only"])
    # SmolLM2's template injects its default system prompt when none is given.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # The rendered prompt tokenises with its markers as control tokens, as llama.cpp does.
    ids = smollm_tok.encode(prompt)
    assert ids == smollm_llama.tokenize(prompt.encode(), add_bos=False, special=True)
    assert ids.count(smollm_tok.token_to_id("<|im_start|>")) == 3


def test_fallback_is_chatml(smollm_metadata: dict[str, Any], smollm_tok: Tokenizer) -> None:
    md = {k: v for k, v in smollm_metadata.items() if k != "tokenizer.chat_template"}
    tpl = ChatTemplate.from_metadata(md, smollm_tok)
    assert tpl.is_fallback and tpl.source == CHATML_TEMPLATE
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": None},
    ]
    assert tpl.render(messages) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
        "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tpl.render(messages[:1], add_generation_prompt=False) == "<|im_start|>system\nS<|im_end|>\n"


def test_named_template(smollm_metadata: dict[str, Any], smollm_tok: Tokenizer) -> None:
    md = dict(smollm_metadata, **{"tokenizer.chat_template.tool_use": "TOOLS{{ tools | length }}"})
    tpl = ChatTemplate.from_metadata(md, smollm_tok, name="tool_use")
    assert tpl.render([{"role": "user", "content": "x"}], tools=[{"a": 1}, {"b": 2}]) == "TOOLS2"
    with pytest.raises(ChatTemplateError, match="nope"):
        ChatTemplate.from_metadata(md, smollm_tok, name="nope")


def test_hf_features() -> None:
    src = (
        "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "{% generation %}[{{ m.role }}]{% endgeneration %}{% endfor %}"
        "{{ tools | tojson }}|{{ {'k': '<é>'} | tojson(indent=None, sort_keys=True) }}|"
        "{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}|{{ custom }}"
        "{% if add_generation_prompt %}+{% endif %}"
    )
    tpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    messages = [
        {"role": "user", "content": "a"},
        {"role": "skip", "content": "b"},
        {"role": "assistant", "content": "c"},
    ]
    out = tpl.render(messages, custom="X")
    assert out == '[user][assistant]null|{"k": "<é>"}|4|<s></s>|X+'
    assert tpl.render(messages, add_generation_prompt=False, tools=[{"name": "f"}]).startswith(
        '[user][assistant][{"name": "f"}]'
    )


def test_trim_and_lstrip_blocks_like_hf() -> None:
    src = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n"
    assert (
        ChatTemplate(src).render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
        == "a\nb\n"
    )


# -- errors ---------------------------------------------------------------------------------------


def test_syntax_error_is_typed() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% if %}")
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{% for m in messages %}")  # unclosed block


def test_raise_exception_is_typed(smollm_tok: Tokenizer) -> None:
    src = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}ok"
    tpl = ChatTemplate(src)
    assert tpl.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="Conversation must start with user"):
        tpl.render([{"role": "system", "content": "x"}])


@pytest.mark.parametrize(
    "src",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ ''.__class__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ raise_exception.__globals__ }}",
        "{{ messages['__class__'] }}",
        "{% set x = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_escapes_are_typed(src: str) -> None:
    with pytest.raises(ChatTemplateError, match="sandbox|unsafe|undefined"):
        ChatTemplate(src).render([{"role": "user", "content": "x"}])


def test_undefined_and_runtime_errors_are_typed() -> None:
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="undefined"):
        ChatTemplate("{{ nothing.attr }}").render(messages)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages[0]['content'] + 1 }}").render(messages)
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ 1 / 0 }}").render(messages)
    # Plain undefined names render empty, as in HF and llama-cpp-python (templates rely on it).
    assert ChatTemplate("[{{ documents }}]").render(messages) == "[]"


@pytest.mark.parametrize(
    "messages",
    [
        "not a list",
        {"role": "user", "content": "x"},
        [["user", "x"]],
        [{"content": "x"}],
        [{"role": "", "content": "x"}],
        [{"role": 3, "content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": {"text": "x"}}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 7}]}],
        [{"role": "assistant", "content": None, "tool_calls": "f()"}],
    ],
)
def test_bad_messages_are_typed(smollm_template: ChatTemplate, messages: Any) -> None:
    with pytest.raises(ChatTemplateError, match="messages"):
        smollm_template.render(messages)


def test_template_failure_on_null_content_is_typed(smollm_template: ChatTemplate) -> None:
    # Valid shape, but SmolLM2's template concatenates content: the TypeError becomes ours.
    with pytest.raises(ChatTemplateError):
        smollm_template.render([{"role": "assistant", "content": None}])
    assert issubclass(ChatTemplateError, ValueError)
