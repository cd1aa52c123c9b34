"""Failover: a lane that fails before the first token is retried once elsewhere and ejected after
repeated failures; a lane that fails mid-stream ends the stream with an SSE error event and [DONE]."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from gateway.dispatch import rendezvous_score
from lanes.server import drain
from tests.gateway.conftest import ADMIN_KEY, GW, auth, gateway_config, running_gateway, running_lane
from tests.http_helpers import scrape

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _session_for(lane: str, other: str, avoid: frozenset[str] = frozenset()) -> str:
    """A session id whose affinity picks ``lane`` over ``other`` (equal weights)."""
    for i in range(1000):
        sid = f"session-{i}"
        if sid not in avoid and rendezvous_score(sid, lane, 1.0) > rendezvous_score(sid, other, 1.0):
            return sid
    raise AssertionError("no session id found")


async def _admin(http: aiohttp.ClientSession, gw: GW, path: str) -> dict:
    async with http.get(gw.url + path, headers=auth(ADMIN_KEY)) as r:
        assert r.status == 200
        return await r.json()


async def test_failover_before_first_token_then_ejection(gateway_engines: tuple, tmp_path: Path) -> None:
    async with running_lane("live", gateway_engines[0]) as live, running_lane("doomed", gateway_engines[1]) as doomed:
        cfg = gateway_config(tmp_path, [{"name": "doomed", "url": doomed.url}, {"name": "live", "url": live.url}],
                             health_interval_s=60, eject_after_failures=2, eject_cooldown_s=30)
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            assert {lane.name for lane in gw.state.dispatcher.routable()} == {"doomed", "live"}
            key = gw.key()
            s1 = _session_for("doomed", "live")
            s2 = _session_for("doomed", "live", frozenset({s1}))
            client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)

            # a 5xx: the lane drains (503 server_draining; its /tokenize still answers)
            assert await drain(doomed.app, timeout=1)
            raw = await client.chat.completions.with_raw_response.create(
                model="strata-default", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                extra_body={"session_id": s1})
            assert raw.headers["X-Strata-Lane"] == "live" and raw.parse().choices[0].message.content

            # a connection error: the lane is gone (the gateway's health poll still believes it ready)
            await doomed.runner.cleanup()
            stream = await client.completions.create(model="strata-default", prompt="Hello", max_tokens=4, stream=True,
                                                     extra_body={"session_id": s2})
            assert "".join([c.choices[0].text async for c in stream if c.choices])
            await client.close()

            rows = (await _admin(http, gw, "/v1/admin/requests?limit=2"))["data"]
            assert [(r["lane"], r["retried"], r["status"]) for r in rows] == [("live", True, 200)] * 2
            lanes = {x["name"]: x for x in (await _admin(http, gw, "/v1/admin/lanes"))["data"]}
            assert lanes["doomed"]["ejected_until"] is not None and lanes["live"]["ejected_until"] is None
            m = await scrape(http, gw.url, ADMIN_KEY)
            assert m['strata_gateway_lane_ejections_total{lane="doomed"}'] == 1
            assert m['strata_gateway_retries_total{lane="doomed"}'] == 2
            assert m['strata_gateway_upstream_failures_total{kind="status",lane="doomed"}'] == 1
            assert m['strata_gateway_upstream_failures_total{kind="connect",lane="doomed"}'] == 1

            # ejected: the same session now goes straight to the live lane
            body = {"prompt": "Hi", "max_tokens": 2, "session_id": s1}
            async with http.post(gw.url + "/v1/completions", json=body, headers=auth(key)) as r:
                assert r.status == 200 and r.headers["X-Strata-Lane"] == "live"
            rows = (await _admin(http, gw, "/v1/admin/requests?limit=1"))["data"]
            assert rows[0]["retried"] is False

            # a lane's 4xx is never retried
            async with http.post(gw.url + "/v1/completions", json={**body, "temperature": -1},
                                 headers=auth(key)) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "temperature"
            rows = (await _admin(http, gw, "/v1/admin/requests?limit=1"))["data"]
            assert rows[0]["retried"] is False and rows[0]["status"] == 400

            # nothing left: an OpenAI-shaped 502
            await live.runner.cleanup()
            async with http.post(gw.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                                 headers=auth(key)) as r:
                err = (await r.json())["error"]
                assert r.status == 502 and err["code"] == "upstream_unavailable" and err["type"] == "server_error"
                # it names the problem, never the lane's address or the client library's exception text
                assert "could not connect" in err["message"], err
                for secret in ("127.0.0.1", str(live.url.rsplit(":", 1)[1]), "Cannot connect", "Error"):
                    assert secret not in err["message"], err


async def _read_until(content: aiohttp.StreamReader, n_data: int) -> list[str]:
    lines: list[str] = []
    async for raw in content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            lines.append(line)
            if len(lines) == n_data:
                break
    return lines


async def test_failure_after_first_token_is_an_sse_error_event(gateway_engines: tuple, tmp_path: Path) -> None:
    async with running_lane("victim", gateway_engines[1], shutdown_timeout=0.05) as victim:
        cfg = gateway_config(tmp_path, [{"name": "victim", "url": victim.url}])
        async with running_gateway(cfg) as gw, aiohttp.ClientSession() as http:
            key = gw.key()
            body = {"prompt": "A long story:", "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with http.post(gw.url + "/v1/completions", json=body, headers=auth(key)) as r:
                assert r.status == 200
                lines = await _read_until(r.content, 3)
                kill: asyncio.Task[None] = asyncio.create_task(victim.runner.cleanup())  # the lane dies mid-stream
                rest = await asyncio.wait_for(_read_until(r.content, 10_000), 30)
                await kill
            assert all("error" not in json.loads(ln[6:]) for ln in lines)
            assert rest[-1] == "data: [DONE]"
            err = json.loads(rest[-2][6:])["error"]
            assert err["type"] == "server_error" and err["code"] in ("upstream_error", "server_stopping")
            assert err["message"]
            row = (await _admin(http, gw, "/v1/admin/requests?limit=1"))["data"][0]
            assert row["status"] == 200 and row["error_type"] == err["code"] and row["lane"] == "victim"
