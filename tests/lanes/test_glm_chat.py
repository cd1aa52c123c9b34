"""A lane serving a glm4moe GGUF over real HTTP: /v1/chat/completions renders the file's GLM-4.5-style
chat template, tokenises with its glm4 vocabulary and answers through the routed model; the answer is
the generated text read as GLM-4.5 writes it (lanes/chat_parsers.py: stripped, <think> apart)."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from engine.engine import Engine
from lanes.chat_parsers import Glm45Parser, collect
from tests.common.test_glm_format import GLM45_TEMPLATE
from tests.engine.gguf_factory import make_glm4moe_gguf
from tests.lanes.conftest import lane_config, running_lane


async def test_chat_completion_on_a_glm4moe_lane(tmp_path: Path) -> None:
    path = make_glm4moe_gguf(tmp_path / "glm.gguf", n_moe=1, chat_template=GLM45_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 你好"}]
    with Engine.open(path, threads=2, kv_tokens=512) as eng:
        async with running_lane(lane_config(kv_tokens=512), lambda config, cores: eng) as lane, \
                aiohttp.ClientSession() as s:
            async with s.post(lane.url + "/v1/chat/completions", json={
                    "messages": messages, "max_tokens": 12, "temperature": 0}) as r:
                assert r.status == 200, await r.text()
                body = await r.json()
        prompt = eng.render_chat(messages)
        assert eng.tokenizer.decode(prompt) == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHello 你好<|assistant|>"
        want = eng.generate(prompt, max_tokens=12)  # the same greedy decoding, stopping at <|user|> etc.
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(want.token_ids)
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    parser = Glm45Parser()
    answer = collect(parser.feed(want.text) + parser.finish(want.finish_reason))
    assert choice["message"]["content"] == answer.content
    assert choice["message"].get("reasoning_content") == answer.reasoning
    assert choice["finish_reason"] == want.finish_reason
