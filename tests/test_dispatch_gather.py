"""`--dispatch-gather-ms`: long prompts that arrive a few milliseconds apart go to the ranks together, so a rank
group in lockstep prefills them in one step; without it the first one starts a step of its own and the others
wait for that whole step. Short prompts never wait, and a client that leaves while its prompt is held costs the
ranks nothing."""

from __future__ import annotations

import re
import threading
import time
from typing import Any

import anthropic
import httpx
from conftest import MODEL, Server, sse_has_text, wait_for

# Four ranks stepping together; a ~1,000-token prompt costs ~100 ms of prefill, a decode step 5 ms.
SIM = ("--dp", "4", "--sim-lockstep", "--sim-decode-step-ms", "5", "--sim-prefill-ms-per-1k-tokens", "100")
GATHER = ("--dispatch-gather-ms", "250", "--dispatch-gather-min-tokens", "500")
LONG = "the weather in Paris " * 200
STAGGER_S = 0.025  # the burst's requests leave the client this far apart


def body(content: str, max_tokens: int = 4) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": content}],
    }


def staggered_first_texts(srv: Server, n: int = 4, lead: bool = False) -> list[float]:
    """n streams of long prompts sent STAGGER_S apart; when each one's first text reached the client (s, one
    clock), in arrival order. `lead`: the others leave once the first is answered (its stream opens when it goes
    to a rank: on a loaded machine a client thread can lag its schedule by more than the stagger, and the first
    would not be first)."""
    firsts: list[float] = [0.0] * n
    opened = threading.Event()

    def one(i: int) -> None:
        time.sleep(i * STAGGER_S)
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body(LONG), timeout=60) as r:
            assert r.status_code == 200
            opened.set()
            for line in r.iter_lines():
                if sse_has_text(line) and not firsts[i]:
                    firsts[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    threads[0].start()
    if lead:
        assert opened.wait(30), "the first request was not answered"
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join()
    assert all(firsts), firsts
    return firsts


def test_gathered_burst_shares_one_prefill_step(make_server: Any) -> None:
    srv = make_server(*SIM, *GATHER)
    firsts = staggered_first_texts(srv)
    # All four went to the ranks in one window and were prefilled in one group step: their first tokens came out
    # of the same step (a step here is >= 100 ms), however far apart the requests arrived.
    assert max(firsts) - min(firsts) < 0.05, [round(f - firsts[0], 3) for f in firsts]
    # The wait is the TTFT breakdown's `dispatch` stage: 250 ms for the first, 75 ms less for the last.
    held = metric(srv, 'deepinfer_ttft_stage_seconds_sum{stage="dispatch"}')
    assert 0.4 < held < 1.2, held


def test_without_gathering_the_first_prompt_prefills_alone(make_server: Any) -> None:
    firsts = staggered_first_texts(make_server(*SIM), lead=True)
    # The first request's prefill step started alone; the others waited for it and came a whole step later (a
    # step is about 80 ms here: the prompt's ~800 tokens at 100 ms per 1k). Half a step tells the two apart: one
    # shared step puts them within a few ms of each other (the gathered test above).
    later = min(firsts[1:])
    assert later - firsts[0] > 0.04, [round(f - firsts[0], 3) for f in firsts]


def test_short_prompts_do_not_wait(make_server: Any) -> None:
    srv = make_server(*SIM, *GATHER)
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body("hello"), timeout=30) as r:
        assert r.status_code == 200 and r.read()
    wait_for("the request's log line", lambda: "request finished" in srv.log())
    ttfts = [float(x) for x in re.findall(r"request finished .* ttft_ms=([\d.]+)", srv.log())]
    assert len(ttfts) == 1 and ttfts[0] < 200, ttfts  # the window is 250 ms: it was not held


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return sum(map(float, found))


def test_a_client_that_leaves_while_held_never_reaches_a_rank(make_server: Any) -> None:
    srv = make_server(*SIM, "--dispatch-gather-ms", "1000", "--dispatch-gather-min-tokens", "500")
    url = f"{srv.url}/v1/chat/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body(LONG, 64)) as r:
        assert r.status_code == 200
        time.sleep(0.3)  # encoded and held: the window closes at 1 s
    wait_for("the abort", lambda: metric(srv, 'deepinfer_aborted_requests_total{reason="client_disconnect"}') == 1)
    time.sleep(1.0)  # the window has closed: a held record would have gone to its rank by now
    assert metric(srv, "vllm:prompt_tokens_total") == 0  # counted when a SUBMIT goes to a rank: this one never did
    assert metric(srv, "vllm:num_requests_running") == 0
    # The slot is free and the server serves the next request, which the same window rule holds and sends.
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body(LONG), timeout=30) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    assert metric(srv, "vllm:prompt_tokens_total") > 500


def test_every_door_goes_through_the_gather(make_server: Any) -> None:
    """The gather sits on the one request path after the codec: a long prompt on the openai SDK's Chat
    Completions and Responses and on the anthropic SDK's Messages is held, then served."""
    srv = make_server(*SIM, *GATHER)
    oai = srv.client()
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 4 and chat.usage.prompt_tokens >= 500
    resp = oai.responses.create(model=MODEL, input=LONG, max_output_tokens=4, extra_body={"ignore_eos": True})
    assert resp.usage is not None and resp.usage.output_tokens == 4
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    msg = claude.messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": LONG}], extra_body={"ignore_eos": True}
    )
    assert msg.usage.output_tokens == 4 and msg.usage.input_tokens >= 500
    # One at a time, each waited for its whole 250 ms window.
    held = metric(srv, 'deepinfer_ttft_stage_seconds_sum{stage="dispatch"}')
    assert 0.7 < held < 1.5, held
