"""The web chat page in a real headless Chromium (Debian's, driven by Playwright) against the real
stack: supervisord, two lanes with the default model, the gateway with documents and memory.

One browser page walks through the issue's list in order (the tests share it and depend on the
order): key entry, a streamed answer, stop, a second session and back, upload -> ready -> a cited
answer, markup shown as text, plain-word errors, the operator view, phone width, a screenshot
under var/web-ui/ (not committed).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import ADMIN_KEY, REPO, Stack

playwright = pytest.importorskip("playwright.sync_api", reason="the test extra installs playwright")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = REPO / "var" / "web-ui"
TIMEOUT_MS = 60_000
DOC = ("Quentin Harbor facts.\n\nThe Zorblat festival is held every March in Quentin Harbor. "
       "Visitors eat blue pancakes at the Zorblat festival.\n\n"
       "The harbor lighthouse is painted green and was built in 1911.\n")
MARKUP_DOC = ("# <img src=x onerror=\"window.__pwned=1\"> Harbor rules <script>window.__pwned=2</script>\n\n"
              "Boats must dock at pier nine. Pier nine is <b>reserved</b> for ferries.\n")


def _api(stack: Stack, method: str, path: str, key: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    req = urllib.request.Request(stack.gateway_url + path, data=data, method=method, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def browser(stack: Stack) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser: Any, stack: Stack) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1200, "height": 850})
    pg = ctx.new_page()
    pg.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    # an HTTP error status the page handles still logs "Failed to load resource": not a page error
    pg.on("console", lambda m: errors.append(m.text)
          if m.type == "error" and "Failed to load resource" not in m.text else None)
    offsite: list[str] = []
    own = (stack.gateway_url, "blob:", "data:")
    pg.on("request", lambda r: offsite.append(r.url) if not r.url.startswith(own) else None)
    pg.goto(stack.gateway_url + "/")
    yield pg
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    pg.screenshot(path=str(ARTIFACTS / "last.png"), full_page=True)
    ctx.close()
    assert not offsite, f"the page reached outside the gateway: {offsite}"
    assert not errors, f"errors in the page: {errors}"


@pytest.fixture(scope="module")
def user_key(stack: Stack) -> str:
    return _api(stack, "POST", "/v1/admin/keys", ADMIN_KEY, {"name": "web-ui"})["key"]


def _send(page: Any, text: str) -> Any:
    """Types ``text`` and presses Enter; returns the new assistant message once its stream has ended."""
    n = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    _wait(page, f"document.querySelectorAll('.msg.assistant').length > {n}")
    page.wait_for_selector("#stop:disabled")
    return page.locator(".msg.assistant").nth(n)


def _wait(page: Any, expr: str, timeout: float | None = None) -> None:
    """wait_for_function with a function, not an expression: the page's CSP forbids eval of a string."""
    page.wait_for_function(expr if expr.lstrip().startswith("()") else f"() => ({expr})", timeout=timeout)


def _pwned(page: Any) -> Any:
    return page.evaluate("window.__pwned")


# ---------------------------------------------------------------------------------------- the walk-through


def test_key_entry(page: Any, user_key: str) -> None:
    assert page.is_visible("#key-panel") and page.evaluate("document.activeElement.id") == "key-input"
    page.fill("#key-input", "sk-wrong-key-0000000000000000")
    page.click("#key-form button[type=submit]")
    _wait(page, "document.getElementById('key-status').textContent.includes('not accepted')")
    page.fill("#key-input", user_key)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("body[data-state='ready']")
    assert page.evaluate("localStorage.getItem('strata.apiKey')") == user_key
    assert user_key not in page.url
    assert page.is_hidden("#tab-operator")  # not an admin key
    _wait(page, "document.activeElement.id === 'prompt'")  # focus moves to the message box once loaded


def test_streamed_answer(page: Any) -> None:
    page.fill("#max-tokens", "24")
    page.fill("#temperature", "0")  # greedy: the answers below are the default model's fixed ones
    # count the distinct texts the answer goes through: token by token means many
    page.evaluate("""() => { window.__states = new Set();
        new MutationObserver(() => { const m = document.querySelectorAll('.msg.assistant .body');
            if (m.length) window.__states.add(m[m.length - 1].textContent); })
        .observe(document.getElementById('messages'),
                 {subtree: true, childList: true, characterData: true}); }""")
    msg = _send(page, "What is the capital of France? Answer in one sentence.")
    text = msg.locator(".body").inner_text()
    assert "Paris" in text
    assert page.evaluate("window.__states.size") >= 3, "the answer did not arrive in pieces"
    meta = msg.locator(".meta").inner_text()
    assert "lane " in meta and "completion tokens" in meta, meta
    assert page.locator("#session-list li").count() == 1  # the first message made a session


def _lane_aborts(stack: Stack) -> float:
    """Requests the two lanes ended as aborted (their /metrics)."""
    total = 0.0
    for program in ("lane_a", "lane_b"):
        with urllib.request.urlopen(stack.url(program) + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith('strata_requests_total{finish_reason="abort"} '):
                    total += float(line.split()[-1])
    return total


def test_stop_a_long_answer(page: Any, stack: Stack) -> None:
    page.fill("#max-tokens", "600")
    n = page.locator(".msg.assistant").count()
    aborts = _lane_aborts(stack)
    page.fill("#prompt", "Write a very long story about a dragon who learns to bake bread.")
    page.click("#send")
    _wait(page, f"""() => {{ const m = document.querySelectorAll('.msg.assistant .body');
        return m.length > {n} && m[{n}].textContent.length > 20; }}""")
    assert page.is_enabled("#stop")
    page.click("#stop")
    page.wait_for_selector("#stop:disabled")
    msg = page.locator(".msg.assistant").nth(n)
    assert "incomplete" in (msg.get_attribute("class") or "")
    assert "stopped" in msg.locator(".meta").inner_text()
    assert page.is_hidden("#error")
    # the stop reached the lanes: nothing keeps generating, and the request ended as aborted there (not by
    # running out its 600 tokens, which a slow box could also take long enough to pass a time limit)
    deadline = time.monotonic() + 60
    while True:
        lanes = _api(stack, "GET", "/v1/admin/overview", ADMIN_KEY)["lanes"]
        if all(lane["figures"]["running"] == 0 for lane in lanes) and _lane_aborts(stack) > aborts:
            break  # (a lane counts a request when its handler sees the end: a poll after the engine's)
        assert time.monotonic() < deadline, \
            f"the stopped request still runs or was not aborted: {lanes}; aborts {_lane_aborts(stack)} (was {aborts})"
        time.sleep(0.2)
    assert _lane_aborts(stack) == aborts + 1
    page.fill("#max-tokens", "24")


def test_second_session_and_back(page: Any) -> None:
    first = page.locator("#session-list li").first.get_attribute("data-id")
    page.click("#session-new")
    _wait(page, "document.querySelectorAll('#session-list li').length === 2")
    assert page.locator(".msg").count() == 0
    assert page.evaluate("document.activeElement.id") == "prompt"
    _send(page, "Say hello.")
    second = page.locator("#session-list li.current").get_attribute("data-id")
    assert second != first
    page.click(f"#session-list li[data-id='{first}'] .open")
    _wait(page, "document.querySelector('.msg.user') && "
                           "document.querySelector('.msg.user').textContent.includes('capital of France')")
    assert "Paris" in page.locator(".msg.assistant").first.inner_text()
    assert "dragon" in page.locator("#messages").inner_text()  # the stopped turn is kept, marked incomplete
    page.click(f"#session-list li[data-id='{second}'] .open")
    _wait(page, "document.querySelector('#messages').textContent.includes('Say hello.')")
    assert "capital of France" not in page.locator("#messages").inner_text()


def test_rename_session(page: Any) -> None:
    page.once("dialog", lambda d: d.accept("Greetings <i>x</i>"))
    page.locator("#session-list li.current .rename").click()
    _wait(page, "document.querySelector('#session-list li.current .open').textContent"
                           " === 'Greetings <i>x</i>'")


def test_upload_until_ready_and_cited_answer(page: Any, tmp_path: Path) -> None:
    page.fill("#collection-name", "harbor")
    page.press("#collection-name", "Enter")
    coll = page.locator("#collection-list li", has_text="harbor")
    coll.wait_for()
    assert coll.locator("input[type=checkbox]").is_checked()  # a new collection is attached
    doc = tmp_path / "harbor-facts.txt"
    doc.write_text(DOC)
    coll.locator("input[type=file]").set_input_files(str(doc))
    page.wait_for_selector(".doc[data-status='ready']", timeout=120_000)
    row = coll.locator(".doc[data-status='ready']")
    assert "harbor-facts.txt" in row.inner_text() and row.locator("progress").is_hidden()
    page.click("#session-new")
    _wait(page, "document.querySelectorAll('#session-list li').length === 3")
    msg = _send(page, "When is the Zorblat festival held?")
    cites = msg.locator(".citations")
    assert cites.count() == 1, msg.inner_text()
    assert "harbor-facts.txt" in cites.inner_text()


def test_screenshot_after_a_short_conversation(page: Any) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "chat.png"
    shot.unlink(missing_ok=True)
    page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_markup_in_documents_and_answers_is_text(page: Any, tmp_path: Path) -> None:
    coll = page.locator("#collection-list li", has_text="harbor")
    doc = tmp_path / "rules.md"
    doc.write_text(MARKUP_DOC)
    coll.locator("input[type=file]").set_input_files(str(doc))
    _wait(page, "document.querySelectorAll('.doc[data-status=\"ready\"]').length === 2",
                           timeout=120_000)
    page.fill("#max-tokens", "40")
    msg = _send(page, "Repeat exactly: <script>window.__pwned=3</script> "
                "<img src=x onerror=\"window.__pwned=4\"> Where must boats dock?")
    cites = msg.locator(".citations").inner_text()
    assert "rules.md" in cites
    assert "<img src=x" in cites and "<script>" in cites, cites  # the heading, shown as text
    user = page.locator(".msg.user").last.inner_text()
    assert "<script>window.__pwned=3</script>" in user
    assert page.locator("#messages script, #messages img, #messages b, #messages i").count() == 0
    assert _pwned(page) is None
    page.fill("#max-tokens", "24")


MARKUP_ANSWER = "<img src=x onerror=\"window.__pwned=5\"> <script>window.__pwned=6</script> **bold**"


def test_markup_in_a_stored_answer_is_text(page: Any, stack: Stack, user_key: str) -> None:
    """A model answer that is markup, made certain by a JSON schema with a const (greedy or not, the
    lane can only write it), stored by session memory and shown when the session is opened."""
    sid = _api(stack, "POST", "/v1/sessions", user_key, {"title": "markup answer"})["id"]
    schema = {"type": "object", "properties": {"a": {"const": MARKUP_ANSWER}}, "required": ["a"],
              "additionalProperties": False}
    out = _api(stack, "POST", "/v1/chat/completions", user_key, {
        "session_id": sid, "messages": [{"role": "user", "content": "Answer."}], "max_tokens": 80, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}})
    assert json.loads(out["choices"][0]["message"]["content"]) == {"a": MARKUP_ANSWER}
    page.reload()
    page.wait_for_selector("body[data-state='ready']")
    page.click(f"#session-list li[data-id='{sid}'] .open")
    _wait(page, "document.querySelector('.msg.assistant') && "
                "document.querySelector('.msg.assistant').textContent.includes('onerror')")
    text = page.locator(".msg.assistant").first.inner_text()
    assert "<img src=x" in text and "<script>window.__pwned=6</script>" in text, text
    assert page.locator("#messages script, #messages img").count() == 0
    assert _pwned(page) is None


def test_errors_in_plain_words(page: Any) -> None:
    n = page.locator(".msg.assistant").count()
    page.fill("#prompt", "word " * 4000)  # far past the 2048-token window of the test lanes
    page.press("#prompt", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    page.wait_for_selector("#stop:disabled")
    assert page.locator(".msg.assistant").count() == n  # no empty answer left behind
    assert page.input_value("#prompt").startswith("word word")  # the message is back for editing
    assert "does not fit the model's context window" in page.inner_text("#error")
    _send(page, "Thanks!")
    assert page.is_hidden("#error")


def test_phone_width(page: Any) -> None:
    page.set_viewport_size({"width": 390, "height": 800})
    try:
        assert page.is_hidden("#sidebar") and page.is_visible("#menu-toggle")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        box = page.locator("#send").bounding_box()
        assert box is not None and box["x"] + box["width"] <= 390
        page.click("#menu-toggle")
        assert page.is_visible("#sidebar")
        page.locator("#session-list li .open").first.click()  # picking a session closes the menu
        page.wait_for_selector("#sidebar", state="hidden")
        page.screenshot(path=str(ARTIFACTS / "phone.png"))
    finally:
        page.set_viewport_size({"width": 1200, "height": 850})


def test_operator_view(page: Any) -> None:
    page.click("#key-button")
    page.fill("#key-input", ADMIN_KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#tab-operator:not([hidden])")
    page.click("#tab-operator")
    page.wait_for_selector("#lane-rows tr[data-lane='a']")
    page.wait_for_selector("#lane-rows tr[data-lane='b']")
    row = page.locator("#lane-rows tr[data-lane='a'] td")
    assert row.nth(1).inner_text().startswith("ready") and row.nth(2).inner_text().startswith("cpu")
    # the second refresh has a tokens/s figure; the last step's frame has its parts
    _wait(page, "!document.querySelector(\"#lane-rows tr[data-lane='a'] td:nth-child(7)\")"
                           ".textContent.includes('...')")  # the page's default wait: a busy box renders late
    frames = [page.locator(f"#lane-rows tr[data-lane='{n}'] td").nth(7).inner_text() for n in "ab"]
    assert any("ms wall" in f and "experts" in f for f in frames), frames  # a lane that has stepped
    page.click("#tab-chat")
    assert page.is_visible("#chat-view")


def _use_key(page: Any, key: str) -> None:
    page.click("#key-button")
    page.fill("#key-input", key)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("body[data-state='ready']")


def _send_failing(page: Any, text: str) -> str:
    """Sends ``text`` expecting no answer; returns the error shown."""
    n = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector("#error:not([hidden])")
    page.wait_for_selector("#stop:disabled")
    assert page.locator(".msg.assistant").count() == n
    page.fill("#prompt", "")
    return page.inner_text("#error")


def test_rate_limit_and_no_lane_in_plain_words(page: Any, stack: Stack, user_key: str) -> None:
    limited = _api(stack, "POST", "/v1/admin/keys", ADMIN_KEY, {"name": "web-ui-rpm1", "rpm": 1})["key"]
    _use_key(page, limited)
    _send(page, "Hi.")
    error = _send_failing(page, "Hi again.")
    assert error.startswith("Rate limited") and "Try again in" in error, error
    _use_key(page, user_key)
    try:
        for lane in ("a", "b"):
            _api(stack, "PUT", f"/v1/admin/lanes/{lane}", ADMIN_KEY, {"drain": True})
        error = _send_failing(page, "Anyone there?")
        assert error.startswith("No lane is available"), error
    finally:
        for lane in ("a", "b"):
            _api(stack, "PUT", f"/v1/admin/lanes/{lane}", ADMIN_KEY, {"drain": False})
    _send(page, "Thanks!")
    assert page.is_hidden("#error")
