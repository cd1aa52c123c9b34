"""Session memory on the real stack (supervisord, the real gateway process, two real lanes with the default
model, a 2048-token window): ten facts planted in the first turns survive 60 filler turns that far
exceed the window, reaching the lane's prompt (checked in the request log of a key with text logging);
how often the model's answer names the fact is reported as a model-capability figure, not asserted.

The gateway runs with two ``[memory]`` settings of its own, both about cost, not about the claim: no
summarisation (the facts must come through retrieval; summaries through a lane are tested in
tests/gateway/test_sessions.py, and here each would cost a 160-token decode on a one-core lane
and a new head), and ``retrieve_min_score`` 0.5 (the filler turns share their wording, cosine 0.3-0.7
to each other, so at the default 0.25 every filler turn would pull up to four older ones into its
prompt; a question and its fact score about 0.75). Each filler talks about another topic, as a real
conversation would, rather than repeating one paragraph with a new number.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from tests.integration.conftest import ADMIN_KEY, Stack, start_stack

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

FACTS = [("my locker code", "4417"), ("my cat's name", "Pixel"), ("my favourite city", "Lisbon"),
         ("the project codename", "Marigold"), ("my dentist's name", "Dr Okafor"), ("my bike's colour", "teal"),
         ("the wifi password", "otter-92"), ("my sister's birthday", "March 3"), ("my car's plate", "KX-551"),
         ("the meeting room", "Room 7B")]
TOPICS = ["baking sourdough bread at home", "the rules of cricket", "repairing a bicycle puncture",
          "how glaciers carve valleys", "growing tomatoes on a balcony", "the history of the printing press",
          "learning the violin as an adult", "saving money on groceries", "how tides follow the moon",
          "painting a small bedroom", "training for a first marathon", "the life cycle of honeybees",
          "choosing a used car", "brewing green tea properly", "why leaves change colour in autumn",
          "knitting a winter scarf", "the architecture of Gothic cathedrals", "caring for a sourdough starter",
          "how vaccines train the immune system", "planning a camping trip", "the basics of chess openings",
          "composting kitchen scraps", "how bridges carry heavy loads", "keeping houseplants alive in winter",
          "the migration of arctic terns", "writing a clear cover letter", "how solar panels make electricity",
          "the origins of jazz music", "fixing a dripping kitchen tap", "photographing the night sky",
          "the rules of volleyball", "making fresh pasta by hand", "how volcanoes form islands",
          "teaching a dog to sit", "the Roman road network", "insulating an old attic", "the chemistry of soap",
          "sleeping better during heat waves", "how submarines dive and surface", "sewing a button back on",
          "the rings of Saturn", "pruning apple trees", "how elections count votes", "decorating a birthday cake",
          "the silk road trade routes", "cleaning a cast iron pan", "how wind turbines turn",
          "starting a book club", "the habits of octopuses", "tuning a guitar by ear", "how coffee is roasted",
          "building a bird feeder", "the water cycle", "ironing a shirt without creases",
          "how earthquakes are measured", "learning to juggle three balls", "the first moon landing",
          "packing a suitcase efficiently", "how bread rises", "the northern lights"]
N_FILLER = 60
MEMORY_CONFIG = "\n[memory]\nsummarize = false\nretrieve_min_score = 0.5\n"


def filler(i: int) -> str:
    t = TOPICS[i % len(TOPICS)]
    return (f"Changing the subject again ({i}): {t}. I have a few minutes before my next meeting, so I was "
            f"wondering whether {t} is harder than it looks. A friend of mine has strong opinions about it, but I "
            f"would rather hear yours. Give me one short tip.")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The repo's stack with the two [memory] settings above appended to the rendered gateway file."""

    def edit(conf: str) -> str:
        gw = next(Path(w) for w in conf.split() if w.endswith("gateway.toml"))
        gw.write_text(gw.read_text() + MEMORY_CONFIG)
        return conf

    with start_stack(tmp_path_factory.mktemp("sv"), edit_config=edit) as st:
        yield st


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
        t0 = time.monotonic()
        for i in range(N_FILLER):
            await _chat(s, url, key, sid, filler(i), 4)
        filler_s = time.monotonic() - t0
        # the questions must be able to retrieve: the model loads beside the fillers, but a busy box may be slower
        stack.wait_retrieval()
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
          f"last counts: {counts[-1]}; {N_FILLER} filler turns took {filler_s:.0f} s")
    assert in_prompt == len(FACTS), f"only {in_prompt}/10 planted facts reached the lane's prompt: {counts}"
