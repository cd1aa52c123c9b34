"""Constrained decoding on the real default model: grammar masks, logit_bias, batching, preemption."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from engine.constraints import (
    GrammarCompiler,
    GrammarError,
    any_json_grammar,
    apply_mask,
    json_schema_grammar,
)
from engine.engine import Engine
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, collect_text
from tests.engine.sched_helpers import drain

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


def chat(engine: Engine, text: str) -> list[int]:
    return engine.render_chat([{"role": "user", "content": text}])


def params(n: int = 48, **kw: object) -> SamplingParams:
    return SamplingParams.parse(temperature=0.0, max_tokens=n, **kw)


def run(engine: Engine, jobs: list[tuple[list[int], SamplingParams]],
        config: SchedulerConfig | None = None) -> list[tuple[list[int], str, str | None]]:
    sched = Scheduler(engine, config or SchedulerConfig(prefix_cache=False))
    rids = [sched.add(ids, p) for ids, p in jobs]
    out = sched.run_to_completion()
    return [collect_text(out[r]) for r in rids]


def test_apply_mask_bit_order() -> None:
    row = np.zeros(70, dtype=np.float32)
    bits = np.zeros(3, dtype=np.int32)
    for t in (0, 31, 32, 69):
        bits[t // 32] |= np.int32(1 << (t % 32)) if t % 32 != 31 else np.int32(-(1 << 31))
    assert apply_mask(row, bits) == 4
    assert np.flatnonzero(np.isfinite(row)).tolist() == [0, 31, 32, 69]
    row = np.ones(70, dtype=np.float32)
    assert apply_mask(row, np.zeros(3, dtype=np.int32)) == 0 and np.all(row == 1)  # dead end: untouched


def test_bad_schema_is_a_grammar_error(engine: Engine) -> None:
    comp = GrammarCompiler.for_tokenizer(engine.tokenizer)
    with pytest.raises(GrammarError):
        comp.check(json_schema_grammar({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))
    with pytest.raises(GrammarError):
        json_schema_grammar("not a schema")  # type: ignore[arg-type]


def test_schema_output_parses_and_validates(engine: Engine) -> None:
    g = json_schema_grammar(PERSON)
    jobs = [(chat(engine, q), params(grammar=g)) for q in
            ("Describe a person as JSON.", "Who wrote Hamlet? Answer in JSON.", "Hi!")]
    for _ids, text, reason in run(engine, jobs):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_sampled_with_seed(engine: Engine) -> None:
    g = any_json_grammar()
    p = SamplingParams.parse(temperature=1.0, seed=7, max_tokens=64, grammar=g)
    (ids, text, reason), = run(engine, [(chat(engine, "Give me a JSON object about cats."), p)])
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert reason == "length" and text.startswith("{")
    again = run(engine, [(chat(engine, "Give me a JSON object about cats."), p)])
    assert again[0][0] == ids  # seeded and constrained: reproducible


def test_unconstrained_rows_unchanged_by_constrained_neighbours(engine: Engine) -> None:
    free = [(chat(engine, f"Write one sentence about {t}."), params(16)) for t in ("the sea", "rain", "a cat")]
    alone = run(engine, free)
    g = json_schema_grammar(PERSON)
    mixed = run(engine, [free[0], (chat(engine, "A person, JSON."), params(grammar=g)), free[1],
                         (chat(engine, "Another person."), params(grammar=g)), free[2]])
    assert [mixed[0], mixed[2], mixed[4]] == alone
    for _, text, _ in (mixed[1], mixed[3]):
        jsonschema.validate(json.loads(text), PERSON)


def test_constraint_survives_preemption(model_path: Path) -> None:
    g = json_schema_grammar(PERSON)
    with Engine.open(model_path, threads=2, kv_tokens=288, block_size=16) as small:
        prompts = [chat(small, f"Describe person number {i} as JSON.") for i in range(8)]
        ref = run(small, [(prompts[0], params(grammar=g))])[0]
        sched = Scheduler(small, SchedulerConfig(max_batch_tokens=128, prefix_cache=False))
        rids = [sched.add(p, params(grammar=g)) for p in prompts]
        out, preempted = drain(sched)
        assert preempted > 0, "the arena was meant to be too small"
        results = [collect_text(out[r]) for r in rids]
        assert results[0] == ref
        for _, text, reason in results:
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), PERSON)


def test_logit_bias_bans_and_forces(engine: Engine) -> None:
    ids = chat(engine, "What is the capital of France?")
    (base, text, _), = run(engine, [(ids, params(12))])
    assert base
    banned = base[0]
    (out, _, _), = run(engine, [(ids, params(12, logit_bias={banned: -100.0}))])
    assert banned not in out
    forced = engine.tokenizer.encode(" zebra", add_special=False)[-1]
    (out, _, _), = run(engine, [(ids, params(5, logit_bias={forced: 100.0}))])
    assert out == [forced] * 5
    # logit_bias together with a grammar: the mask still wins, the bias steers inside it
    g = json_schema_grammar({"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
                             "additionalProperties": False})
    (_, text, _), = run(engine, [(ids, params(24, grammar=g))])
    other = "y" if json.loads(text)["a"] == "x" else "x"
    tid = engine.tokenizer.encode(other, add_special=False)
    assert len(tid) == 1
    (_, text2, reason), = run(engine, [(ids, params(24, grammar=g, logit_bias={tid[0]: 100.0}))])
    assert reason == "stop" and json.loads(text2) == {"a": other}


def test_bad_logit_bias_is_rejected(engine: Engine) -> None:
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams.parse(logit_bias={5: 150.0})
    sched = Scheduler(engine)
    with pytest.raises(ValueError, match="out of range"):
        sched.add(chat(engine, "hi"), params(logit_bias={10**7: 1.0}))


def test_tool_rendering_native_and_fallback(engine: Engine) -> None:
    from common.chat_template import TOOL_PROMPT, ChatTemplate

    tools = [{"type": "function", "function": {"name": "add", "description": "Add",
                                               "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "1+2?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\":1}"}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    # the default model's template does not read tools: the documented fallback prompt
    tpl = engine.chat_template
    assert not tpl.supports_tools
    text = tpl.render_with_tools(history, tools)
    assert TOOL_PROMPT.split("{tools}")[0] in text and '"name": "add"' in text
    assert '{"name": "add", "arguments": {"a": 1}}' in text and "<|im_start|>tool\n3<|im_end|>" in text
    # several calls in one answer: the JSON array the prompt asks for
    two = [{**history[1], "tool_calls": [history[1]["tool_calls"][0],  # type: ignore[index]
                                         {"id": "call_2", "type": "function",
                                          "function": {"name": "add", "arguments": "{\"a\":2}"}}]}]
    assert '[{"name": "add", "arguments": {"a": 1}}, {"name": "add", "arguments": {"a": 2}}]' in \
        tpl.render_with_tools(two, tools)
    # a template that renders tools itself gets them as the variable, history untouched
    native = ChatTemplate("{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
                          "{% for m in messages %}{{ m.role }}:{{ m.tool_calls[0].function.name if m.tool_calls "
                          "else m.content }};{% endfor %}")
    assert native.supports_tools
    assert native.render_with_tools(history, tools) == "[add]user:1+2?;assistant:add;tool:3;"


def test_grammar_dead_end_finishes_with_stop(engine: Engine, caplog: pytest.LogCaptureFixture) -> None:
    """A matcher in its error state allows nothing: the request ends with stop and a log line."""
    sched = Scheduler(engine, SchedulerConfig(prefix_cache=False))
    rid = sched.add(chat(engine, "JSON please."), params(8, grammar=json_schema_grammar(PERSON)))
    req = sched._inbox[-1]
    assert req.constraint is not None
    req.constraint.consume(engine.tokenizer.encode("zzz", add_special=False)[0])  # not a JSON start
    assert req.constraint.error
    with caplog.at_level("WARNING", logger="strata.engine"):
        ids, text, reason = collect_text(sched.run_to_completion(max_steps=50)[rid])
    assert (ids, reason) == ([], "stop")
    assert "grammar" in caplog.text and rid in caplog.text
    assert not sched.has_work()
