"""/v1/lane (affinity, identity), /health, /metrics, /tokenize, /detokenize, SSE pings."""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp
import pytest
from aiohttp.http_writer import StreamWriter

from engine.engine import Engine
from lanes.server import EngineFactory
from tests.http_helpers import eventually, scrape
from tests.lanes.conftest import lane_config, running_lane

METRICS = ["strata_requests_running", "strata_requests_waiting", "strata_kv_usage_ratio",
           "strata_prefix_cache_hit_tokens_total", "strata_prefix_cache_query_tokens_total",
           "strata_prompt_tokens_total", "strata_generation_tokens_total",
           'strata_requests_total{finish_reason="stop"}', "strata_time_to_first_token_seconds_count",
           "strata_inter_token_seconds_count", "strata_e2e_request_seconds_count", "strata_queue_time_seconds_count",
           "strata_step_seconds_count", "strata_batch_tokens_count", 'strata_expert_work_share{device="cpu"}',
           'strata_expert_work_share{device="gpu"}']


async def test_lane_reports_configured_affinity(engine_factory: EngineFactory) -> None:
    before = os.sched_getaffinity(0)
    core = max(before)
    async with running_lane(lane_config(name="b", cores=[core], gpu=1), engine_factory) as lane, \
            aiohttp.ClientSession() as s:
        async with s.get(lane.url + "/v1/lane") as r:
            info = await r.json()
        assert info["cores"] == [core] == info["configured_cores"]
        assert info["name"] == "b" and info["gpu"] == 1 and info["pid"] == os.getpid()
        assert info["status"] == "ready" and info["n_ctx"] == lane.state.engine.n_ctx
        assert info["engine_build"].startswith("strata-")
        model = info["model"]
        assert model["path"].endswith(".gguf") and model["size"] > 1 << 20 and len(model["sha256_first_mib"]) == 64
        assert info["config"]["cores"] == [core] and info["config"]["served_model_name"] == "strata-default"
    assert os.sched_getaffinity(0) == before  # restored when the app stops


async def test_lane_warms_its_engine_before_ready(engine_factory: EngineFactory, lane_engine: Engine,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A loading lane runs the engine's warm-up (a prefill and a decode step) before it turns ready, and gives
    every block back."""
    steps = lane_engine.last_step
    with caplog.at_level(logging.INFO, logger="strata.lanes"):
        async with running_lane(lane_config(name="w"), engine_factory) as lane:
            assert lane.state.status == "ready"
            assert lane_engine.last_step >= steps + 2
            assert lane_engine.blocks.num_free == lane_engine.blocks.n_blocks
    assert any("warmed up in" in r.getMessage() for r in caplog.records)


async def test_lane_starts_when_its_warm_up_fails(engine_factory: EngineFactory, lane_engine: Engine,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A warm-up that raises is logged at WARNING with its error, and the lane still turns ready and serves."""

    def broken(tokens: int | None = None) -> float:
        raise RuntimeError("no device memory for the warm-up step")

    monkeypatch.setattr(lane_engine, "warm_up", broken)
    with caplog.at_level(logging.INFO, logger="strata.lanes"):
        async with running_lane(lane_config(name="w"), engine_factory) as lane, aiohttp.ClientSession() as s:
            assert lane.state.status == "ready"
            async with s.post(lane.url + "/v1/completions",
                              json={"prompt": "hello", "max_tokens": 2, "temperature": 0}) as r:
                assert r.status == 200 and (await r.json())["usage"]["completion_tokens"] == 2
    warn = [r for r in caplog.records if r.levelno == logging.WARNING and "warm-up failed" in r.getMessage()]
    assert len(warn) == 1 and "RuntimeError: no device memory" in warn[0].getMessage()


async def test_auto_cores_split(engine_factory: EngineFactory) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    async with running_lane(lane_config(name="b", cores="auto"), engine_factory) as lane:
        want = cpus if len(cpus) == 1 else cpus[len(cpus) // 2:]
        assert sorted(os.sched_getaffinity(0)) == want == lane.state.cores


async def test_health_metrics_tokenize(engine_factory: EngineFactory, lane_engine: Engine) -> None:
    async with running_lane(lane_config(), engine_factory) as lane, aiohttp.ClientSession() as s:
        async with s.get(lane.url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ready"
        async with s.post(lane.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0,
                "stop_token_ids": [], "ignore_eos": False}) as r:
            assert r.status == 200
        async with s.post(lane.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1,
                                                              "stop_token_ids": list(range(lane_engine.hparams.n_vocab))}) as r:
            assert (await r.json())["choices"][0]["finish_reason"] == "stop"
        m = await scrape(s, lane.url)
        for name in METRICS:
            assert name in m, name
        assert m["strata_requests_running"] == 0 and m["strata_kv_usage_ratio"] == 0
        assert m["strata_generation_tokens_total"] >= 4 and m["strata_step_seconds_count"] >= 1
        assert m['strata_expert_work_share{device="cpu"}'] == 1 and m['strata_expert_work_share{device="gpu"}'] == 0
        async with s.post(lane.url + "/tokenize", json={"prompt": "Hello world"}) as r:
            tok = await r.json()
        assert tok["tokens"] == lane_engine.tokenizer.encode("Hello world")
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == lane_engine.n_ctx
        msgs = [{"role": "user", "content": "Hello"}]
        async with s.post(lane.url + "/tokenize", json={"messages": msgs, "add_generation_prompt": False}) as r:
            assert (await r.json())["tokens"] == lane_engine.render_chat(msgs, add_generation_prompt=False)
        async with s.post(lane.url + "/detokenize", json={"tokens": tok["tokens"]}) as r:
            assert (await r.json())["prompt"] == "Hello world"


async def test_pings_while_waiting_for_first_token(engine_factory: EngineFactory) -> None:
    """A request stuck behind a full batch gets ': ping' comments until its first token."""
    from engine.scheduler import SchedulerConfig

    cfg = lane_config(ping_interval_s=0.1, scheduler=SchedulerConfig(max_num_seqs=1))
    async with running_lane(cfg, engine_factory) as lane, aiohttp.ClientSession() as s:
        first = {"prompt": "One", "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        blocker = asyncio.create_task(s.post(lane.url + "/v1/completions", json=first))
        await eventually(lambda: lane.state.aeng.scheduler.num_running, lambda n: n == 1, 10.0, "the blocker running",
                         interval=0.01)
        body = {"prompt": "Two", "max_tokens": 2, "stream": True, "temperature": 0}
        async with s.post(lane.url + "/v1/completions", json=body) as r:
            lines = [raw.decode() async for raw in r.content]
        resp = await blocker
        assert resp.status == 200
        resp.release()
    events = [ln for ln in lines if ln.strip()]
    first_data = next(i for i, ln in enumerate(events) if ln.startswith("data: "))
    assert first_data >= 1 and all(ln.startswith(": ping") for ln in events[:first_data])
    assert events[-1].strip() == "data: [DONE]"


async def test_stream_ends_with_done_and_the_terminator_in_one_write(engine_factory: EngineFactory,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream's usage chunk, ``[DONE]`` and the chunked body's end leave in one write (one segment), so they
    arrive together: a proxy that stops at ``[DONE]`` finds the connection at its end and keeps it
    (gateway/proxy.py body_ended). The lane's socket writes are recorded where aiohttp makes them."""
    writes: list[bytes] = []
    plain, lines = StreamWriter._write, StreamWriter._writelines
    monkeypatch.setattr(StreamWriter, "_write", lambda self, c: (writes.append(bytes(c)), plain(self, c))[1])
    monkeypatch.setattr(StreamWriter, "_writelines",
                        lambda self, cs: (writes.append(b"".join(bytes(c) for c in cs)), lines(self, cs))[1])
    async with running_lane(lane_config(), engine_factory) as lane, aiohttp.ClientSession() as s:
        body = {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        async with s.post(lane.url + "/v1/completions", json=body) as r:
            assert (await r.read()).endswith(b"data: [DONE]\n\n")
    last = [w for w in writes if b"[DONE]" in w]
    assert len(last) == 1 and b'"usage":{' in last[0] and last[0].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_access_line_counts_the_requests_of_a_connection(engine_factory: EngineFactory,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """``conn=N``: the request's ordinal on its connection, 1 for a new one: a proxy that keeps its upstream
    connections shows 2, 3, ... (bench.gateway_overhead counts the gateway's requests that came on a new one)."""
    caplog.set_level(logging.INFO, logger="strata.lanes")
    async with running_lane(lane_config(), engine_factory) as lane, aiohttp.ClientSession() as s:
        for i in range(3):
            async with s.post(lane.url + "/tokenize", json={"prompt": "Hi"}, headers={"X-Request-Id": f"c{i}"}) as r:
                assert r.status == 200
    lines = [rec.getMessage() for rec in caplog.records if "POST /tokenize" in rec.getMessage()]
    assert [ln.split(" conn=")[1].split()[0] for ln in lines] == ["1", "2", "3"]
