"""A real browser for the console's tests: Debian's `chromium` (scripts/test.sh installs it), driven by Playwright
for Python through `executable_path` (never `playwright install`: no browser download). Each test gets a fresh page
that records what the browser complained about (console errors, CSP violations, uncaught exceptions, responses
of 400 and over). A test module's fixtures: `browser` (`launch`, once a module) and `page` (`open_page`)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import Server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SHOTS = Path(__file__).resolve().parent.parent / "docs" / "console"

if not os.access(CHROMIUM, os.X_OK):  # pragma: no cover - only where the package cannot be installed
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium; scripts/test.sh installs it)",
        allow_module_level=True,
    )

from playwright.sync_api import Browser, Page, sync_playwright  # noqa: E402


def launch() -> Iterator[Browser]:
    """The browser, for a test module's fixture (`yield from launch()`)."""
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        yield b
        b.close()


class Watched:
    """A page and what went wrong on it."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.problems: list[str] = []  # and the expected refusals, which a test takes out (`refused`)
        page.on("console", lambda m: self.problems.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.problems.append(f"uncaught: {e}"))
        page.on("response", lambda r: self.problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)

    def csp_violations(self) -> list[str]:
        return [p for p in self.problems if "Content Security Policy" in p]


def open_page(browser: Browser, **context: Any) -> Iterator[Watched]:
    ctx = browser.new_context(**{"viewport": {"width": 1280, "height": 900}, **context})
    page = ctx.new_page()
    page.set_default_timeout(30_000)
    try:
        yield Watched(page)
    finally:
        ctx.close()


def shot(page: Page, name: str) -> None:
    """The README's screenshot of a view (docs/console/NAME.png)."""
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(map(float, found))
