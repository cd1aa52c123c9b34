"""A lane serving from the GPU over real HTTP: `device = "cuda"` in its config, /v1/lane
reporting the device and the GPU, and an OpenAI completion answered by the GPU engine
(the same tokens as the CPU engine gives for the same greedy request)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from engine.engine import Engine
from tests.engine.gpu._env import requires_gpu
from tests.lanes.conftest import lane_config, running_lane

pytestmark = requires_gpu

H = pytest.importorskip("tests.engine.hf_models", reason="transformers (torch) is needed to build the random model")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gpu_lane")
    hf_dir, _ = H.MAKERS["qwen3moe"](root / "qwen3moe")
    return H.to_gguf(hf_dir, root / "qwen3moe.q8_0.gguf", "q8_0")


async def test_lane_on_the_gpu_reports_it_and_answers(model_path: Path) -> None:
    body = {"model": "strata-default", "prompt": "hello there", "max_tokens": 12, "temperature": 0}
    async with running_lane(lane_config(model=model_path, device="cuda", gpu=0), None) as lane, \
            aiohttp.ClientSession() as s:
        async with s.get(lane.url + "/v1/lane") as r:
            info = await r.json()
        assert info["device"] == "cuda:0" and info["config"]["device"] == "cuda"
        gi = info["gpu_info"]
        assert gi["index"] == 0 and gi["name"] and gi["total_bytes"] > gi["weight_bytes"] > 0 and gi["kv_bytes"] > 0
        async with s.post(lane.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            gpu_out = await r.json()
    with Engine.open(model_path, threads=2, kv_tokens=2048) as cpu:
        want = cpu.generate(cpu.tokenizer.encode("hello there", add_special=True, parse_special=True),
                            max_tokens=12)
    assert gpu_out["choices"][0]["text"] == want.text
