"""The seam between Rust and Python: the records that cross it (`PrepareInput`, `ConstraintInput`, `Prepared`,
`Refusal`, `DecodeBatch`, `Submit`, `Abort`, `Shutdown`, `Output`, `StepOutputs`) and the codes both sides use are
defined once, in Rust, and exported; `_native.pyi` describes them, mypy checks the package against it, and this file
checks it against the module itself, and feeds every shape of each record through."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import MODEL

from deepinfer_server import _native
from deepinfer_server.codec import Codec, decode_batch
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY
from deepinfer_server.doors import DOORS, ChatDoor, CompletionsDoor, GenerateDoor, MessagesDoor, ResponsesDoor
from deepinfer_server.launcher import BUNDLED_TOKENIZER

ROOT = Path(__file__).resolve().parent.parent


def test_the_stubs_describe_the_module_as_it_is() -> None:
    # mypy.stubtest imports the built module and compares every name, class, signature and default with the stub:
    # a record field or an argument added on one side only fails here.
    allow = ROOT / "tests" / "stubtest_allowlist.txt"
    cmd = [sys.executable, "-m", "mypy.stubtest", "deepinfer_server._native", "--allowlist", str(allow)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_door_the_codec_knows_is_one_rust_exports_under_its_code() -> None:
    exported = {
        name.removeprefix("DOOR_").lower(): getattr(_native, name) for name in dir(_native) if name.startswith("DOOR_")
    }
    assert exported.keys() == {"chat", "completions", "messages", "responses", "generate"}
    assert len(set(exported.values())) == len(exported)
    classes = {
        "chat": ChatDoor,
        "completions": CompletionsDoor,
        "messages": MessagesDoor,
        "responses": ResponsesDoor,
        "generate": GenerateDoor,
    }
    assert {code: type(door) for code, door in DOORS.items()} == {exported[n]: c for n, c in classes.items()}


def test_no_door_writes_its_code_by_hand() -> None:
    # A door's code is `_native.DOOR_*`; an integer literal there would mirror Rust by hand again.
    for path in (ROOT / "python" / "deepinfer_server" / "doors").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
                assert not isinstance(node.value, ast.Constant), f"{path.name}: code = {ast.unparse(node.value)}"


def test_decode_states_are_the_ones_rust_reads() -> None:
    assert (RUNNING, FINISHED, STOPPED_EARLY) == (
        _native.DECODE_RUNNING,
        _native.DECODE_FINISHED,
        _native.DECODE_STOPPED_EARLY,
    )
    assert len({RUNNING, FINISHED, STOPPED_EARLY}) == 3


def test_a_record_built_wrong_fails_where_it_is_built() -> None:
    # The codec builds its answer as a typed record: a wrong field fails in Python, at the line that built it,
    # not later in Rust as a 500.
    good = dict(
        prompt_ids=[1, 2], max_tokens=4, temperature=1.0, top_p=1.0, decoder=None, first_chunks=[], incremental=False
    )
    grammar = _native.SubmitConstraint(schema_type=_native.SCHEMA_JSON, schema="{}", triggers=[5], bound=None)
    pics = _native.SubmitImages(path="/x", extra_tokens=3, sizes=[(1, 2, 3)])
    p = _native.Prepared(**good, constraint=grammar, images=pics)
    assert (p.prompt_ids, p.max_tokens) == ([1, 2], 4)
    with pytest.raises(TypeError, match="constraint"):
        _native.Prepared(**good, constraint=(_native.SCHEMA_JSON, "{}", [5], None))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="images"):
        _native.Prepared(**good, images=("/x", 3, [(1, 2, 3)]))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _native.Prepared(**{**good, "prompt_ids": ["a"]})
    with pytest.raises(OverflowError):
        _native.Prepared(**{**good, "max_tokens": -1})
    with pytest.raises(TypeError):
        _native.Prepared(**good, unknown=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        _native.Prepared(*good.values())  # type: ignore[misc]  # keyword-only: no field can take another's place
    r = _native.Refusal(400, '{"error": {}}')
    assert (r.status, r.body) == (400, '{"error": {}}') and r == _native.Refusal(400, '{"error": {}}')


def test_the_codec_answers_with_the_records() -> None:
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 4096)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    raw = json.dumps(body).encode()
    got = codec.prepare(_native.PrepareInput(door=_native.DOOR_CHAT, body=raw, response_id="chatcmpl-1", model=MODEL))
    assert isinstance(got, _native.Prepared) and got.max_tokens == 3 and got.prompt_ids
    bad_body = json.dumps({**body, "temperature": 9}).encode()
    bad = codec.prepare(_native.PrepareInput(door=_native.DOOR_CHAT, body=bad_body, response_id="c", model=MODEL))
    assert isinstance(bad, _native.Refusal) and bad.status == 400
    assert json.loads(bad.body)["error"]["param"] == "temperature"
    counted = codec.count_tokens(_native.CallInput(door=_native.DOOR_CHAT, body=raw))
    assert isinstance(counted, str) and json.loads(counted)["input_tokens"] == len(got.prompt_ids)
    refused = codec.detokenize(_native.CallInput(door=_native.DOOR_CHAT, body=b'{"tokens": [-1]}'))
    assert isinstance(refused, _native.Refusal) and json.loads(refused.body)["error"]["param"] == "tokens"
    assert codec.check_constraint(_native.ConstraintInput(door=_native.DOOR_CHAT, body=raw)) is None


def test_a_rank_reads_typed_records(tmp_path: Path) -> None:
    path = str(tmp_path / "ring")
    prod = _native.Ring.create(path, 1 << 16)
    cons = _native.Ring.open(path)
    submit_input = _native.SubmitInput(
        request_id=7,
        prompt=[1, 2],
        max_tokens=9,
        temperature=0.5,
        top_p=0.9,
        top_k=3,
        seed=11,
        ignore_eos=True,
        logprobs=2,
        prompt_logprobs=True,
    )
    prod.push_submit(submit_input)
    prod.push_abort(7)
    prod.push_shutdown()
    submit, abort, shutdown = cons.drain_requests()
    assert isinstance(submit, _native.Submit) and isinstance(abort, _native.Abort)
    assert isinstance(shutdown, _native.Shutdown)
    got = (submit.request_id, submit.prompt, submit.max_tokens, submit.temperature, submit.top_p, submit.top_k)
    assert got == (7, [1, 2], 9, 0.5, 0.9, 3)
    assert (submit.seed, submit.ignore_eos, submit.logprobs, submit.prompt_logprobs) == (11, True, 2, True)
    assert (submit.constraint, submit.images, abort.request_id) == (None, None, 7)
    prod.close()


# -- every shape through the seam -----------------------------------------------------------------------------------

BODIES: dict[int, dict[str, object]] = {
    _native.DOOR_CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    _native.DOOR_COMPLETIONS: {"prompt": "hi", "max_tokens": 5},
    _native.DOOR_MESSAGES: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
    _native.DOOR_RESPONSES: {"input": "hi", "max_output_tokens": 5},
    _native.DOOR_GENERATE: {"text": "hi", "rid": "r", "sampling_params": {"max_new_tokens": 5}},
}


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(BUNDLED_TOKENIZER, [MODEL], 4096)


def prepare(codec: Codec, door: int, **fields: object) -> _native.Prepared:
    raw = json.dumps({"model": MODEL, **BODIES[door], **fields}).encode()
    got = codec.prepare(_native.PrepareInput(door=door, body=raw, response_id="id-1", model=MODEL, ignore_eos=True))
    assert isinstance(got, _native.Prepared), got
    return got


def test_prepare_reads_its_request_by_name_on_every_door(codec: Codec) -> None:
    for door in DOORS:
        got = prepare(codec, door, stream=True)
        assert got.max_tokens == 5 and got.prompt_ids and got.incremental, door
    req = _native.PrepareInput(
        door=_native.DOOR_MESSAGES,
        body=b"{}",
        response_id="msg_1",
        model=MODEL,
        include_usage=True,
        forced_tool="get_weather",
        parallel_tools=False,
        images={"https://x/a.png": b"\x89PNG"},
    )
    fields = (req.door, req.body, req.response_id, req.model, req.ignore_eos, req.include_usage)
    assert fields == (_native.DOOR_MESSAGES, b"{}", "msg_1", MODEL, False, True)
    assert (req.continuous_usage, req.forced_tool, req.parallel_tools) == (False, "get_weather", False)
    assert req.images == {"https://x/a.png": b"\x89PNG"}
    check = _native.ConstraintInput(door=_native.DOOR_CHAT, body=b"{}", forced_tool="")
    assert (check.door, check.body, check.forced_tool, check.parallel_tools) == (_native.DOOR_CHAT, b"{}", "", True)


def test_a_prepared_grammar_and_images_cross_as_named_records(codec: Codec) -> None:
    # The codec's answer carries a grammar and images as the records a rank's Submit carries them in, read back by
    # name; none, either or both.
    good = dict(
        prompt_ids=[1], max_tokens=1, temperature=1.0, top_p=1.0, decoder=None, first_chunks=[], incremental=True
    )
    tool = _native.SubmitConstraint(schema_type=_native.SCHEMA_EBNF, schema="root ::= x", triggers=[5, 6], bound=7)
    pics = _native.SubmitImages(path="/dev/shm/x-media/chatcmpl-1", extra_tokens=650, sizes=[(1036, 1036, 2006)])
    for constraint, images in [(None, None), (tool, None), (None, pics), (tool, pics)]:
        p = _native.Prepared(**good, constraint=constraint, images=images)
        c, im = p.constraint, p.images
        assert (c is None, im is None) == (constraint is None, images is None)
        if c is not None:
            assert isinstance(c, _native.SubmitConstraint)
            assert (c.schema_type, c.schema, c.triggers, c.bound) == (_native.SCHEMA_EBNF, "root ::= x", [5, 6], 7)
        if im is not None:
            assert isinstance(im, _native.SubmitImages)
            assert (im.path, im.extra_tokens, im.sizes) == (pics.path, 650, [[1036, 1036, 2006]])
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    got = prepare(codec, _native.DOOR_CHAT, response_format=fmt).constraint
    assert isinstance(got, _native.SubmitConstraint) and got.schema_type == _native.SCHEMA_JSON and got.bound is None
    assert prepare(codec, _native.DOOR_CHAT).constraint is None and prepare(codec, _native.DOOR_CHAT).images is None


def test_a_decode_batch_of_every_shape_goes_through_the_real_codec(codec: Codec) -> None:
    # One batch with a request without logprobs, one with them, and one with the prompt's logprobs on its first
    # tokens: each decoder reads its own row by name, and each answer is set on the batch, in its place.
    plain = prepare(codec, _native.DOOR_CHAT, stream=True)
    with_lp = prepare(codec, _native.DOOR_CHAT, stream=True, logprobs=True, top_logprobs=1)
    with_prompt = prepare(codec, _native.DOOR_COMPLETIONS, prompt_logprobs=0)
    assert (plain.logprobs, with_lp.logprobs, with_prompt.prompt_logprobs) == (None, 1, True)
    tokens = codec.encoder.encode_text("Hello there")
    lps = [(-0.5, [(t, -0.5)]) for t in tokens]
    prompt_values = [-1.0] * (len(with_prompt.prompt_ids) - 1)
    batch = _native.DecodeBatch(
        decoders=[plain.decoder, with_lp.decoder, with_prompt.decoder],
        tokens=[tokens] * 3,
        finishes=[_native.FINISH_NONE, _native.FINISH_LENGTH, _native.FINISH_LENGTH],
        logprobs=[None, lps, None],
        prompt_logprobs=[None, None, prompt_values],
    )
    assert (len(batch), batch.tokens, batch.logprobs, batch.prompt_logprobs) == (
        3,
        [tokens] * 3,
        [None, lps, None],
        [None, None, prompt_values],
    )
    assert (batch.states, batch.outputs) == (None, None)  # unanswered yet
    assert decode_batch(batch) is None
    assert batch.states == [RUNNING, FINISHED, FINISHED] and batch.outputs is not None
    out = batch.outputs
    assert isinstance(out[0], list) and "Hello" in "".join(out[0])
    assert isinstance(out[1], list)
    events = [json.loads(e) for e in out[1] if e.startswith("{")]
    assert any(c.get("logprobs") for e in events for c in e.get("choices", [])), out[1]
    assert isinstance(out[2], str)
    choice = json.loads(out[2])["choices"][0]
    assert choice["text"] == "Hello there" and len(choice["prompt_logprobs"]) == len(with_prompt.prompt_ids)
    assert [next(iter(e.values()))["logprob"] for e in choice["prompt_logprobs"][1:]] == prompt_values


def test_engine_outputs_of_every_shape_go_through_a_real_ring(tmp_path: Path) -> None:
    path = str(tmp_path / "out")
    prod = _native.Ring.create(path, 1 << 16)
    cons = _native.Ring.open(path)
    lps = [(-0.5, [(7, -0.5), (8, -1.5)]), (-0.25, [(9, -0.25), (7, -3.0)])]
    outputs = [
        _native.Output(request_id=1, tokens=7, finish=_native.FINISH_NONE),
        _native.Output(request_id=2, tokens=[7, 9], finish=_native.FINISH_STOP, logprobs=lps),
        _native.Output(request_id=3, tokens=(5,), finish=_native.FINISH_NONE, prompt_logprobs=[-1.0, -2.5]),
        _native.Output(request_id=4, tokens=[7, 9], finish=_native.FINISH_LENGTH, logprobs=lps, prompt_logprobs=[]),
        _native.Output(request_id=5, tokens=[], finish=_native.FINISH_ERROR, reason="prompt_length_exceeded"),
    ]
    prod.publish(outputs)
    got = cons.drain_tokens()
    assert got == outputs
    assert [(o.request_id, o.tokens, o.finish) for o in got] == [
        (1, [7], _native.FINISH_NONE),
        (2, [7, 9], _native.FINISH_STOP),
        (3, [5], _native.FINISH_NONE),
        (4, [7, 9], _native.FINISH_LENGTH),
        (5, [], _native.FINISH_ERROR),
    ]
    assert [o.logprobs for o in got] == [None, lps, None, lps, None]
    assert [o.prompt_logprobs for o in got] == [None, None, [-1.0, -2.5], [], None]
    assert [o.reason for o in got] == [None, None, None, None, "prompt_length_exceeded"]
    prod.close()


def test_a_seam_record_built_wrong_fails_where_it_is_built() -> None:
    o, body = _native.Output, b"{}"
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (TypeError, "request_id", lambda: o(request_id="1", tokens=[1], finish=0)),  # type: ignore[arg-type]
        (TypeError, "tokens", lambda: o(request_id=1, tokens=["a"], finish=0)),  # type: ignore[list-item]
        (TypeError, "tokens", lambda: o(request_id=1, tokens="12", finish=0)),  # type: ignore[arg-type]
        (ValueError, "finish", lambda: o(request_id=1, tokens=[1], finish=99)),
        (ValueError, "logprobs", lambda: o(request_id=1, tokens=[1, 2], finish=0, logprobs=[(-1.0, [])])),
        (TypeError, "prompt_logprobs", lambda: o(request_id=1, tokens=1, finish=0, prompt_logprobs=["x"])),  # type: ignore[list-item]
        (TypeError, "unexpected", lambda: o(request_id=1, tokens=[1], finish=0, stop=True)),  # type: ignore[call-arg]
        (TypeError, "positional", lambda: o(1, [1], 0)),  # type: ignore[misc]
        (TypeError, "body", lambda: _native.PrepareInput(door=0, body="{}", response_id="r", model="m")),  # type: ignore[arg-type]
        (ValueError, "door", lambda: _native.PrepareInput(door=99, body=body, response_id="r", model="m")),
        (TypeError, "unexpected", lambda: _native.PrepareInput(door=0, body=body, response_id="r", model="m", x=1)),  # type: ignore[call-arg]
        (TypeError, "missing", lambda: _native.ConstraintInput(body=body)),  # type: ignore[call-arg]
        (TypeError, "finishes", lambda: _native.DecodeBatch(decoders=[None], tokens=[[1]], finishes=["0"])),  # type: ignore[list-item]
        (ValueError, "row per request", lambda: _native.DecodeBatch(decoders=[None], tokens=[], finishes=[0])),
        (TypeError, "unexpected", lambda: _native.DecodeBatch(decoders=[], tokens=[], finishes=[], lp=1)),  # type: ignore[call-arg]
    ]
    for kind, says, build in cases:
        with pytest.raises(kind, match=says):
            build()
    # decode_batch's answers are typed where they are set.
    batch = _native.DecodeBatch(decoders=[None], tokens=[[1]], finishes=[0])
    answers: list[tuple[type[Exception], str, str, object]] = [
        (ValueError, "state", "states", [7]),
        (ValueError, "1 requests", "states", [RUNNING, RUNNING]),
        (TypeError, "int", "states", ["0"]),
        (TypeError, "outputs", "outputs", [b"x"]),
        (TypeError, "outputs", "outputs", [None]),
    ]
    for kind, says, field, value in answers:
        with pytest.raises(kind, match=says):
            setattr(batch, field, value)
    with pytest.raises(AttributeError):
        batch.tokens = [[2]]  # type: ignore[misc]  # what the engine gave is read-only
    batch.states, batch.outputs = [RUNNING], ["{}"]
    assert (batch.states, batch.outputs) == ([RUNNING], ["{}"])


def test_a_ring_publishes_output_records_only(tmp_path: Path) -> None:
    prod = _native.Ring.create(str(tmp_path / "out"), 1 << 12)
    with pytest.raises(TypeError, match="publish takes Output and StepOutputs records, not <class 'tuple'>"):
        prod.publish([(1, [1], _native.FINISH_NONE)])  # type: ignore[list-item]
    assert prod.used_bytes == 0
    prod.close()


def test_a_step_of_columns_goes_through_a_real_ring_beside_output_records(tmp_path: Path) -> None:
    path = str(tmp_path / "out")
    prod = _native.Ring.create(path, 1 << 16)
    cons = _native.Ring.open(path)
    none, stop, length, abort = _native.FINISH_NONE, _native.FINISH_STOP, _native.FINISH_LENGTH, _native.FINISH_ABORT
    # As a rank builds them: plain lists appended to, a token id or a sequence (a speculative step) per row.
    step = _native.StepOutputs(
        request_ids=[10, 11, 12, 13], tokens=[7, [8, 9], (5,), []], finishes=[none, stop, length, abort]
    )
    assert len(step) == 4
    assert (step.request_ids, step.tokens, step.finishes) == (
        [10, 11, 12, 13],
        [[7], [8, 9], [5], []],
        [none, stop, length, abort],
    )
    error = _native.Output(request_id=14, tokens=[], finish=_native.FINISH_ERROR, reason="grammar")
    first = _native.Output(request_id=15, tokens=3, finish=none, prompt_logprobs=[-1.0])
    assert prod.publish([error, step, first]) == 6  # rows written, for the rank's run-ahead bound
    assert prod.publish([_native.StepOutputs(request_ids=[], tokens=[], finishes=[])]) == 0  # an empty step
    got = cons.drain_tokens()
    by_id = {o.request_id: o for o in got}
    assert len(got) == 6 and by_id[14] == error and by_id[15] == first
    assert [by_id[r] for r in step.request_ids] == step.outputs()
    assert [(by_id[r].tokens, by_id[r].finish, by_id[r].reason, by_id[r].logprobs) for r in (10, 11, 12, 13)] == [
        ([7], none, None, None),
        ([8, 9], stop, None, None),
        ([5], length, None, None),
        ([], abort, None, None),
    ]
    prod.close()


def test_a_step_of_columns_built_wrong_fails_where_it_is_built() -> None:
    s = _native.StepOutputs
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (ValueError, "2 request_ids, 1 tokens, 2 finishes", lambda: s(request_ids=[1, 2], tokens=[1], finishes=[0, 0])),
        (ValueError, "1 request_ids, 1 tokens, 0 finishes", lambda: s(request_ids=[1], tokens=[1], finishes=[])),
        (
            ValueError,
            "'finishes': row 1: unknown finish code 9",
            lambda: s(request_ids=[1, 2], tokens=[1, 2], finishes=[0, 9]),
        ),
        (
            ValueError,
            "an error finish is an Output",
            lambda: s(request_ids=[1], tokens=[1], finishes=[_native.FINISH_ERROR]),
        ),
        (ValueError, "'request_ids': row 0", lambda: s(request_ids=[-1], tokens=[1], finishes=[0])),
        (TypeError, "'request_ids': row 0", lambda: s(request_ids=["1"], tokens=[1], finishes=[0])),  # type: ignore[list-item]
        (TypeError, "'tokens': row 0: .* not a string", lambda: s(request_ids=[1], tokens=["7"], finishes=[0])),  # type: ignore[list-item]
        (TypeError, "'tokens': row 1", lambda: s(request_ids=[1, 2], tokens=[1, [2, None]], finishes=[0, 0])),  # type: ignore[list-item]
        (TypeError, "'tokens': a sequence, not a string", lambda: s(request_ids=[1], tokens="7", finishes=[0])),  # type: ignore[arg-type]
        (TypeError, "'finishes'", lambda: s(request_ids=[1], tokens=[1], finishes=None)),  # type: ignore[arg-type]
        (TypeError, "'finishes': row 0", lambda: s(request_ids=[1], tokens=[1], finishes=[0.0])),  # type: ignore[list-item]
        (TypeError, "positional", lambda: s([1], [1], [0])),  # type: ignore[misc]
        (TypeError, "missing", lambda: s(request_ids=[1], tokens=[1])),  # type: ignore[call-arg]
    ]
    for kind, says, build in cases:
        with pytest.raises(kind, match=says):
            build()
