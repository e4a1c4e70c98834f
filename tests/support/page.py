"""The swarm page of `dsd-node serve` in a real headless Chromium (Debian's `chromium` package): find the browser
(skipped without it, failed in CI), dump the DOM once the page's JavaScript has polled `/api/swarm`, and read it."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


def chromium_or_skip() -> str:
    """The chromium binary; without it the calling test fails in CI (CI=true) and is skipped elsewhere."""
    path = shutil.which("chromium")
    if path is None:
        why = "Debian's chromium is not installed (apt-get install chromium): the swarm page test needs it"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(why)
        pytest.skip(why)
    return path


class Dom(HTMLParser):
    """Every element of a dumped DOM with its attributes and text content."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.elements: list[dict] = []
        self._open: list[dict] = []
        self.feed(html)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        el = {"tag": tag, "attrs": dict(attrs), "text": []}
        self.elements.append(el)
        if tag not in VOID:
            self._open.append(el)

    def handle_endtag(self, tag: str) -> None:
        while self._open:
            el = self._open.pop()
            if self._open:
                self._open[-1]["text"].extend(el["text"])
            if el["tag"] == tag:
                return

    def handle_data(self, data: str) -> None:
        if self._open:
            self._open[-1]["text"].append(data)

    def with_class(self, cls: str) -> list[dict]:
        return [e for e in self.elements if cls in (e["attrs"].get("class") or "").split()]

    def text(self, el: dict) -> str:
        return "".join(el["text"]).strip()

    def by_id(self, ident: str) -> str:
        return self.text(next(e for e in self.elements if e["attrs"].get("id") == ident))


def run_chromium(chromium: str, profile: Path, url: str, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on `url`; `--virtual-time-budget` lets the page's fetches and timers run first."""
    cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
           "--virtual-time-budget=4000", *args, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def page_until(chromium: str, profile: Path, url: str, ready, seconds: float = 30.0) -> Dom:
    """Dump the page's DOM until `ready(dom)` holds (the page polls every 2 s; each dump is a fresh load)."""
    deadline = time.monotonic() + seconds
    while True:
        out = run_chromium(chromium, profile, url, "--dump-dom")
        assert out.returncode == 0, out.stderr[-2000:]
        dom = Dom(out.stdout)
        if ready(dom) or time.monotonic() > deadline:
            return dom
        time.sleep(0.5)


def cell(dom: Dom, row: dict, cls: str) -> dict | None:
    """The first element of class `cls` inside table row `row`, or None."""
    at = next(i for i, e in enumerate(dom.elements) if e is row)
    for e in dom.elements[at + 1:]:
        if e["tag"] == "tr":
            return None
        if cls in (e["attrs"].get("class") or "").split():
            return e
    return None
