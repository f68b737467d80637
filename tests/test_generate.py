"""SGLang's native `/generate` over real HTTP (httpx) on the sim: text and token-ID prompts, batches and `n`, stop
strings and stop tokens, exact lengths, logprobs (the prompt's too), grammars, cumulative streams, SGLang's error
envelope and the fan-out bound. Shapes as SGLang 0.5's `GenerateReqInput` and `TokenizerManager` have them."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import httpx
import pytest
from conftest import Server, wait_for

GREEDY = {"temperature": 0}


def generate(srv: Server, body: dict[str, Any], status: int = 200) -> Any:
    r = httpx.post(f"{srv.url}/generate", json=body, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def events(srv: Server, body: dict[str, Any]) -> list[Any]:
    """A streamed /generate's data payloads, checked to end with one [DONE]."""
    with httpx.stream("POST", f"{srv.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def tokenize(srv: Server, text: str) -> list[int]:
    return list(httpx.post(f"{srv.url}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"])


def detokenize(srv: Server, ids: list[int]) -> str:
    return str(httpx.post(f"{srv.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"])


def test_text_and_input_ids_give_the_same_answer_in_sglangs_shape(server: Server) -> None:
    prompt = "Once upon a time"
    body = {"text": prompt, "rid": "gen-text-1", "sampling_params": {**GREEDY, "max_new_tokens": 12}}
    out = generate(server, body)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    ids = tokenize(server, prompt)
    assert meta["id"] == "gen-text-1" and meta["prompt_tokens"] == len(ids) and meta["weight_version"] == "default"
    assert meta["completion_tokens"] == len(out["output_ids"]) > 0 and meta["cached_tokens"] == 0
    assert meta["e2e_latency"] > 0 and meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == 12
    # The token IDs are the prompt as given: the same prompt as IDs gets the same answer.
    by_ids = generate(server, {"input_ids": ids, "sampling_params": {**GREEDY, "max_new_tokens": 12}})
    assert by_ids["output_ids"] == out["output_ids"] and by_ids["text"] == out["text"]
    assert by_ids["meta_info"]["prompt_tokens"] == len(ids)
    assert out["text"] == detokenize(server, [t for t in out["output_ids"] if t > 2])  # special tokens skipped
    # The rid is the request's id on the server (its log line), so /abort_request can find it.
    wait_for("the request's log line", lambda: "request_id=gen-text-1 " in server.log(), 5)


def test_batches_and_n_answer_one_list_in_sglangs_order(server: Server) -> None:
    prompts = ["Hello", "The weather today is quite", "One two three four five six"]
    sp = {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}
    singles = [generate(server, {"text": p, "sampling_params": sp}) for p in prompts]
    batch = generate(server, {"text": prompts, "sampling_params": sp, "rid": "b"})
    assert isinstance(batch, list) and len(batch) == 3
    for i, (one, single) in enumerate(zip(batch, singles, strict=True)):
        assert one["output_ids"] == single["output_ids"] and one["meta_info"]["id"] == f"b_{i}"
    ids = [tokenize(server, p) for p in prompts[:2]]
    listed = generate(
        server, {"input_ids": ids, "rid": ["p", "q"], "sampling_params": [sp, {**sp, "max_new_tokens": 3}]}
    )
    assert [o["meta_info"]["id"] for o in listed] == ["p", "q"]
    assert [o["meta_info"]["completion_tokens"] for o in listed] == [6, 3]
    # n samples of each prompt: prompt by prompt, each one's samples together (k * n answers).
    fanned = generate(server, {"text": prompts[:2], "rid": "f", "sampling_params": {**sp, "n": 3, "temperature": 1}})
    assert len(fanned) == 6
    assert [o["meta_info"]["prompt_tokens"] for o in fanned] == [len(ids[0])] * 3 + [len(ids[1])] * 3
    assert [o["meta_info"]["id"] for o in fanned] == [f"f_{i}_{j}" for i in range(2) for j in range(3)]
    # n > 1 on one prompt is a list too (SGLang turns it into a batch of one).
    assert len(generate(server, {"text": "Hello", "sampling_params": {**sp, "n": 2}})) == 2


def test_stop_strings_stop_tokens_and_no_stop_trim(server: Server) -> None:
    sp = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True}
    full = generate(server, {"text": "Once", "sampling_params": sp})
    text, ids = full["text"], full["output_ids"]
    word = text.split()[2]
    cut = generate(server, {"text": "Once", "sampling_params": {**sp, "stop": [word]}})
    assert cut["text"] == text[: text.index(word)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": word}
    assert ids[: len(cut["output_ids"])] == cut["output_ids"] and len(cut["output_ids"]) < len(ids)
    kept = generate(server, {"text": "Once", "sampling_params": {**sp, "stop": word, "no_stop_trim": True}})
    assert kept["text"] == text[: text.index(word) + len(word)]
    # A stop token ends the output with it: in output_ids (it was sampled), not in the text unless no_stop_trim.
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i] and ids[i] > 2)
    sp = {**sp, "ignore_eos": False, "stop_token_ids": [ids[k]]}
    stopped = generate(server, {"text": "Once", "sampling_params": sp})
    assert stopped["output_ids"] == ids[: k + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": ids[k]}
    assert stopped["text"] == detokenize(server, ids[:k])
    trim = {**sp, "no_stop_trim": True}
    assert generate(server, {"text": "Once", "sampling_params": trim})["text"] == detokenize(server, ids[: k + 1])
    # As in SGLang, ignore_eos turns the stop tokens off (and not the stop strings).
    ignored = generate(server, {"text": "Once", "sampling_params": {**sp, "ignore_eos": True}})
    assert ignored["output_ids"] == ids and ignored["meta_info"]["finish_reason"]["type"] == "length"


def test_ignore_eos_and_max_new_tokens_give_exact_lengths(server: Server) -> None:
    sp = {"max_new_tokens": 17, "ignore_eos": True}
    out = generate(server, {"text": "x", "sampling_params": sp})
    assert len(out["output_ids"]) == out["meta_info"]["completion_tokens"] == 17
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 17}
    # SGLang's default is 128 new tokens.
    default = generate(server, {"text": "x", "sampling_params": {"ignore_eos": True}})
    assert default["meta_info"]["completion_tokens"] == 128


def test_logprobs_output_top_and_the_prompts(server: Server) -> None:
    prompt = "The quick brown fox"
    n_prompt = len(tokenize(server, prompt))
    body = {"text": prompt, "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}  # fmt: skip
    out = generate(server, {**body, "logprob_start_len": 0})
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [e[1] for e in lps] == out["output_ids"] and meta["output_token_logprobs_length"] == 5
    assert all(isinstance(e[0], float) and e[0] <= 0 and e[2] is None for e in lps)
    tops = meta["output_top_logprobs"]
    assert len(tops) == 5 and all(1 <= len(t) <= 3 for t in tops)
    for (value, token, _), top in zip(lps, tops, strict=True):
        assert [e[0] for e in top] == sorted((e[0] for e in top), reverse=True)
        assert value <= top[0][0] + 1e-6 and all(isinstance(e[1], int) and e[2] is None for e in top)
        assert token not in [e[1] for e in top] or value == next(e[0] for e in top if e[1] == token)
    ins = meta["input_token_logprobs"]
    assert len(ins) == n_prompt and ins[0][0] is None and all(isinstance(e[0], float) for e in ins[1:])
    assert [e[1] for e in ins] == tokenize(server, prompt)
    assert len(meta["input_top_logprobs"]) == n_prompt and meta["input_top_logprobs"][0] is None
    later = generate(server, {**body, "logprob_start_len": 2, "return_text_in_logprobs": True})["meta_info"]
    assert [e[0] for e in later["input_token_logprobs"]] == [e[0] for e in ins[2:]]
    assert all(isinstance(e[2], str) for e in later["output_token_logprobs"])
    # Without logprob_start_len only the output's (SGLang's default, -1).
    plain = generate(server, body)["meta_info"]
    assert plain["input_token_logprobs"] == [] and len(plain["output_token_logprobs"]) == 5
    # The prompt's logprobs are the model's own distribution: not with another temperature while generating.
    refused = generate(server, {**body, "logprob_start_len": 0, "sampling_params": {"temperature": 0.5}}, 400)
    assert refused["error"]["param"] == "sampling_params.temperature"


def test_json_schema_and_regex_constrain_the_output(server: Server) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string", "maxLength": 8}},
              "required": ["n", "s"]}  # fmt: skip
    for given in (json.dumps(schema), schema):
        out = generate(server, {"text": "JSON:", "sampling_params": {"json_schema": given, "max_new_tokens": 64}})
        doc = json.loads(out["text"])
        assert isinstance(doc["n"], int) and isinstance(doc["s"], str) and len(doc["s"]) <= 8
    pattern = "[0-9]{3}-[a-z]{2}"
    out = generate(server, {"text": "code:", "sampling_params": {"regex": pattern, "max_new_tokens": 32}})
    assert re.fullmatch(pattern, out["text"]), out["text"]
    bad = generate(server, {"text": "x", "sampling_params": {"regex": "(?<=a)b"}}, 400)
    assert bad["error"]["param"] == "sampling_params.regex" and bad["error"]["code"] == 400


def test_streams_are_cumulative_and_end_with_one_done(server: Server) -> None:
    sp = {**GREEDY, "max_new_tokens": 24, "ignore_eos": True}
    whole = generate(server, {"text": "Once", "rid": "s-json", "sampling_params": sp, "return_logprob": True})
    got = events(server, {"text": "Once", "rid": "s-1", "sampling_params": sp, "return_logprob": True})
    assert len(got) > 1
    for before, after in itertools.pairwise(got):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert before["meta_info"]["finish_reason"] is None
    last = got[-1]
    assert last["text"] == whole["text"] and last["output_ids"] == whole["output_ids"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 24} and last["meta_info"]["id"] == "s-1"
    assert [e[1] for e in last["meta_info"]["output_token_logprobs"]] == whole["output_ids"]
    assert "index" not in last
    # A batch's stream: every sequence's events as they come, each with its index, then one [DONE].
    batch = events(server, {"text": ["a", "bb"], "sampling_params": {**sp, "n": 2, "max_new_tokens": 4}})
    ends = {e["index"]: e for e in batch if e["meta_info"]["finish_reason"] is not None}
    assert sorted(ends) == [0, 1, 2, 3] and all(e["meta_info"]["completion_tokens"] == 4 for e in ends.values())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"text": 5}, "text"),
        ({}, "text"),
        ({"text": "x", "input_ids": [1]}, "text"),
        ({"input_ids": [[1], []]}, "input_ids[1]"),
        ({"text": "x", "sampling_params": {"min_p": 0.5}}, "sampling_params.min_p"),
        ({"text": "x", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"max_new_tokens": 9000}}, "sampling_params.max_new_tokens"),
        ({"text": "x", "lora_path": "adapter"}, "lora_path"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
        ({"input_ids": [10**9]}, "input_ids"),
    ],
)
def test_malformed_requests_get_sglangs_envelope(server: Server, body: dict[str, Any], param: str) -> None:
    err = generate(server, body, 400)
    assert set(err) == {"error"} and err["error"]["param"] == param and err["error"]["code"] == 400
    assert err["error"]["message"] and err["error"]["type"] == "invalid_request_error"


def test_not_json_and_a_streamed_refusal_are_statuses_in_the_envelope(server: Server) -> None:
    r = httpx.post(f"{server.url}/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    r = httpx.post(f"{server.url}/generate", json={"text": 1, "stream": True})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json" and "error" in r.json()


def test_the_fanout_is_bounded_by_its_limit(make_server: Any) -> None:
    srv = make_server("--max-generate-fanout", "4", "--max-generate-fanout-bytes", "4096", "--max-num-seqs", "3")
    sp = {"max_new_tokens": 2, "ignore_eos": True}
    assert len(generate(srv, {"text": ["a", "b", "c"], "sampling_params": sp})) == 3
    err = generate(srv, {"text": ["a", "b", "c"], "sampling_params": {**sp, "n": 2}}, 400)
    assert err["error"]["param"] == "sampling_params.n" and "--max-generate-fanout" in err["error"]["message"]
    # The bytes the sequences hold together (each prompt once per sample) are bounded too.
    long = "word " * 300
    assert generate(srv, {"text": long, "sampling_params": {**sp, "n": 2}})[1]["meta_info"]["completion_tokens"] == 2
    err = generate(srv, {"text": long, "sampling_params": {**sp, "n": 3}}, 400)
    assert err["error"]["param"] == "text" and "--max-generate-fanout-bytes" in err["error"]["message"]
    # Each sequence takes a slot; past the free ones (3, with no wait queue) its sequences wait for slots, as SGLang
    # queues every sequence it is given: 4 sequences on 3 slots all come back.
    four = generate(srv, {"text": ["a", "b"], "sampling_params": {**sp, "n": 2}})
    assert len(four) == 4 and all(o["meta_info"]["completion_tokens"] == 2 for o in four)
    wait_for("the fan-out's slots to be free", lambda: httpx.get(f"{srv.url}/get_load").json()["load"] == 0)
    assert len(generate(srv, {"text": ["a", "b", "c"], "sampling_params": sp})) == 3


def test_a_fanout_that_finds_the_server_full_is_refused_whole(make_server: Any) -> None:
    srv = make_server("--max-num-seqs", "2", "--sim-decode-step-ms", "20")
    body = {"text": "a", "sampling_params": {"n": 2, "max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with httpx.stream("POST", f"{srv.url}/generate", json=body, timeout=30) as s:
        assert s.status_code == 200
        lines = s.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # both slots are taken
        # Its first sequence finds neither a slot nor a place in a queue (none is configured): a 429, SGLang's
        # envelope, and nothing of it runs.
        full = generate(srv, {"text": ["b", "c"], "sampling_params": {"max_new_tokens": 2}}, 429)
        assert full["error"]["code"] == 429
    wait_for("every slot to be free", lambda: httpx.get(f"{srv.url}/get_load").json()["load"] == 0)


def test_the_key_guards_it_and_a_client_that_leaves_frees_every_sequence(make_server: Any) -> None:
    srv = make_server("--api-key", "gen-key", "--sim-decode-step-ms", "20")
    body = {"text": ["a", "b"], "sampling_params": {"n": 2, "max_new_tokens": 500, "ignore_eos": True}}
    r = httpx.post(f"{srv.url}/generate", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401  # in SGLang's envelope
    auth = {"Authorization": "Bearer gen-key"}
    with httpx.stream("POST", f"{srv.url}/generate", json={**body, "stream": True}, headers=auth, timeout=30) as s:
        assert s.status_code == 200
        lines = s.iter_lines()  # kept: a dropped iterator closes the stream
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert httpx.get(f"{srv.url}/get_load").json()["load"] == 4
    # The stream closed early: all four sequences are aborted and their slots freed, long before 500 tokens.
    wait_for("every sequence's slot to be free", lambda: httpx.get(f"{srv.url}/get_load").json()["load"] == 0, 3)
