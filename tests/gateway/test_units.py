"""The pure parts: limits (with a fake clock), the window rules, lane choice and ejection."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.errors import APIError
from gateway.keys import KeyRecord
from gateway.limits import Limiter
from gateway.metrics import GatewayMetrics
from gateway.proxy import body_ended
from gateway.window import fit


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_rpm_sliding_window() -> None:
    clock = Clock()
    lim = Limiter(clock)
    key = KeyRecord(id=1, name="k", prefix="", rpm=3)
    for dt in (0, 10, 20):
        clock.t += dt
        lim.release(lim.admit(key))
    with pytest.raises(APIError) as e:
        lim.admit(key)
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.retry_after == pytest.approx(30.0)  # the first request (t=1000) leaves at 1060; now 1030
    clock.t = 1060.01
    lim.admit(key)


def test_concurrency_and_tpm() -> None:
    clock = Clock()
    lim = Limiter(clock)
    key = KeyRecord(id=2, name="k", prefix="", max_concurrent=2, tpm=100)
    t1, _ = lim.admit(key), lim.admit(key)
    with pytest.raises(APIError, match="in flight"):
        lim.admit(key)
    lim.release(t1)
    lim.release(t1)  # twice is harmless
    lim.admit(key)
    big = lim.reserve(key, 400, 100)  # an empty window lets one big request through
    clock.t += 30
    with pytest.raises(APIError) as e:
        lim.reserve(key, 10, 0)
    assert e.value.retry_after == pytest.approx(30.0)
    lim.settle(big, 450)  # it ended: 50 refunded, still too much for another request
    with pytest.raises(APIError):
        lim.reserve(key, 10, 0)
    clock.t += 31
    r = lim.reserve(key, 60, 0)
    lim.settle(r, 90)  # used more than reserved (a longer prompt count): charged in full
    with pytest.raises(APIError):
        lim.reserve(key, 20, 0)


def test_tpm_reserves_max_tokens_and_refunds() -> None:
    clock = Clock()
    lim = Limiter(clock)
    key = KeyRecord(id=3, name="k", prefix="", tpm=1000)
    held = [lim.reserve(key, 50, 250) for _ in range(3)]  # 900 held: parallel requests cannot overshoot
    with pytest.raises(APIError) as e:
        lim.reserve(key, 50, 250)
    assert e.value.extra["limit"] == "tpm" and "900 used or reserved" in e.value.message
    assert e.value.retry_after == pytest.approx(60.0)
    lim.settle(held[0], 50 + 10)  # it stopped after 10 tokens: 240 come back
    lim.settle(held[0], 50 + 300)  # settled once only
    clock.t += 5
    lim.reserve(key, 50, 250)  # 660 + 300 = 960 fits
    lim.settle(held[1], 0)  # failed before the lane saw it (settled with what it used: nothing)
    lim.settle(held[2], 50)  # the client left before any token
    lim.reserve(key, 50, 250)  # 60 + 0 + 50 + 300 + 300 = 710
    lim.reserve(key, 40, 0)
    with pytest.raises(APIError):
        lim.reserve(key, 1, 300)
    other = KeyRecord(id=4, name="o", prefix="")  # no tpm: never refused
    for _ in range(10):
        lim.reserve(other, 10**6, 10**6)


def test_window_rules() -> None:
    plan = fit([100], 1000, "chat", "max_tokens", 50, None, 16)
    assert plan.max_tokens == 50 and plan.clamp is None
    plan = fit([100], 1000, "chat", "max_tokens", 5000, None, 16)
    assert plan.max_tokens == 900 and plan.clamp is not None and plan.clamp.header() == "5000->900"
    plan = fit([100], 1000, "chat", "max_tokens", 5000, 64, 16)
    assert plan.max_tokens == 64 and plan.clamp.reason == "cap"  # type: ignore[union-attr]
    plan = fit([100], 1000, "chat", "max_tokens", None, 64, 16)
    assert plan.max_tokens == 64 and plan.clamp is None  # no limit asked: the cap, not a clamp
    assert fit([100], 1000, "chat", "max_tokens", None, None, 16).max_tokens is None
    plan = fit([990, 10], 1000, "completion", "max_tokens", 5, None, 16)
    assert plan.max_tokens == 5 and plan.prompt_tokens == 1000 and plan.longest_prompt == 990
    with pytest.raises(APIError) as e:
        fit([990], 1000, "chat", "max_completion_tokens", 50, None, 16)
    assert e.value.code == "context_length_exceeded" and e.value.param == "max_completion_tokens"
    assert e.value.extra == {"n_prompt_tokens": 990, "n_ctx": 1000}
    with pytest.raises(APIError) as e:
        fit([1000], 1000, "completion", "max_tokens", None, None, 16)
    assert e.value.param == "prompt" and e.value.extra["n_prompt_tokens"] == 1000
    assert fit([984], 1000, "chat", "max_tokens", 100, None, 16).max_tokens == 16  # exactly min_clamp left


def test_default_max_tokens() -> None:
    plan = fit([100], 1000, "chat", "max_tokens", None, None, 16, default=256)
    assert plan.max_tokens == 256 and plan.clamp is None and plan.max_new_tokens == 256
    assert fit([100], 1000, "chat", "max_tokens", None, 64, 16, default=256).max_tokens == 64  # the cap is lower
    plan = fit([990], 1000, "chat", "max_tokens", None, None, 16, default=256)
    assert plan.max_tokens == 10 and plan.clamp is None  # the window stays the hard limit; no 400 for 10 < 16
    assert fit([100], 1000, "chat", "max_tokens", 500, None, 16, default=256).max_tokens == 500  # asked: kept
    plan = fit([100], 1000, "chat", "max_tokens", None, None, 16)
    assert plan.max_tokens is None and plan.max_new_tokens == 900  # no default: the rest of the window
    plan = fit([100, 300], 1000, "completion", "max_tokens", None, None, 16, default=50)
    assert plan.n_prompts == 2 and plan.prompt_tokens == 400 and plan.max_new_tokens == 50
    with pytest.raises(APIError) as e:
        fit([1000], 1000, "chat", "max_tokens", None, None, 16, default=256)
    assert e.value.code == "context_length_exceeded"


def _dispatcher(**kw: object) -> Dispatcher:
    cfg = GatewayConfig(lanes=[{"name": "a", "url": "http://x:1"}, {"name": "b", "url": "http://x:2", "weight": 3}],
                        **kw)  # type: ignore[arg-type]
    d = Dispatcher(cfg, GatewayMetrics())
    for lane in d.lanes.values():
        lane.ready, lane.n_ctx, lane.model = True, 1000, "m"
    return d


def test_least_outstanding_per_weight() -> None:
    d = _dispatcher()
    a, b = d.lanes["a"], d.lanes["b"]
    b.in_flight = 2  # 2/3 < 1/1 once a has one
    a.in_flight = 1
    assert d.choose(None, set()) is b
    b.in_flight = 4  # 4/3 > 1/1
    assert d.choose(None, set()) is a
    b.in_flight = 3  # 3/3 == 1/1: ties at random
    assert {d.choose(None, set()).name for _ in range(64)} == {"a", "b"}  # type: ignore[union-attr]
    assert d.choose(None, {"a"}) is b
    assert d.choose(None, set(), model="other") is None


def test_affinity_is_sticky_and_weighted() -> None:
    d = _dispatcher()
    picks = Counter(d.choose(f"user-{i}", set()).name for i in range(4000))  # type: ignore[union-attr]
    assert 0.70 < picks["b"] / 4000 < 0.80  # weight 3 of 4
    assert all(d.choose("user-7", set()) is d.choose("user-7", set()) for _ in range(5))
    moved_to = {d.choose(f"user-{i}", {"a"}).name for i in range(200)}  # type: ignore[union-attr]
    assert moved_to == {"b"}
    d.set_lane("b", drain=True)
    assert {d.choose(f"user-{i}", set()).name for i in range(50)} == {"a"}  # type: ignore[union-attr]
    d.set_lane("b", drain=False, weight=0)
    assert d.routable() == [d.lanes["a"]]


def test_ejection_and_panic() -> None:
    d = _dispatcher(eject_after_failures=2, eject_cooldown_s=5)
    a = d.lanes["a"]
    d.failed(a, "connect", "refused")
    d.succeeded(a)  # consecutive failures only
    d.failed(a, "connect", "refused")
    assert not a.ejected(time.monotonic())
    d.failed(a, "connect", "refused")
    assert a.ejected(time.monotonic()) and a.describe()["ejected_until"] > time.time()
    assert d.routable() == [d.lanes["b"]]
    d.failed(d.lanes["b"], "status", "500")
    d.failed(d.lanes["b"], "status", "500")
    assert {lane.name for lane in d.routable()} == {"a", "b"}  # all ejected: ejection ignored


async def test_health_poll_timeouts_must_repeat_but_a_refusal_counts_at_once(unused_tcp_port: int) -> None:
    """A ready lane stays in rotation through ``health_timeouts_to_unready - 1`` slow polls (a loaded host),
    leaves on the last, and comes back on the next good poll; a refused connection takes it out at once."""
    answering = asyncio.Event()  # cleared: /health holds its answer until set

    async def health(_: web.Request) -> web.Response:
        await answering.wait()
        return web.json_response({"status": "ok"})

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 512}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    cfg = GatewayConfig(lanes=[{"name": "a", "url": f"http://127.0.0.1:{unused_tcp_port}"}],  # type: ignore[list-item]
                        health_timeout_s=1.0, health_timeouts_to_unready=3)
    d = Dispatcher(cfg, GatewayMetrics())
    lane = d.lanes["a"]
    async with aiohttp.ClientSession() as d.session:
        try:
            answering.set()
            await d.poll_lane(lane)
            assert lane.ready and lane.n_ctx == 512
            answering.clear()
            for expected in (True, True, False):
                await d.poll_lane(lane)
                assert lane.ready is expected and lane.last_error and "TimeoutError" in lane.last_error
            assert lane.health == "unreachable" and d.routable() == []
            answering.set()
            await d.poll_lane(lane)
            assert lane.ready and lane.poll_timeouts == 0
        finally:
            answering.set()
            await runner.cleanup()
        await d.poll_lane(lane)  # nothing listens now
        assert not lane.ready and lane.health == "unreachable"


async def test_a_finished_stream_keeps_its_upstream_connection(unused_tcp_port: int) -> None:
    """An upstream that sends ``[DONE]`` and its chunked terminator apart (two writes, 50 ms between): released at
    ``[DONE]``, aiohttp closes the connection and the next request opens another; read to the body's end first
    (``body_ended``), the connection goes back to the pool. One that never ends is given up after the timeout."""
    peers: list[int] = []

    async def stream(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.05 if request.query.get("end") != "never" else 30)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/s", stream)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    url = f"http://127.0.0.1:{unused_tcp_port}/s"
    try:
        async with aiohttp.ClientSession() as session:
            for wait_for_end in (False, False, True, True):
                up = await session.get(url)
                assert await up.content.readline() == b"data: [DONE]\n"
                if wait_for_end:
                    assert await body_ended(up)
                up.release()
            assert peers[0] != peers[1] != peers[2]  # released at [DONE]: a new connection each time
            assert peers[3] == peers[2]  # read to its end: the same connection again
            up = await session.get(url, params={"end": "never"})
            assert await up.content.readline() == b"data: [DONE]\n"
            t0 = time.monotonic()
            assert not await body_ended(up, timeout=0.2)
            assert time.monotonic() - t0 < 2
            up.close()
    finally:
        await runner.cleanup()
