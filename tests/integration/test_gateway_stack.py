"""The whole stack as ``make run`` starts it: supervisord, both lanes and the gateway from the
repo's supervisord.conf and deploy/gateway.toml (rendered onto free ports by conftest), a real
SQLite database, a 0600 admin key file, user keys made with the ``strata keys`` CLI.

Covers the official openai client through the gateway, the window precheck, failover with a
lane SIGKILLed under load (and supervisord bringing it back), an A/B rollout and an automatic
rollback with ``deploy/switch_lane.py`` under a steady load, per-key limits, body limits, and
the database holding no key material and no prompt text.

The tests share one stack and run in file order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from tests.http_helpers import wait_until
from tests.integration.conftest import ADMIN_KEY, BIN, REPO, Stack, dump_toml, http_get

pytestmark = pytest.mark.slow

MODEL = "strata-default"
MARKER = "zebra-quartz-7731"  # prompt text that must never reach the database
QUESTION = [{"role": "user", "content": f"What is the capital of France? ({MARKER}) Answer in one sentence."}]
KEYS: list[str] = []


def make_key(stack: Stack, name: str, *flags: str) -> str:
    r = subprocess.run([str(BIN / "strata"), "keys", "--config", str(stack.gateway_conf), "create", "--name", name,
                        *flags], capture_output=True, text=True, timeout=60, env={**stack.env, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key.startswith("sk-strata-") and key not in r.stderr
    KEYS.append(key)
    return key


@pytest.fixture(scope="module")
def key(stack: Stack) -> str:
    return make_key(stack, "it-user")


def post(url: str, body: bytes | dict[str, Any], key: str | None, timeout: float = 60.0
         ) -> tuple[int, dict[str, str], dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, dict(e.headers), json.loads(raw or b"{}")
        except ValueError:
            return e.code, dict(e.headers), {}


def admin_get(stack: Stack, path: str) -> Any:
    req = urllib.request.Request(stack.gateway_url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


# ---------------------------------------------------------------------------------------- 1. client


def test_openai_client_through_gateway(stack: Stack, key: str) -> None:
    status = stack.ctl("status").stdout
    assert "gateway" in status and "RUNNING" in status.split("gateway", 1)[1].split("\n")[0], status

    client = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL]

    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=QUESTION, max_tokens=16,
                                                           temperature=0)
    assert raw.headers.get("x-strata-lane") in ("a", "b")
    r = raw.parse()
    assert "Paris" in (r.choices[0].message.content or "")
    assert r.usage is not None and r.usage.completion_tokens > 0

    text, reasons = "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0,
                                                stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert text == r.choices[0].message.content and len(reasons) == 1

    comp = client.completions.create(model=MODEL, prompt=f"The capital of France ({MARKER}) is", max_tokens=8,
                                     temperature=0)
    assert comp.choices[0].text and comp.choices[0].finish_reason in ("stop", "length")

    nokey = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key="sk-strata-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nokey.models.list()
    code, _, body = post(stack.gateway_url + "/v1/chat/completions", {"messages": QUESTION}, None)
    assert code == 401 and body["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------------------------------- 2. window


def _tokens(stack: Stack, content: str) -> tuple[int, int]:
    _, _, body = post(stack.url("lane_a") + "/tokenize",
                      {"messages": [{"role": "user", "content": content}], "add_generation_prompt": True}, None)
    return int(body["count"]), int(body["max_model_len"])


def test_window_clamp_and_refusal(stack: Stack, key: str) -> None:
    base, n_ctx = _tokens(stack, "")
    per = (_tokens(stack, "hello " * 100)[0] - base) / 100
    words = int((n_ctx - 40 - base) / per)
    prompt = "hello " * words
    count, _ = _tokens(stack, prompt)
    assert 16 <= n_ctx - count <= 80, (count, n_ctx)

    code, headers, body = post(stack.gateway_url + "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": prompt}], "max_tokens": 500,
                                "temperature": 0}, key, timeout=120)
    assert code == 200, body
    assert headers.get("X-Strata-Max-Tokens-Clamped") == f"500->{n_ctx - count}", headers
    assert body["usage"]["prompt_tokens"] == count
    assert body["usage"]["completion_tokens"] <= n_ctx - count

    code, _, body = post(stack.gateway_url + "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "hello " * (n_ctx + 50)}], "max_tokens": 8}, key)
    assert code == 400, body
    err = body["error"]
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == n_ctx and err["n_prompt_tokens"] > n_ctx


# ---------------------------------------------------------------------------------------- 3. failover


async def _one(session: aiohttp.ClientSession, url: str, key: str, i: int) -> dict[str, Any]:
    stream = i % 2 == 0
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to ten, run {i}."}],
            "max_tokens": 12, "ignore_eos": True, "temperature": 0, "stream": stream}
    out: dict[str, Any] = {"i": i, "stream": stream, "error_event": False, "done": False, "text": ""}
    async with session.post(url + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {key}"}) as r:
        out["status"], out["id"], out["lane"] = r.status, r.headers.get("X-Request-Id"), r.headers.get("X-Strata-Lane")
        if not stream:
            data = await r.json()
            if r.status == 200:
                out["text"] = data["choices"][0]["message"]["content"]
            return out
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[6:]
            if payload == "[DONE]":
                out["done"] = True
                continue
            obj = json.loads(payload)
            if "error" in obj:
                out["error_event"] = True
            for ch in obj.get("choices") or []:
                out["text"] += (ch.get("delta") or {}).get("content") or ""
    return out


async def _load(stack: Stack, key: str, n: int, conc: int, kill_after: int) -> list[dict[str, Any]]:
    sem = asyncio.Semaphore(conc)
    finished = [0]
    killed = asyncio.Event()
    victim = stack.pid("lane_a")

    async def run(session: aiohttp.ClientSession, i: int) -> dict[str, Any]:
        async with sem:
            res = await _one(session, stack.gateway_url, key, i)
        finished[0] += 1
        if finished[0] >= kill_after and not killed.is_set():
            killed.set()
            os.kill(victim, signal.SIGKILL)
        return res

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(run(session, i) for i in range(n)))


def test_failover_when_a_lane_dies(stack: Stack, key: str) -> None:
    since = time.time() - 1
    old_pid = stack.pid("lane_a")
    results = asyncio.run(_load(stack, key, 40, 4, kill_after=6))
    for res in results:
        if res["status"] != 200:
            raise AssertionError(f"request failed: {res}")
        if res["stream"]:
            assert res["done"], res  # every stream ends with [DONE]
            assert res["error_event"] or res["text"], res
        else:
            assert res["text"], res
    broken = {r["id"] for r in results if r["error_event"]}

    rows = {r["id"]: r for r in admin_get(stack, f"/v1/admin/requests?since={since}&limit=1000")["data"]}
    for res in results:
        row = rows.get(res["id"])
        assert row is not None, f"request {res['id']} missing from the request log"
        if res["id"] in broken:
            assert row["error_type"] is not None, row
        else:
            assert row["status"] == 200 and row["error_type"] is None, row
            assert row["lane"] == res["lane"]

    info = stack.wait_ready("lane_a")  # supervisord restarted it
    assert info["pid"] != old_pid
    stack.wait_gateway()  # the gateway's health check has seen it back
    deadline = time.monotonic() + 40
    lanes_seen: set[str] = set()
    while "a" not in lanes_seen:
        assert time.monotonic() < deadline, f"no request reached the restarted lane a: {lanes_seen}"
        code, headers, _ = post(stack.gateway_url + "/v1/chat/completions",
                                {"messages": QUESTION, "max_tokens": 4}, key)
        assert code == 200
        lanes_seen.add(headers.get("X-Strata-Lane", "?"))
        time.sleep(0.2)


# ---------------------------------------------------------------------------------------- 4. rollout


class Load:
    """Sequential requests through the gateway on a thread; every non-200 is a failure."""

    def __init__(self, stack: Stack, key: str) -> None:
        self.stack, self.key = stack, key
        self.ok, self.failures, self.lanes = 0, [], set()  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            i += 1
            code, headers, body = post(self.stack.gateway_url + "/v1/chat/completions",
                                       {"messages": [{"role": "user", "content": f"Say hi {i}"}], "max_tokens": 4},
                                       self.key)
            if code == 200:
                self.ok += 1
                self.lanes.add(headers.get("X-Strata-Lane"))
            else:
                self.failures.append((code, body))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def answered(self, n: int, within: float = 60.0) -> None:
        """Wait until ``n`` more requests have been answered (the load is really flowing)."""
        target = self.ok + n
        wait_until(lambda: (self.ok, len(self.failures)), lambda v: v[0] >= target or v[1] > 0, within,
                   f"{n} more answered requests")

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def switch(stack: Stack, config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "python"), str(REPO / "deploy" / "switch_lane.py"),
                           "--supervisor-config", str(stack.conf), "--lane", "b", "--config", str(config),
                           "--step-hold-s", "1", "--health-timeout-s", "90", *extra],
                          capture_output=True, text=True, timeout=180, env={**stack.env, "PYTHONPATH": str(REPO)})


def history(stack: Stack) -> list[dict[str, Any]]:
    path = stack.dir / "var" / "rollout" / "history.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


@pytest.fixture
def lane_b_file(stack: Stack) -> Iterator[dict[str, Any]]:
    yield tomllib.loads((stack.dir / "lane_b.toml").read_text())


def test_rollout_and_rollback(stack: Stack, key: str, lane_b_file: dict[str, Any], tmp_path: Path) -> None:
    old_kv = lane_b_file["kv_tokens"]
    new = tmp_path / "lane_b_new.toml"
    new.write_text(dump_toml({**lane_b_file, "kv_tokens": old_kv - 512}))
    with Load(stack, key) as load:
        load.answered(3)
        r = switch(stack, new)
        load.answered(3)  # traffic keeps flowing after the switch
    assert r.returncode == 0, r.stdout + r.stderr
    assert not load.failures, load.failures[:3]
    assert load.ok > 5
    _, info = http_get(stack.url("lane_b") + "/v1/lane")
    assert info["config"]["kv_tokens"] == old_kv - 512
    last = history(stack)[-1]
    assert last["outcome"] == "switched" and last["lane"] == "b" and last["old_hash"] != last["new_hash"]
    assert [s["fraction"] for s in last["steps"]] == [0.1, 0.5, 1.0]
    lanes = {ln["name"]: ln for ln in admin_get(stack, "/v1/admin/lanes")["data"]}
    assert lanes["b"]["weight"] == 1.0 and not lanes["b"]["draining"] and lanes["b"]["ready"]
    assert ADMIN_KEY not in r.stdout + r.stderr

    # rejected before anything changes: a model path that does not exist fails --check-config
    missing = tmp_path / "lane_b_missing.toml"
    missing.write_text(dump_toml({**lane_b_file, "model": str(tmp_path / "nope.gguf")}))
    r = switch(stack, missing)
    assert r.returncode == 2, r.stdout + r.stderr
    assert history(stack)[-1]["outcome"] == "rejected"

    # a model file that exists but does not load: the lane goes FATAL -> automatic rollback
    bad_model = tmp_path / "broken.gguf"
    bad_model.write_bytes(b"this is not a gguf file" * 100)
    broken = tmp_path / "lane_b_broken.toml"
    broken.write_text(dump_toml({**lane_b_file, "model": str(bad_model)}))
    pid_before = stack.pid("lane_b")
    with Load(stack, key) as load:
        load.answered(3)
        r = switch(stack, broken)
        load.answered(3)
    assert r.returncode == 1, r.stdout + r.stderr
    assert not load.failures, load.failures[:3]
    last = history(stack)[-1]
    assert last["outcome"] == "rolled_back" and "FATAL" in (last["reason"] or ""), last
    info = stack.wait_ready("lane_b", timeout=60)
    assert info["pid"] != pid_before and info["config"]["kv_tokens"] == old_kv - 512 and not info["config"]["model"]
    lanes = {ln["name"]: ln for ln in admin_get(stack, "/v1/admin/lanes")["data"]}
    assert lanes["b"]["weight"] == 1.0 and not lanes["b"]["draining"]
    code, headers, _ = post(stack.url("lane_b") + "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4},
                            None)
    assert code == 200


# ---------------------------------------------------------------------------------------- 5. limits


async def _hold_then_probe(stack: Stack, key: str) -> list[tuple[int, dict[str, Any], str | None]]:
    url = stack.gateway_url + "/v1/chat/completions"
    hdr = {"Authorization": f"Bearer {key}"}
    out: list[tuple[int, dict[str, Any], str | None]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        body = {"messages": QUESTION, "max_tokens": 48, "ignore_eos": True, "stream": True}
        async with s.post(url, json=body, headers=hdr) as held:
            assert held.status == 200
            async with s.post(url, json={"messages": QUESTION, "max_tokens": 4}, headers=hdr) as r:
                out.append((r.status, await r.json(), r.headers.get("Retry-After")))
            await held.read()
        for _ in range(3):
            async with s.post(url, json={"messages": QUESTION, "max_tokens": 4}, headers=hdr) as r:
                out.append((r.status, await r.json(), r.headers.get("Retry-After")))
    return out


def test_key_limits_and_bodies(stack: Stack, key: str) -> None:
    limited = make_key(stack, "it-limited", "--rpm", "2", "--max-concurrent", "1")
    results = asyncio.run(_hold_then_probe(stack, limited))
    status, body, retry = results[0]
    assert status == 429 and body["error"]["limit"] == "concurrency" and retry, results[0]
    rpm = [r for r in results[1:] if r[0] == 429]
    assert rpm and rpm[-1][1]["error"]["limit"] == "rpm" and float(rpm[-1][2] or 0) >= 1, results

    code, _, body = post(stack.gateway_url + "/v1/chat/completions", b"{" + b" " * (5 * 1024 * 1024) + b"}", key)
    assert code == 413 and body["error"]["code"] == "request_too_large"
    code, _, body = post(stack.gateway_url + "/v1/chat/completions", b'{"messages": [', key)
    assert code == 400 and body["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------------------------------- 6. privacy


def test_database_and_logs_hold_no_secrets(stack: Stack) -> None:
    admin_get(stack, "/v1/admin/requests?limit=1")  # flushes the request log writer
    blobs = b""
    for path in (stack.dir / "var").glob("gateway.db*"):
        blobs += path.read_bytes()
    assert blobs, "no database file"
    assert oct((stack.dir / "var" / "gateway.db").stat().st_mode & 0o777) == oct(0o600)
    logs = b"".join(p.read_bytes() for p in (stack.dir / "var" / "log").glob("*.log"))
    assert KEYS
    for secret in [*KEYS, ADMIN_KEY]:
        assert secret.encode() not in blobs, "key material in the database"
        assert secret.encode() not in logs, "key material in a log"
    assert MARKER.encode() not in blobs, "prompt text in the database for a key without --log-prompts"
    assert MARKER.encode() not in logs
