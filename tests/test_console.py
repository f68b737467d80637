"""The built-in console (issue 43), in a real browser: it loads under a strict CSP, its status view draws what
GET /console/status says and its charts move under a load, it asks for the key when one is set (and the data behind
it refuses without), it works behind --root-path, at 390 px, in dark mode and by keyboard, and `--console off`
turns it off. The playground and batches views: tests/test_console_views.py."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, Server, start_server
from playwright.sync_api import Browser, expect

from console_browser import Watched, launch, open_page, shot
from test_tls import CA


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launch()


@pytest.fixture
def page(browser: Browser) -> Iterator[Watched]:
    yield from open_page(browser, color_scheme="light")


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server("--served-model-name", MODEL, "--dp", "2", "--max-num-seqs", "8")
    yield s
    s.stop()


def test_the_page_and_its_files_carry_a_strict_csp(srv: Server) -> None:
    for path in ["/", "/console/app.js", "/console/style.css"]:
        r = httpx.get(srv.url + path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "default-src 'none'" in csp
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp, csp
        assert r.headers["x-content-type-options"] == "nosniff"
    assert httpx.get(srv.url + "/console/nope.js").status_code == 404
    # A write from a page of another origin is still refused, the console's own origin is not.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    foreign = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Origin": "https://evil.example"})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    own = httpx.post(srv.url + "/v1/chat/completions", json=body, headers={"Origin": srv.url})
    assert own.status_code == 200, own.text


def test_the_status_endpoint_is_compact_and_holds_no_text(srv: Server) -> None:
    secret = "a prompt nobody else may read"
    srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": secret}],
        max_tokens=8,
        extra_body={"thinking": {"type": "disabled"}},
    )
    r = httpx.get(srv.url + "/console/status")
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    s = r.json()
    assert (s["model"], s["engine"], s["parallel"]) == (MODEL, "sim", {"dp": 2, "ep": 2, "cp": 1})
    assert [x["state"] for x in s["ranks"]] == ["ready", "ready"]
    assert s["slots"]["total"] == 16 and s["slots"]["queued"] == 0
    assert s["finished"].get("length", 0) + s["finished"].get("stop", 0) >= 1
    assert secret not in r.text and "prompt" not in r.text
    assert len(r.content) < 32_000, len(r.content)


def test_the_console_loads_and_its_charts_move_under_a_load(srv: Server, page: Watched) -> None:
    p = page.page
    p.goto(srv.url + "/")
    expect(p.locator("#s-layout")).to_have_text("DP 2 · EP 2 · CP 1")
    expect(p.locator("#health")).to_have_text("healthy")
    expect(p.locator("#s-ranks tr")).to_have_count(2)
    expect(p.locator("#model")).to_contain_text(MODEL)
    stop = threading.Event()

    def load() -> None:
        c = srv.client()
        while not stop.is_set():
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "load"}],
                max_tokens=64,
                extra_body={"thinking": {"type": "disabled"}},
            )

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        # The tokens chart gets points and its rate a value within seconds: the page polls every second.
        # (Locators, not wait_for_function: the page's CSP refuses the string evaluation that would need.)
        some = re.compile(r"^[1-9]")
        expect(p.locator("#c-tokens")).to_have_attribute("data-points", some, timeout=15_000)
        expect(p.locator("#c-ttft")).to_have_attribute("data-points", some, timeout=15_000)
        first = p.locator("#c-tokens").get_attribute("data-points")
        expect(p.locator("#c-tokens")).not_to_have_attribute("data-points", first or "", timeout=15_000)
        expect(p.locator("#s-tps")).not_to_have_text("0.0")
        expect(p.locator("#s-ttft")).not_to_have_text("– / –")
    finally:
        stop.set()
        for w in workers:
            w.join()
    shot(p, "status")
    assert not page.problems, page.problems


def test_narrow_dark_and_keyboard(srv: Server, browser: Browser) -> None:
    for watched in open_page(browser, viewport={"width": 390, "height": 844}, color_scheme="dark"):
        p = watched.page
        p.goto(srv.url + "/")
        expect(p.locator("#s-layout")).to_have_text("DP 2 · EP 2 · CP 1")
        bg = p.evaluate("getComputedStyle(document.body).backgroundColor")
        assert bg == "rgb(19, 20, 23)", f"dark follows the system setting: {bg}"
        # The tabs by keyboard: arrow keys move between views, which never scroll sideways at 390 px.
        p.locator("#tab-status").focus()
        for view in ["batches", "playground", "status"]:
            p.keyboard.press("ArrowRight")
            expect(p.locator(f"#view-{view}")).to_be_visible()
            assert p.evaluate("document.activeElement.dataset.view") == view
            width = p.evaluate("document.documentElement.scrollWidth")
            assert width <= 390, f"{view} is {width} px wide"
        shot(p, "status-dark-390")
        assert not watched.problems, watched.problems


def test_the_key_is_asked_for_and_kept_in_the_tab_only(browser: Browser) -> None:
    s = start_server("--served-model-name", MODEL, "--api-key", "sekrit", "--root-path", "/deepinfer")
    try:
        assert httpx.get(s.url + "/console/status").status_code == 401
        assert httpx.get(s.url + "/deepinfer/console/status").status_code == 401
        ok = httpx.get(s.url + "/console/status", headers={"Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and ok.json()["model"] == MODEL
        for watched in open_page(browser):
            p = watched.page
            p.goto(s.url + "/deepinfer/")  # through the prefix: every call the page makes is relative
            expect(p.locator("#key-dialog")).to_be_visible()
            p.fill("#key-input", "wrong")
            p.keyboard.press("Enter")
            expect(p.locator("#key-error")).to_have_text("That key was refused.")
            p.fill("#key-input", "sekrit")
            p.keyboard.press("Enter")
            expect(p.locator("#key-dialog")).to_be_hidden()
            expect(p.locator("#s-layout")).to_have_text("DP 1 · EP 1 · CP 1")
            assert p.evaluate("sessionStorage.getItem('deepinfer-console-key')") == "sekrit"
            assert p.evaluate("localStorage.length") == 0
            assert p.evaluate("document.cookie") == ""
            shot(p, "key")
            assert not watched.csp_violations(), watched.problems
    finally:
        s.stop()


def test_console_off() -> None:
    s = start_server("--served-model-name", MODEL, "--console", "off")
    try:
        for path in ["/", "/console/app.js", "/console/status"]:
            r = httpx.get(s.url + path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", path
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_the_status_endpoint_costs_well_under_a_millisecond(srv: Server) -> None:
    with httpx.Client(base_url=srv.url) as c:
        c.get("/console/status")
        t0 = time.perf_counter()
        n = 200
        for _ in range(n):
            c.get("/console/status")
        per_call = (time.perf_counter() - t0) / n
    # Over loopback HTTP with httpx's own cost included: the server's share is measured in bench/console.py.
    assert per_call < 0.005, f"{per_call * 1e3:.2f} ms a call"


def test_the_console_over_tls(browser: Browser, tmp_path: Path) -> None:
    server = CA(tmp_path, "console-ca").issue("127.0.0.1", server=True)
    s = start_server("--served-model-name", MODEL, "--ssl-certfile", str(server.cert), "--ssl-keyfile", str(server.key))
    try:
        assert s.url.startswith("https://")
        for watched in open_page(browser, ignore_https_errors=True):
            p = watched.page
            p.goto(s.url + "/")
            expect(p.locator("#s-layout")).to_have_text("DP 1 · EP 1 · CP 1")
            expect(p.locator("#health")).to_have_text("healthy")
            assert p.evaluate("window.isSecureContext") is True
            assert not watched.problems, watched.problems
    finally:
        s.stop()
