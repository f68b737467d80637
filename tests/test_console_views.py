"""The console's playground and batches views in a real browser (issue 43): a streamed answer with its reasoning
folded and its numbers, a stop button that cancels the request on the server (the metrics say so), an answer made
of markup that shows as text and runs nothing, the request copied as Python that runs, and a batch whose progress
bar reaches 100 %."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import pytest
from conftest import MODEL, Server, start_server, wait_for
from playwright.sync_api import Browser, Page, expect

from console_browser import Watched, launch, metric, open_page, shot

# A markup answer the sim is made to write: its JSON-schema grammar allows only this string.
XSS = "<img src=x onerror=window.pwned=1><script>window.pwned=2</script>"
ABORTED = 'deepinfer_aborted_requests_total{reason="client_disconnect"}'


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    yield from launch()


@pytest.fixture
def page(browser: Browser) -> Iterator[Watched]:
    yield from open_page(browser, color_scheme="light")


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    # Decoding paced at 10 ms a step: a long answer is still running when the test presses stop.
    s = start_server("--served-model-name", MODEL, "--sim-decode-step-ms", "10", "--max-num-seqs", "8")
    yield s
    s.stop()


def playground(p: Page, srv: Server) -> None:
    p.goto(srv.url + "/#playground")
    expect(p.locator("#view-playground")).to_be_visible()
    expect(p.locator("#model")).to_contain_text(MODEL)  # the status poll names the model the playground sends


def test_a_streamed_answer_with_reasoning_folded_and_its_numbers(srv: Server, page: Watched) -> None:
    p = page.page
    playground(p, srv)
    p.fill("#p-system", "You are terse.")
    p.fill("#p-max", "400")
    p.fill("#p-input", "Tell me about rivers.")
    p.keyboard.press("Control+Enter")
    answer = p.locator("#p-log li.assistant").last
    # Streamed: the reasoning shows while the answer is still being written.
    expect(answer.locator("details .reasoning")).not_to_be_empty()
    expect(answer).to_have_attribute("data-finish", re.compile("^(stop|length)$"), timeout=60_000)
    assert answer.locator("details").get_attribute("open") is None, "reasoning is folded"
    stats = answer.locator(".stats").text_content() or ""
    assert re.match(r"\d+ tokens · TTFT \d+ ms · [\d.]+ tokens/s", stats), stats
    shot(p, "playground")
    # The next request, copied as Python: it runs against this server and prints an answer.
    p.uncheck("#p-think")
    p.fill("#p-max", "12")
    p.fill("#p-input", "And lakes?")
    p.click("#p-python")
    code = p.locator("#p-snippet").text_content() or ""
    assert "from openai import OpenAI" in code and '"thinking"' in code, code
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr
    p.click("#p-curl")
    curl = p.locator("#p-snippet").text_content() or ""
    assert curl.startswith("curl -N ") and "/v1/chat/completions" in curl and '"max_tokens": 12' in curl
    assert not page.problems, page.problems


def test_stop_cancels_the_request_on_the_server(srv: Server, page: Watched) -> None:
    p = page.page
    playground(p, srv)
    p.uncheck("#p-think")
    p.fill("#p-max", "3000")
    p.fill("#p-input", "Write at length.")
    before = metric(srv, ABORTED)
    p.click("#p-send")
    answer = p.locator("#p-log li.assistant").last
    expect(answer.locator(".text").first).not_to_be_empty()
    expect(p.locator("#p-stop")).to_be_enabled()
    p.click("#p-stop")
    expect(answer).to_have_attribute("data-finish", "stopped")
    wait_for("the server's abort", lambda: metric(srv, ABORTED) == before + 1, timeout=10)
    expect(p.locator("#p-send")).to_be_enabled()


def test_an_answer_made_of_markup_shows_as_text_and_runs_nothing(srv: Server, page: Watched) -> None:
    p = page.page
    playground(p, srv)
    p.uncheck("#p-think")
    p.locator("#p-schema").evaluate("e => e.closest('details').open = true")
    schema = {"type": "object", "properties": {"html": {"type": "string", "enum": [XSS]}}, "required": ["html"]}
    p.fill("#p-schema", json.dumps(schema))
    p.fill("#p-input", "Say it.")
    p.click("#p-send")
    answer = p.locator("#p-log li.assistant").last
    expect(answer).to_have_attribute("data-finish", "stop", timeout=30_000)
    assert json.loads(answer.locator(".text").first.text_content() or "") == {"html": XSS}
    assert p.evaluate("window.pwned") is None
    assert p.locator("#p-log img, #p-log script").count() == 0
    assert not page.problems, page.problems


def test_a_batch_progress_bar_reaches_100(srv: Server, page: Watched) -> None:
    c = srv.client()
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 24},
        }
        for i in range(24)
    ]
    f = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    p = page.page
    p.goto(srv.url + "/#batches")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    item = p.locator(f'[data-batch="{b.id}"]')
    bar = item.locator('[role="progressbar"]')
    expect(bar).to_be_visible()
    expect(bar).to_have_attribute("aria-valuenow", "100", timeout=60_000)
    expect(item).to_contain_text("24 completed, 0 failed of 24 (100 %)")
    expect(item.get_by_role("button", name="Download output")).to_be_visible()
    expect(p.locator("#f-list")).to_contain_text("in.jsonl")
    # An Anthropic message batch beside it, in its own terms, with its results to download.
    reqs = [
        {
            "custom_id": f"m{i}",
            "params": {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(6)
    ]
    mb = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0).messages.batches.create(requests=reqs)  # type: ignore[arg-type]
    item = p.locator(f'[data-batch="{mb.id}"]')
    expect(item.locator('[role="progressbar"]')).to_have_attribute("aria-valuenow", "100", timeout=60_000)
    expect(item).to_contain_text("6 completed, 0 failed of 6 (100 %)")
    expect(item).to_contain_text("Anthropic · /v1/messages · ended")
    with p.expect_download() as dl:
        item.get_by_role("button", name="Download results").click()
    got = [json.loads(x) for x in Path(dl.value.path()).read_text().splitlines()]
    assert sorted(x["custom_id"] for x in got) == [f"m{i}" for i in range(6)]
    shot(p, "batches")
    assert not page.problems, page.problems


def test_a_running_batch_is_cancelled_from_its_button(srv: Server, page: Watched) -> None:
    c = srv.client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "ignore_eos": True}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(64)]
    f = c.files.create(file=("long.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode())), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    p = page.page
    p.goto(srv.url + "/#batches")
    item = p.locator(f'[data-batch="{b.id}"]')
    item.get_by_role("button", name=f"Cancel {b.id}").click()
    expect(item).to_contain_text("cancelled", timeout=60_000)
    assert c.batches.retrieve(b.id).status == "cancelled"
    expect(item.get_by_role("button", name=f"Cancel {b.id}")).to_have_count(0)
    assert not page.problems, page.problems
