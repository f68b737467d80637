"""The seam between Rust and Python: the records that cross it (`Prepared`, `Refusal`, `Submit`, `Abort`,
`Shutdown`) and the codes both sides use are defined once, in Rust, and exported; `_native.pyi` describes them,
mypy checks the package against it, and this file checks it against the module itself."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODEL

from deepinfer_server import _native
from deepinfer_server.codec import Codec
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY
from deepinfer_server.doors import DOORS, ChatDoor, CompletionsDoor, MessagesDoor, ResponsesDoor
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
    assert exported.keys() == {"chat", "completions", "messages", "responses"}
    assert len(set(exported.values())) == len(exported)
    classes = {"chat": ChatDoor, "completions": CompletionsDoor, "messages": MessagesDoor, "responses": ResponsesDoor}
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
    p = _native.Prepared(**good, constraint=(_native.SCHEMA_JSON, "{}", [5], None), images=("/x", 3, [(1, 2, 3)]))
    assert (p.prompt_ids, p.max_tokens, p.constraint, p.images) == (
        [1, 2],
        4,
        (1, "{}", [5], None),
        ("/x", 3, [[1, 2, 3]]),
    )
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
    got = codec.prepare(json.dumps(body).encode(), "chatcmpl-1", MODEL, False, False, False, _native.DOOR_CHAT)
    assert isinstance(got, _native.Prepared) and got.max_tokens == 3 and got.prompt_ids
    bad = codec.prepare(json.dumps({**body, "temperature": 9}).encode(), "c", MODEL, False, False, False)
    assert isinstance(bad, _native.Refusal) and bad.status == 400
    assert json.loads(bad.body)["error"]["param"] == "temperature"
    counted = codec.count_tokens(json.dumps(body).encode(), _native.DOOR_CHAT)
    assert isinstance(counted, str) and json.loads(counted)["input_tokens"] == len(got.prompt_ids)
    refused = codec.detokenize(b'{"tokens": [-1]}', _native.DOOR_CHAT)
    assert isinstance(refused, _native.Refusal) and json.loads(refused.body)["error"]["param"] == "tokens"
    assert codec.check_constraint(json.dumps(body).encode(), _native.DOOR_CHAT) is None


def test_a_rank_reads_typed_records(tmp_path: Path) -> None:
    path = str(tmp_path / "ring")
    prod = _native.Ring.create(path, 1 << 16)
    cons = _native.Ring.open(path)
    prod.push_submit(7, [1, 2], 9, 0.5, 0.9, 3, 11, True, logprobs=2, prompt_logprobs=True)
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
