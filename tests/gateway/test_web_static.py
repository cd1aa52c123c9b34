"""The web page's files, read as files: no inline script or style, no off-site URL, no HTML parsing
of text in the script; the operator view's Prometheus parsing."""

from __future__ import annotations

import re
from html.parser import HTMLParser

from gateway.web import STATIC_DIR, lane_figures


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.script_text = ""
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.script_text += data


def test_page_has_no_inline_script_style_or_handlers() -> None:
    p = _Tags()
    p.feed((STATIC_DIR / "index.html").read_text())
    scripts = [a for t, a in p.tags if t == "script"]
    assert scripts and all(a.get("src", "").startswith("/static/") for a in scripts)
    assert not p.script_text.strip()
    for tag, attrs in p.tags:
        assert "style" not in attrs, tag
        assert not [k for k in attrs if k.startswith("on")], tag
        for k in ("src", "href"):
            v = attrs.get(k)
            assert v is None or v.startswith("/static/"), (tag, k, v)  # no CDN, nothing off-site
    assert tag != "style"


def test_script_builds_dom_without_html_parsing() -> None:
    js = (STATIC_DIR / "app.js").read_text()
    code = "\n".join(ln for ln in js.splitlines() if not ln.strip().startswith("//"))
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function",
                 "DOMParser", "createContextualFragment"):
        assert sink not in code, sink
    ids = set(re.findall(r'\$\("([\w-]+)"\)', js))
    html_ids = set(re.findall(r'\bid="([\w-]+)"', (STATIC_DIR / "index.html").read_text()))
    assert ids and ids <= html_ids, ids - html_ids
    assert "localStorage" in js and not re.search(r"[?&](api_)?key=", js)  # the key never rides in a URL


def test_lane_figures_from_prometheus_text() -> None:
    assert lane_figures("")["running"] is None
    sample = "\n".join([
        "# TYPE strata_requests_running gauge", "strata_requests_running 2.0",
        "# TYPE strata_requests_waiting gauge", "strata_requests_waiting 5.0",
        "# TYPE strata_generation_tokens counter", "strata_generation_tokens_total 1234.0",
        "strata_generation_tokens_created 1.7e9",
        "# TYPE strata_last_step_seconds gauge", 'strata_last_step_seconds{part="wall"} 0.05',
        'strata_last_step_seconds{part="experts"} 0.03', "# TYPE strata_last_step_tokens gauge",
        "strata_last_step_tokens 7.0", ""])
    f = lane_figures(sample)
    assert f["running"] == 2 and f["waiting"] == 5 and f["generation_tokens"] == 1234
    assert f["last_step"] == {"wall": 0.05, "experts": 0.03} and f["last_step_tokens"] == 7
