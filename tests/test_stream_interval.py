"""`--stream-interval-ms`: tokens that come sooner than the interval after a stream's last event wait and leave
together; the first visible output and the end are never held, and held tokens leave on time even if nothing else
arrives.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx
from conftest import MODEL, Server

NO_THINK = {"thinking": {"type": "disabled"}}


def timed_chunks(srv: Server, max_tokens: int, seed: int = 11) -> list[tuple[float, dict]]:
    """(seconds since the request was sent, chunk) for every chunk of one stream with continuous usage."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about rivers"}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed,
        **NO_THINK,
    }
    out = []
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        t0 = time.monotonic()
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append((time.monotonic() - t0, json.loads(line[6:])))
    return out


def token_events(chunks: list[tuple[float, dict]]) -> list[tuple[float, int, str]]:
    """(time, completion tokens so far, text) of the chunks that carry text."""
    return [
        (t, c["usage"]["completion_tokens"], c["choices"][0]["delta"]["content"])
        for t, c in chunks
        if c["choices"] and c["choices"][0]["delta"].get("content")
    ]


def answer(srv: Server, max_tokens: int, seed: int = 11) -> str:
    r = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Tell me about rivers"}],
        max_tokens=max_tokens,
        seed=seed,
        extra_body={"ignore_eos": True, **NO_THINK},
    )
    return r.choices[0].message.content or ""


def test_fast_engine_tokens_leave_in_few_events_first_and_last_unheld(make_server: Callable[..., Server]) -> None:
    srv = make_server("--dp", "1", "--stream-interval-ms", "400")
    chunks = timed_chunks(srv, 200)
    events = token_events(chunks)
    # A zero-cost engine makes all 200 tokens within milliseconds: the first drained ones go at once, the rest
    # wait for the end of the request (which is never held), not for the 400 ms interval.
    assert 2 <= len(events) <= 3, [n for _, n, _ in events]
    assert chunks[-1][1]["usage"]["completion_tokens"] == 200
    assert chunks[-1][0] < 0.3, f"the end waited for the interval: {chunks[-1][0]:.3f} s"
    assert "".join(text for _, _, text in events) == answer(srv, 200)


def test_held_tokens_leave_when_due_without_new_tokens(make_server: Callable[..., Server]) -> None:
    # Steps of 200 ms, interval 500 ms: token 1 goes at once; tokens 2 and 3 (at ~200 and ~400 ms) are held
    # and must leave at ~500 ms by the timer, not with token 4 at ~600 ms.
    srv = make_server("--dp", "1", "--sim-decode-step-ms", "200", "--stream-interval-ms", "500")
    events = token_events(timed_chunks(srv, 6))
    counts = [n for _, n, _ in events]
    assert counts[:2] == [1, 3], counts
    gap = events[1][0] - events[0][0]
    assert 0.4 < gap < 0.6, f"second event {gap:.3f} s after the first"
    assert counts[-1] == 6
    assert "".join(text for _, _, text in events) == answer(srv, 6)


def test_interval_below_the_step_never_merges_tokens(make_server: Callable[..., Server]) -> None:
    srv = make_server("--dp", "1", "--sim-decode-step-ms", "40", "--stream-interval-ms", "5")
    events = token_events(timed_chunks(srv, 12))
    counts = [n for _, n, _ in events]
    # Each 40 ms step's token is its own event; allow one merge for a scheduling hiccup on a loaded machine.
    assert len(events) >= 11 and counts[-1] == 12, counts


def test_the_interval_counts_from_output_the_client_can_see(make_server: Callable[..., Server]) -> None:
    # A tool call opens with blank lines and DSML markup, which show nothing until the tool's name is parsed (16
    # tokens, ~0.5 s at 30 ms steps); the whole call takes 46 tokens (~1.4 s). The invisible first tokens must not
    # start the 5 s interval, which would hold the name back until the end.
    srv = make_server("--dp", "1", "--sim-decode-step-ms", "30", "--stream-interval-ms", "5000")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "stream": True,
        **NO_THINK,
    }
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        t0 = time.monotonic()
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and '"tool_calls"' in line:
                    seen = time.monotonic() - t0
                    break
    assert json.loads(line[6:])["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert seen < 1.0, f"the tool call waited for the interval: {seen:.3f} s"


def test_the_first_token_of_every_answer_is_visible(make_server: Callable[..., Server]) -> None:
    # The simulator's answers begin with a word: a leading newline would be dropped by the parser and show the
    # client its first token one step late (about 3 in 10 answers did). One token per event here.
    srv = make_server("--dp", "1", "--sim-decode-step-ms", "5", "--stream-interval-ms", "0")
    for seed in range(12):
        events = token_events(timed_chunks(srv, 4, seed=seed))
        assert events and events[0][1] == 1, (seed, [(n, text) for _, n, text in events])


def test_quiet_steps_wake_the_server_within_its_stream_interval() -> None:
    """A rank publishes a step that starts and ends nothing without waking the server (engine/loop.py), which is
    only safe because the server holds such tokens for its stream interval: the wake bound follows the interval."""
    from deepinfer_server.engine.loop import WakePolicy

    every_step = WakePolicy(0.0)  # tokens are sent as they come: every step wakes the server
    assert all(every_step(True, 5.0 + i * 1e-5) for i in range(10))

    capped = WakePolicy(3.0)  # the interval is longer than the 1 ms bound
    assert capped(True, 5.0)
    assert not capped(True, 5.0009)
    assert capped(False, 5.00095)  # a first or last token always wakes it, and restarts the bound
    assert not capped(True, 5.0019)
    assert capped(True, 5.00196)

    short = WakePolicy(0.25)
    assert short(True, 7.0) and not short(True, 7.0002) and short(True, 7.00026)
