"""Contract: every grammar the codec hands DeepInfer compiles in DeepInfer's own grammar engine, xgrammar 0.2.8,
the way its 0.1.0 compiler calls it (structure_output/compiler.py `dispatch_and_compile`: `compile_json_schema(schema,
strict_mode=True)`, `compile_regex`, `compile_grammar` for EBNF), over the serving tokenizer's vocabulary.

The sim enforces grammars with llguidance; this checks the other engine. xgrammar's wheel requires torch,
transformers and triton, but its compiler uses none of them: the wheel and its one real dependency (apache-tvm-ffi)
are installed with `--no-deps` into a cache directory, and the compile runs in a subprocess that stubs the two
imports its unrelated modules make at import time (matcher bitmasks, Hugging Face helpers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from deepinfer_server._native import PrepareInput
from deepinfer_server.codec import CHAT, MESSAGES, RESPONSES, Codec, Prepared
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from test_codec import MODEL, TOOLS
from test_structured import SHAPES

PINS = ("xgrammar==0.2.8", "apache-tvm-ffi==0.1.15.post2")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer-server" / "xgrammar-0.2.8"

COMPILE = textwrap.dedent(
    """
    import json, sys, types
    sys.path.insert(0, sys.argv[1])
    import tvm_ffi  # before the stubs: it looks for a real torch

    class _Stub:  # what matcher.py builds from torch at import time; the compiler never touches it
        def __call__(self, *a, **k): return self
        def __getattr__(self, name): return self

    class _Absent:  # transformers' classes, for isinstance checks and subclassing only
        pass

    torch = types.ModuleType("torch"); torch.__getattr__ = lambda name: _Stub()
    hf = types.ModuleType("transformers")
    hf.PreTrainedTokenizerBase = hf.PreTrainedTokenizerFast = hf.LogitsProcessor = _Absent
    sys.modules.update(torch=torch, transformers=hf)
    import xgrammar as xgr

    tok = json.load(open(sys.argv[2], encoding="utf-8"))
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    encoded = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        encoded[i] = text
    eos = vocab["<｜end▁of▁sentence｜>"]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    out = []
    for schema_type, schema in json.load(sys.stdin):
        try:
            if schema_type == "json":
                compiler.compile_json_schema(schema, strict_mode=True)
            elif schema_type == "regex":
                compiler.compile_regex(schema)
            else:
                compiler.compile_grammar(schema)
            out.append(None)
        except Exception as e:  # DeepInfer turns each into "xgrammar runtime errors or timeout"
            out.append(f"{type(e).__name__}: {e}"[:300])
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def xgrammar() -> Path:
    """xgrammar 0.2.8 and apache-tvm-ffi, installed without their torch-heavy dependencies (cached)."""
    marker = CACHE / ".complete"
    if not marker.is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(CACHE), *PINS]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"cannot install {PINS} from the package index: {done.stderr[-800:]}")
        marker.write_text("ok")
    return CACHE


def compile_all(xgrammar: Path, grammars: list[tuple[str, str]]) -> list[str | None]:
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(xgrammar), str(BUNDLED_TOKENIZER)],
        input=json.dumps(grammars),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


NAMES = {1: "json", 2: "regex", 3: "ebnf"}
THINK = {"thinking": {"type": "enabled"}}
NO_THINK = {"thinking": {"type": "disabled"}}
ASK = [{"role": "user", "content": "answer"}]
STRICT = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
FN = {"type": "function", "function": {"name": "get_weather"}}
# (door, body, forced tool for the codec: "" any, a name, or None), as the Rust front end hands them over.
REQUESTS: dict[str, tuple[int, dict[str, Any], str | None]] = {
    **{
        f"json_schema {name}, thinking {mode}": (
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, **t},
            None,
        )
        for name, s in SHAPES.items()
        for mode, t in (("on", THINK), ("off", NO_THINK))
    },
    "json_object": (
        CHAT,
        {"response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "json"}]},
        None,
    ),
    "regex": (CHAT, {"response_format": {"type": "regex", "regex": r"[A-Z][a-z]{2,8} \d{1,3}"}, **NO_THINK}, None),
    "strict tools, auto": (CHAT, {"tools": STRICT, **THINK}, None),
    "required, thinking on": (CHAT, {"tools": TOOLS, "tool_choice": "required", **THINK}, ""),
    "required, thinking off": (CHAT, {"tools": TOOLS, "tool_choice": "required", **NO_THINK}, ""),
    "named, strict, thinking on": (CHAT, {"tools": STRICT, "tool_choice": FN, **THINK}, "get_weather"),
    "named, no parallel calls": (
        CHAT,
        {"tools": TOOLS, "tool_choice": FN, "parallel_tool_calls": False},
        "get_weather",
    ),
    "Responses text.format": (
        RESPONSES,
        {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": SHAPES["nested objects"]}}},
        None,
    ),
    # Tools beside a response format (issue 30): the answer or a tool-call block, after the reasoning.
    "strict tools + json_schema, thinking on": (
        CHAT,
        {
            "tools": STRICT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SHAPES["nested objects"]},
            },
            **THINK,
        },
        None,
    ),
    "tools + json_object": (
        CHAT,
        {"tools": TOOLS, "response_format": {"type": "json_object"}, "messages": [{"role": "user", "content": "json"}]},
        None,
    ),
    "strict and non-strict tools, auto": (
        CHAT,
        {
            "tools": [STRICT[0], {"type": "function", "function": {**TOOLS[0]["function"], "name": "lookup"}}],
            **NO_THINK,
        },
        None,
    ),
    "Responses text.format + strict tools": (
        RESPONSES,
        {
            "input": "x",
            "tools": [{"type": "function", **t["function"]} for t in STRICT],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": SHAPES["nested objects"]}},
        },
        None,
    ),
    "Messages output_config.format": (
        MESSAGES,
        {"max_tokens": 50, "output_config": {"format": {"type": "json_schema", "schema": SHAPES["nested objects"]}}},
        None,
    ),
    "Messages tool_choice any": (
        MESSAGES,
        {
            "max_tokens": 50,
            "tools": [{"name": "f", "input_schema": SHAPES["arrays with bounds"]}],
            "tool_choice": {"type": "any"},
        },
        "",
    ),
}


def grammar_of(codec: Codec, door: int, body: dict[str, Any], forced: str | None) -> tuple[str, str]:
    full: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_tokens": 50, **body}
    if door == RESPONSES:
        full.pop("messages")
        full.pop("max_tokens")
    parallel = body.get("parallel_tool_calls", True)
    got = codec.prepare(
        PrepareInput(
            door=door,
            body=json.dumps(full).encode(),
            response_id="r",
            model=MODEL,
            forced_tool=forced,
            parallel_tools=parallel,
        )
    )
    assert isinstance(got, Prepared), got
    assert got.constraint is not None, "the request carries no grammar"
    schema_type, schema = got.constraint.schema_type, got.constraint.schema
    return NAMES[schema_type], schema


def test_every_grammar_the_codec_sends_compiles_in_xgrammar(xgrammar: Path) -> None:
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    grammars = {name: grammar_of(codec, *req) for name, req in REQUESTS.items()}
    assert {t for t, _ in grammars.values()} == {"json", "regex", "ebnf"}
    failed = {
        name: err for name, err in zip(grammars, compile_all(xgrammar, list(grammars.values())), strict=True) if err
    }
    assert not failed, json.dumps(failed, indent=1)


def test_xgrammar_refuses_what_it_cannot_enforce(xgrammar: Path) -> None:
    """The compile is real: a malformed grammar of each type fails there, as DeepInfer would report it."""
    bad = [("ebnf", 'root ::= "a" | undefined_rule'), ("regex", "(unclosed"), ("json", '{"type": 7}')]
    assert all(compile_all(xgrammar, bad)), "xgrammar accepted a malformed grammar"
