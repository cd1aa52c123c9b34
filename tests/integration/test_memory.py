"""Session memory on the real stack (supervisord, the real gateway process, two real lanes with the default
model, a 2048-token window): ten facts planted in the first turns survive 60 long filler turns that far
exceed the window, reaching the lane's prompt (checked in the request log of a key with text logging);
how often the model's answer names the fact is reported as a model-capability figure, not asserted."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.integration.conftest import ADMIN_KEY, Stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FACTS = [("my locker code", "4417"), ("my cat's name", "Pixel"), ("my favourite city", "Lisbon"),
         ("the project codename", "Marigold"), ("my dentist's name", "Dr Okafor"), ("my bike's colour", "teal"),
         ("the wifi password", "otter-92"), ("my sister's birthday", "March 3"), ("my car's plate", "KX-551"),
         ("the meeting room", "Room 7B")]
FILLER = ("Here is some background I am thinking about today, number {i}: the river valley near the old mill has "
          "many walking paths, small bridges and quiet benches where people read newspapers in the morning, "
          "while gardeners trim hedges, children feed ducks and cyclists pass by on their way to the market "
          "square that opens every weekday at eight. What do you think about place {i}?")


def _key(stack: Stack, name: str) -> str:
    req = urllib.request.Request(stack.gateway_url + "/v1/admin/keys",
                                 data=json.dumps({"name": name, "log_prompts": True}).encode(),
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return str(json.loads(r.read())["key"])


async def _chat(s: aiohttp.ClientSession, url: str, key: str, sid: str, text: str,
                max_tokens: int) -> tuple[dict[str, Any], CIMultiDict[str]]:
    body = {"messages": [{"role": "user", "content": text}], "session_id": sid, "max_tokens": max_tokens,
            "temperature": 0}
    async with s.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        data = await r.json()
        assert r.status == 200, data
        return data, CIMultiDict(r.headers)  # header names are case-insensitive


async def test_planted_facts_survive_sixty_filler_turns(stack: Stack) -> None:
    stack.wait_gateway()
    url = stack.gateway_url
    key = _key(stack, "memory-facts")
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/sessions", json={"title": "facts"},
                          headers={"Authorization": f"Bearer {key}"}) as r:
            sid = (await r.json())["id"]
        for what, value in FACTS:
            await _chat(s, url, key, sid, f"Please remember: {what} is {value}.", 8)
        for i in range(60):
            await _chat(s, url, key, sid, FILLER.format(i=i), 4)
        async with s.get(url + f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {key}"}) as r:
            sess = await r.json()
        history = sum(t["tokens"] for t in sess["turns"])
        assert history > 2 * 2048, f"the history ({history} estimated tokens) does not far exceed the window"
        in_prompt, answered, counts = 0, 0, []
        for what, value in FACTS:
            data, headers = await _chat(s, url, key, sid, f"What is {what}?", 16)
            counts.append(headers["X-Strata-Memory"])
            req = urllib.request.Request(url + "/v1/admin/requests?limit=1000",
                                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
            with urllib.request.urlopen(req, timeout=30) as r:
                row = next(x for x in json.loads(r.read())["data"] if x["id"] == headers["X-Request-Id"])
            assert row["memory"] == headers["X-Strata-Memory"]
            if value.lower() in (row["prompt_text"] or "").lower():
                in_prompt += 1
            if value.lower() in (data["choices"][0]["message"]["content"] or "").lower():
                answered += 1
    print(f"\nmemory on the real stack: history {history} est. tokens over {sess['turns'][-1]['seq']} turns; "
          f"summary covers {sess['summary']['last_turn'] if sess['summary'] else 0} turns; "
          f"facts in the composed prompt {in_prompt}/10; answers naming the fact {answered}/10 (default model); "
          f"last counts: {counts[-1]}")
    assert in_prompt == len(FACTS), f"only {in_prompt}/10 planted facts reached the lane's prompt: {counts}"
