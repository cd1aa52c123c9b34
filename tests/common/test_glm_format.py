"""The GLM-4.5 family's text side: its pre-tokenizer ("glm4") and its chat template format.

* Tokenizer: ``tokenizer.ggml.pre = "glm4"`` (what llama.cpp's converter writes for GLM-4 and
  GLM-4.5 / 4.6 / Air) on SmolLM2's byte-level vocabulary, checked on a multilingual corpus against
  the ``tokenizers`` library set up as GLM-4.5's tokenizer.json is (a Split on the cl100k-style
  regex, then ByteLevel without its own regex, then BPE), and against llama.cpp on the same GGUF.
  A GLM-style vocabulary (its special tokens, [gMASK] as BOS, <|user|> as EOT, <|observation|> as
  EOM) is checked against llama.cpp for special ids, end-of-generation ids and special parsing.
* Chat template: a GLM-4.5-style template written here from the format's facts ("[gMASK]<sop>"
  prefix, <|system|> / <|user|> / <|assistant|> / <|observation|> turns, <think> blocks, the
  "/nothink" switch, XML tool calls with <arg_key> / <arg_value>, tool results in
  <tool_response>) renders through common.chat_template exactly as jinja2 renders it, read from a
  glm4moe GGUF, and tokenises with each marker as one control token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from common.chat_template import ChatTemplate
from common.tokenizer import Tokenizer
from tests.engine.gguf_factory import (
    GLM_SPECIALS,
    add_metadata,
    finish_gguf,
    glm_vocab_metadata,
    make_glm4moe_gguf,
)

# GLM-4.5's pre-tokenizer regex as its tokenizer.json writes it (case-insensitive contractions).
GLM_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")

MULTILINGUAL = [
    "Hello world, it's 2025 and we've 1234567 reasons.",
    "GLM-4.5 是智谱发布的混合专家模型，总参数 3550 亿。",
    "東京の天気は晴れ、気温は２３度です。カタカナ、ひらがな、漢字。",
    "한국어 문장도 토큰화합니다. 12,345원!",
    "Ελληνικά: Καλημέρα κόσμε. Русский: Привет, мир! Українська: Їжак.",
    "العربية: مرحبا بالعالم ١٢٣٤ — עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया। தமிழ்: வணக்கம் ไทย: สวัสดีชาวโลก",
    "Tiếng Việt: Xin chào thế giới. Türkçe: Merhaba dünya. Polski: Zażółć gęślą jaźń.",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇨🇳 math ∑∫√π ≤ ≥ ≠",
    "code:\n\tdef f(x):\n\t\treturn x**2  # 平方\n\n\n   trailing   \r\n",
    "DON'T I'LL 'S 'tis rock 'n' roll, she'd HE'D they're",
    "numbers 1 12 123 1234 12345 ٣٤٥٦ ²³ Ⅻ ½ 0.000001",
    "spaces    between\u3000ideographic\u00a0nbsp\u2028line-sep",
    "",
    " ",
    "\n\n",
]

_POOL = list(
    "abcXYZ \n\r\t  0123456789'’.,!?-_()<>|$+^~`/你好世界こんにちはカタカナ한국어🙂éüßÅПриветمرحبا"
    "\u00a0\u3000\u2028\u2003\u0301\u200d。，、！"
) + ["'s", "'LL", "'ve", "\r\n", "    ", "12345", "[gMASK]", "<|user|>", "<think>"]


def _fuzz(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(_POOL) for _ in range(rng.randint(1, 50))) for _ in range(n)]


def _write_gguf(path: Path, md: dict[str, Any]) -> None:
    """A tensor-less GGUF with metadata ``md``: enough for llama.cpp's vocab-only load."""
    w = gguf.GGUFWriter(str(path), arch=str(md["general.architecture"]))
    add_metadata(w, {k: v for k, v in md.items() if not k.startswith("GGUF.") and k != "general.architecture"})
    finish_gguf(w, path)


def _glm_reference(md: dict[str, Any]) -> HFTokenizer:
    """The ``tokenizers`` pipeline GLM-4.5's tokenizer.json describes, over ``md``'s vocabulary."""
    tokens = list(md["tokenizer.ggml.tokens"])
    types = list(md["tokenizer.ggml.token_type"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    tok = HFTokenizer(BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty in (3, 4)])
    return tok


@pytest.fixture(scope="module")
def glm4_on_smollm(smollm_metadata: dict[str, Any], tmp_path_factory: pytest.TempPathFactory,
                   llama_vocab_loader: Callable[[Path], Any]) -> tuple[Tokenizer, HFTokenizer, Any, dict[str, Any]]:
    """(our tokenizer, the tokenizers-library reference, llama.cpp, metadata) for SmolLM2's vocabulary
    with tokenizer.ggml.pre = "glm4"."""
    md = dict(smollm_metadata, **{"tokenizer.ggml.pre": "glm4"})
    path = tmp_path_factory.mktemp("glm4_pre") / "glm4.gguf"
    _write_gguf(path, md)
    return Tokenizer.from_metadata(md), _glm_reference(md), llama_vocab_loader(path), md


def test_glm4_pre_tokenizer_matches_tokenizers_library(glm4_on_smollm: tuple) -> None:
    ours, reference, _, _ = glm4_on_smollm
    assert ours.pre == "glm4"
    for text in MULTILINGUAL + _fuzz(300, seed=45):
        assert ours.encode(text, add_special=False) == reference.encode(text, add_special_tokens=False).ids, text
        ids = ours.encode(text, add_special=False)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False) == text


def test_glm4_pre_tokenizer_matches_llama_cpp(glm4_on_smollm: tuple) -> None:
    ours, _, llama, _ = glm4_on_smollm
    for text in MULTILINGUAL + _fuzz(300, seed=46):
        for special in (True, False):
            assert ours.encode(text, add_special=False, parse_special=special) == llama.tokenize(
                text.encode(), add_bos=False, special=special), (text, special)


def test_glm_vocabulary_specials_match_llama_cpp(tmp_path: Path, llama_vocab_loader: Callable[[Path], Any]) -> None:
    import llama_cpp

    md: dict[str, Any] = {"general.architecture": "glm4moe", **glm_vocab_metadata()}
    path = tmp_path / "glm_vocab.gguf"
    _write_gguf(path, md)
    ours, llama = Tokenizer.from_metadata(md), llama_vocab_loader(path)
    ids = {t: ours.token_to_id(t) for t in GLM_SPECIALS}
    assert ours.bos_id == llama.token_bos() == ids["[gMASK]"]
    assert ours.eos_id == llama.token_eos() == ids["<|endoftext|>"]
    eog = {i for i in range(ours.vocab_size) if llama_cpp.llama_vocab_is_eog(llama._model.vocab, i)}
    assert ours.eot_ids == eog == {ids["<|endoftext|>"], ids["<|user|>"], ids["<|observation|>"]}
    text = "[gMASK]<sop><|user|>\nhi there<|assistant|>\n<think>ok</think>\nanswer<|user|>"
    for special in (True, False):
        assert ours.encode(text, add_special=False, parse_special=special) == llama.tokenize(
            text.encode(), add_bos=False, special=special)
    assert ours.encode(text)[:2] == [ids["[gMASK]"], ids["<sop>"]]  # no BOS added: the template writes it
    # Without a bos_token_id key a glm4 vocabulary has no BOS (llama.cpp: special_bos_id = NULL).
    md_nobos = {k: v for k, v in md.items() if k != "tokenizer.ggml.bos_token_id"}
    _write_gguf(tmp_path / "nobos.gguf", md_nobos)
    assert Tokenizer.from_metadata(md_nobos).bos_id is None
    assert llama_vocab_loader(tmp_path / "nobos.gguf").token_bos() == -1


# ---------------------------------------------------------------------------------------------- chat template

# Written for this test from the facts of GLM-4.5's prompt format (not copied from any file).
GLM45_TEMPLATE = """\
{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part is mapping and part.type == 'text' -%}{{ part.text }}{%- endfor -%}
{%- elif content is not none -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
{%- set no_think = enable_thinking is defined and not enable_thinking -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
...
</tool_call>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}
<|system|>
{{ text_of(m.content) }}
{%- elif m.role == 'user' -%}
{%- set said = text_of(m.content) -%}
<|user|>
{{ said }}{{ '/nothink' if no_think and not said.endswith('/nothink') else '' }}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set answer = text_of(m.content) -%}
{%- set thought = m.reasoning_content if m.reasoning_content is string else '' -%}
{%- if '</think>' in answer -%}
{%- set thought = answer.split('</think>')[0].split('<think>')[-1] -%}
{%- set answer = answer.split('</think>')[-1] -%}
{%- endif -%}
{%- if loop.index0 > ns.last_user and thought -%}
{{ '\\n<think>' + thought.strip() + '</think>' }}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if answer.strip() -%}{{ '\\n' + answer.strip() }}{%- endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{ '\\n<tool_call>' + fn.name }}
{%- set args = fn.arguments if fn.arguments is mapping else {} -%}
{%- for key, value in args.items() -%}
{{ '\\n<arg_key>' + key + '</arg_key>\\n<arg_value>' }}{{ value if value is string else value | tojson(ensure_ascii=False) }}</arg_value>
{%- endfor -%}
{{ '\\n</tool_call>' }}
{%- endfor -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}<|observation|>{%- endif -%}
{{ '\\n<tool_response>\\n' + text_of(m.content) + '\\n</tool_response>' }}
{%- else -%}
{{ raise_exception('unexpected role ' + m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{ '\\n<think></think>' if no_think else '' }}{%- endif -%}
"""

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wetter für <Ort> & Zeit — 天气",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "user_only": [{"role": "user", "content": "你好"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are GLM, be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "<think>simple sum</think>4"},
        {"role": "user", "content": [{"type": "text", "text": "And 3+3?"}, {"type": "text", "text": " Explain."}]},
    ],
    "reasoning_after_last_user": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "  I should think.  "},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris and Berlin for 2 days?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Berlin", "days": 2}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "{\"temp\": 17}"},
    ],
}


def _jinja2_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
    """Plain jinja2 in the setup Hugging Face documents for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(msg: str) -> None:
        raise jinja2.exceptions.TemplateError(msg)

    env.filters["tojson"] = tojson
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            raise_exception=raise_exception, bos_token="[gMASK]",
                                            eos_token="<|endoftext|>", **extra)


@pytest.fixture(scope="module")
def glm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_glm4moe_gguf(tmp_path_factory.mktemp("glm_tpl") / "glm.gguf", n_moe=1, chat_template=GLM45_TEMPLATE)


@pytest.fixture(scope="module")
def glm_template(glm_gguf: Path) -> ChatTemplate:
    from common.gguf_meta import read_metadata

    md = read_metadata(glm_gguf)
    return ChatTemplate.from_metadata(md, Tokenizer.from_metadata(md))


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_glm45_template_renders_as_jinja2(glm_template: ChatTemplate, conversation: str,
                                          add_generation_prompt: bool, thinking: bool | None) -> None:
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    assert glm_template.source == GLM45_TEMPLATE and not glm_template.is_fallback
    messages = CONVERSATIONS[conversation]
    tools = TOOLS if conversation == "tool_round_trip" else None
    extra = {} if thinking is None else {"enable_thinking": thinking}
    ours = glm_template.render_with_tools(messages, tools, add_generation_prompt) if thinking is None else \
        glm_template.render(messages, add_generation_prompt, tools=tools, **extra)
    assert ours == _jinja2_render(GLM45_TEMPLATE, messages, add_generation_prompt, tools=tools, **extra)
    theirs = Jinja2ChatFormatter(template=GLM45_TEMPLATE, eos_token="<|endoftext|>", bos_token="[gMASK]",
                                 add_generation_prompt=add_generation_prompt)(messages=messages, tools=tools, **extra)
    assert ours == theirs.prompt
    assert ours.startswith("[gMASK]<sop>")
    if add_generation_prompt:
        assert ours.endswith("<|assistant|>\n<think></think>" if thinking is False else "<|assistant|>")


def test_glm45_prompt_shape(glm_template: ChatTemplate) -> None:
    out = glm_template.render(CONVERSATIONS["tool_round_trip"], tools=TOOLS)
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in out  # non-ASCII and <>& kept
    assert ("<|assistant|>\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
            "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>") in out
    assert out.endswith("<|observation|>\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n"
                        "{\"temp\": 17}\n</tool_response><|assistant|>")
    assert glm_template.render(CONVERSATIONS["user_only"], enable_thinking=False) == \
        "[gMASK]<sop><|user|>\n你好/nothink<|assistant|>\n<think></think>"
    assert glm_template.render(CONVERSATIONS["reasoning_after_last_user"], add_generation_prompt=False) == \
        "[gMASK]<sop><|user|>\nThink first.<|assistant|>\n<think>I should think.</think>\nDone."


def test_glm45_prompt_through_the_engine(glm_gguf: Path, llama_vocab_loader: Callable[[Path], Any]) -> None:
    """Engine.render_chat on the glm4moe GGUF: its template, then its glm4 tokenizer; every role
    marker is one control token, and llama.cpp tokenises the same text to the same ids."""
    from engine.engine import Engine

    with Engine.open(glm_gguf, threads=1, kv_tokens=256) as eng:
        ids = eng.render_chat(CONVERSATIONS["system_multi_turn"])
        text = eng.chat_template.render(CONVERSATIONS["system_multi_turn"])
        tok = eng.tokenizer
        assert ids == tok.encode(text, add_special=True)
        assert ids == llama_vocab_loader(glm_gguf).tokenize(text.encode(), add_bos=False, special=True)
        marks = {t: tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>")}
        assert ids[:3] == [marks["[gMASK]"], marks["<sop>"], marks["<|system|>"]]
        assert ids.count(marks["<|user|>"]) == 2 and ids[-1] == marks["<|assistant|>"]
        assert tok.is_eog(marks["<|user|>"])  # generation stops where the next user turn would start
