"""Contract: every deepinfer name the adapter uses exists in the real deepinfer 0.1.0 sdist (and in the fake).

The sdist is fetched from PyPI through its JSON API, checked against a pinned sha256, cached under
~/.cache/deepinfer-server/, and read with tarfile + ast: never built, installed or imported. The list of used
names is derived from the adapter's own source (python/deepinfer_server/engine/deepinfer.py, deepinfer_build.py and
deepinfer_config.py), so a new call, keyword or environment variable there is checked without editing this file.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import os
import re
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

VERSION = "0.1.0"
SHA256 = "959b9bd010893b4c6dc60be0dd822e10e7f1ae1e53289233a83741f76c3d681a"
INDEX = os.environ.get("DEEPINFER_SERVER_PYPI", "https://pypi.org")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer-server"
HERE = Path(__file__).resolve().parent
ADAPTER = HERE.parent / "python" / "deepinfer_server" / "engine" / "deepinfer.py"
ADAPTER_SOURCES = (ADAPTER, ADAPTER.with_name("deepinfer_build.py"), ADAPTER.with_name("deepinfer_config.py"))
FAKE = HERE / "fake_deepinfer"

Reader = Callable[[str], "str | None"]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as r:
        return bytes(r.read())


def fetch_sdist() -> bytes:
    cached = CACHE / f"deepinfer-{VERSION}.tar.gz"
    if cached.is_file():
        data = cached.read_bytes()
        if hashlib.sha256(data).hexdigest() == SHA256:
            return data
    meta_url, meta = "", None
    errors = []
    # The release's JSON first; some mirrors serve only the project JSON (its `urls` are the latest release's).
    for url in (f"{INDEX}/pypi/deepinfer/{VERSION}/json", f"{INDEX}/pypi/deepinfer/json"):
        try:
            meta_url, meta = url, json.loads(_get(url))
            break
        except (urllib.error.URLError, OSError, ValueError) as e:
            errors.append(f"{url}: {e}")
    if meta is None:
        pytest.fail(f"cannot reach the package index to fetch deepinfer {VERSION} (needed by this test): {errors}")
    files = meta.get("releases", {}).get(VERSION) or meta.get("urls", [])
    sdists = [f for f in files if f.get("packagetype") == "sdist" and f["filename"] == f"deepinfer-{VERSION}.tar.gz"]
    assert sdists, f"no deepinfer-{VERSION}.tar.gz listed by {meta_url}"
    url = urllib.parse.urljoin(meta_url, sdists[0]["url"])
    try:
        data = _get(url)
    except (urllib.error.URLError, OSError) as e:
        pytest.fail(f"cannot download {url}: {e}")
    digest = hashlib.sha256(data).hexdigest()
    assert digest == SHA256, f"{url}: sha256 {digest}, expected {SHA256}"
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".part")
    tmp.write_bytes(data)
    tmp.replace(cached)
    return data


@pytest.fixture(scope="module")
def real() -> Reader:
    top = f"deepinfer-{VERSION}/"
    files: dict[str, str] = {}
    with tarfile.open(fileobj=io.BytesIO(fetch_sdist()), mode="r:gz") as tar:
        for m in tar.getmembers():
            if m.isfile() and m.name.endswith((".py", ".pyi", ".hpp", ".cpp")):
                f = tar.extractfile(m)
                if f is not None:
                    files[m.name.removeprefix(top)] = f.read().decode("utf-8")
    return files.get


def fake_reader(rel: str) -> str | None:
    p = FAKE / rel
    if not p.is_file() and rel.endswith(".pyi"):
        p = p.with_suffix(".py")  # the fake's compiled-extension stand-in is plain Python
    return p.read_text(encoding="utf-8") if p.is_file() else None


# -- what the adapter uses, from its source -------------------------------------------------------------------------


def _attr_chain(node: ast.AST) -> list[str]:
    out = []
    while isinstance(node, ast.Attribute):
        out.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        out.append(node.id)
    return out[::-1]


class Used:
    def __init__(self) -> None:
        sources = [ast.parse(f.read_text(encoding="utf-8")) for f in ADAPTER_SOURCES]
        tree = ast.Module(body=[node for source in sources for node in source.body], type_ignores=[])
        self.imports: list[tuple[str, str]] = []  # (module, name) from deepinfer
        self.engine_args: set[str] = set()  # EngineArgs(...) keywords
        self.engine_methods: dict[str, set[str]] = {}  # LLMEngine method -> keywords used
        self.engine_attrs: set[str] = set()  # LLMEngine attributes read or set (non-call)
        self.scheduler_methods: set[str] = set()
        self.scheduler_config_attrs: set[str] = set()
        self.cache_config_attrs: set[str] = set()
        self.sampling_kw: set[str] = set()
        self.output_accessors: set[str] = set()
        self.pg_methods: set[str] = set()
        self.env_vars: set[str] = set()
        calls: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "deepinfer":
                self.imports += [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Call):
                chain = _attr_chain(node.func)
                kws = {k.arg for k in node.keywords if k.arg}
                if chain == ["EngineArgs"]:
                    self.engine_args |= kws
                elif chain[:2] == ["self", "_sp"]:
                    self.sampling_kw |= kws
                elif chain == ["LLMEngine", "from_engine_args"]:
                    self.engine_methods.setdefault("from_engine_args", set())
                elif chain[:2] == ["self", "engine"] and len(chain) == 3:
                    self.engine_methods.setdefault(chain[2], set()).update(kws)
                    calls.add(id(node.func))
                elif chain[:3] == ["self", "engine", "scheduler"] and len(chain) == 4:
                    self.scheduler_methods.add(chain[3])
                    calls.add(id(node.func))
                elif len(chain) == 2 and chain[0] == "PG":
                    self.pg_methods.add(chain[1])
                elif len(chain) == 2 and chain[0] == "ro" and chain[1].startswith("get_"):
                    self.output_accessors.add(chain[1])
            elif isinstance(node, ast.Dict):
                for k in node.keys:
                    if isinstance(k, ast.Constant) and isinstance(k.value, str) and k.value.startswith("DEEPINFER_"):
                        self.env_vars.add(k.value)
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("DEEPINFER_")
                and node.value.isupper()
                and not node.value.startswith("DEEPINFER_SERVER")
            ):
                self.env_vars.add(node.value)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and id(node) not in calls:
                chain = _attr_chain(node)
                if chain[:3] == ["self", "engine", "cache_config"] and len(chain) == 4:
                    self.cache_config_attrs.add(chain[3])
                plain = chain[:2] == ["self", "engine"] and len(chain) == 3
                if plain and chain[2] not in ("scheduler", "cache_config", *self.engine_methods):
                    self.engine_attrs.add(chain[2])
                if chain[:2] == ["engine", "scheduler_config"] and len(chain) == 3:
                    self.scheduler_config_attrs.add(chain[2])


USED = Used()


def test_the_adapter_source_yields_a_non_trivial_list_of_names() -> None:
    u = USED
    assert {"model", "engine_rank", "expert_parallel_size", "gpu_memory_utilization"} <= u.engine_args
    assert {"add_request", "abort_request", "step", "flush_inflight_reqs", "close"} <= set(u.engine_methods)
    assert {"user_id", "request_id", "sampling_params", "prompt_token_ids"} <= u.engine_methods["add_request"]
    assert {"get_request_id", "get_token_id", "get_finished", "get_finish_reason"} <= u.output_accessors
    assert {"get_token_logprobs", "get_top_logprobs", "get_top_token_ids"} <= u.output_accessors  # logprobs
    assert {"top_logprobs", "so_args"} <= u.sampling_kw
    assert {"temperature", "top_p", "top_k", "max_tokens", "ignore_eos", "seq_seed"} <= u.sampling_kw
    assert u.pg_methods == {"cpu_data_parallel_group"}
    assert u.cache_config_attrs == {"num_gpu_blocks", "block_size"} and "get_num_free_gpu_blocks" in u.scheduler_methods
    assert {"DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_PREFILL_ATTEMPT_INTERVAL"} <= u.env_vars


# -- checks against a package tree ---------------------------------------------------------------------------------


def parse(text: str) -> ast.Module:
    """ast.parse, also on Python < 3.12 for deepinfer's 3.12 syntax (PEP 695 generics and `type` aliases)."""
    try:
        return ast.parse(text)
    except SyntaxError:
        text = re.sub(r"^(\s*(?:class|def)\s+\w+)\[[^\]]*\]", r"\1", text, flags=re.M)
        text = re.sub(r"^(\s*)type\s+(\w+)(?:\[[^\]]*\])?\s*=", r"\1\2 =", text, flags=re.M)
        return ast.parse(text)


def _module(read: Reader, module: str) -> tuple[str, ast.Module]:
    base = module.replace(".", "/")
    for rel in (f"{base}.py", f"{base}/__init__.py", f"{base}.pyi"):
        text = read(rel)
        if text is not None:
            return rel, parse(text)
    raise AssertionError(f"module {module} not found")


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _params(fn: ast.FunctionDef) -> set[str]:
    a = fn.args
    return {x.arg for x in a.posonlyargs + a.args + a.kwonlyargs}


def _self_attrs(cls: ast.ClassDef) -> set[str]:
    out = set()
    for node in ast.walk(cls):
        is_self = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if is_self and isinstance(node.ctx, ast.Store):  # type: ignore[attr-defined]
            out.add(node.attr)  # type: ignore[attr-defined]
    return out


def _toplevel_names(tree: ast.Module) -> set[str]:
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def check_package(read: Reader) -> None:
    u = USED
    for module, name in u.imports:
        _, tree = _module(read, module)
        assert name in _toplevel_names(tree), f"{module}.{name} not found"

    _, args_tree = _module(read, "deepinfer.engine.arg_utils")
    args_cls = _class(args_tree, "EngineArgs")
    fields = {n.target.id for n in args_cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    assert u.engine_args <= fields, f"EngineArgs lacks {u.engine_args - fields}"

    _, eng_tree = _module(read, "deepinfer.engine.llm_engine")
    eng = _class(eng_tree, "LLMEngine")
    methods = _methods(eng)
    for m, kws in u.engine_methods.items():
        assert m in methods, f"LLMEngine.{m} not found"
        assert kws <= _params(methods[m]), f"LLMEngine.{m} has no parameter(s) {kws - _params(methods[m])}"
    attrs = _self_attrs(eng)
    assert u.engine_attrs <= attrs | set(methods), f"LLMEngine lacks attribute(s) {u.engine_attrs - attrs}"
    assert {"scheduler", "scheduler_config", "cache_config"} <= attrs

    _, cfg_tree = _module(read, "deepinfer.config")
    sched_cfg = _self_attrs(_class(cfg_tree, "SchedulerConfig"))
    assert u.scheduler_config_attrs <= sched_cfg, f"SchedulerConfig lacks {u.scheduler_config_attrs - sched_cfg}"

    cache_cfg = _self_attrs(_class(cfg_tree, "CacheConfig"))
    assert u.cache_config_attrs <= cache_cfg, f"CacheConfig lacks {u.cache_config_attrs - cache_cfg}"

    _, sp_tree = _module(read, "deepinfer.sampling_params")
    sp_params = _params(_methods(_class(sp_tree, "SamplingParams"))["__init__"])
    assert u.sampling_kw <= sp_params, f"SamplingParams lacks {u.sampling_kw - sp_params}"

    c_text = read("deepinfer/_C/engine.pyi")
    assert c_text is not None, "deepinfer/_C/engine.pyi not found"
    c_tree = parse(c_text)
    ro = _methods(_class(c_tree, "RequestOutput"))
    assert u.output_accessors <= set(ro), f"RequestOutput lacks {u.output_accessors - set(ro)}"
    for name in u.output_accessors:
        decos = {d.id for d in ro[name].decorator_list if isinstance(d, ast.Name)}
        assert "staticmethod" in decos, f"RequestOutput.{name} is not a static accessor"
    if read("deepinfer/engine/llm_engine.py") and "class Scheduler" not in read("deepinfer/engine/llm_engine.py"):  # type: ignore[operator]
        sched = _methods(_class(c_tree, "Scheduler"))
    else:
        sched = _methods(_class(eng_tree, "Scheduler"))
    assert u.scheduler_methods <= set(sched), f"Scheduler lacks {u.scheduler_methods - set(sched)}"

    _, ps_tree = _module(read, "deepinfer.model_executor.parallel_utils.parallel_state")
    assert "PG" in _toplevel_names(ps_tree)
    pg = _methods(_class(ps_tree, "ParallelProcessGroup"))
    assert u.pg_methods <= set(pg), f"ParallelProcessGroup lacks {u.pg_methods - set(pg)}"

    _, env_tree = _module(read, "deepinfer.environ")
    envs = _class(env_tree, "envs")
    declared = {t.id for n in envs.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    assert u.env_vars <= declared, f"deepinfer/environ.py does not declare {u.env_vars - declared}"


def test_real_deepinfer_has_every_name_the_adapter_uses(real: Reader) -> None:
    check_package(real)


def test_fake_deepinfer_has_every_name_the_adapter_uses() -> None:
    check_package(fake_reader)


def test_fake_engine_args_match_the_real_fields_and_defaults(real: Reader) -> None:
    def fields(read: Reader) -> dict[str, str]:
        _, tree = _module(read, "deepinfer.engine.arg_utils")
        cls = _class(tree, "EngineArgs")
        return {
            n.target.id: ast.unparse(n.value) if n.value is not None else ""
            for n in cls.body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
        }

    assert fields(fake_reader) == fields(real)


def test_fake_sampling_params_and_accessors_match_the_real_signatures(real: Reader) -> None:
    def sp(read: Reader) -> str:
        _, tree = _module(read, "deepinfer.sampling_params")
        return ast.unparse(_methods(_class(tree, "SamplingParams"))["__init__"].args)

    assert sp(fake_reader) == sp(real)

    def accessors(read: Reader) -> set[str]:
        text = read("deepinfer/_C/engine.pyi")
        assert text is not None
        return {m for m in _methods(_class(parse(text), "RequestOutput")) if m.startswith("get_") or m == "clone"}

    assert accessors(fake_reader) == accessors(real)


def test_the_output_pool_bound_follows_the_real_source(real: Reader) -> None:
    """engine/deepinfer_config.py `live_outputs_bound` rests on the pool size and on the release order; check both."""
    from deepinfer_server.engine.deepinfer_config import OUTPUT_POOL_SIZE, live_outputs_bound

    with tarfile.open(fileobj=io.BytesIO(fetch_sdist()), mode="r:gz") as tar:
        f = tar.extractfile(f"deepinfer-{VERSION}/csrc/engine/outputs.hpp")
        assert f is not None
        hpp = f.read().decode("utf-8")
    m = re.search(r"class RequestOutputPool\b.*?static constexpr size_t max_size = (\d+);", hpp, re.S)
    assert m and int(m.group(1)) == OUTPUT_POOL_SIZE, "RequestOutputPool::max_size changed"
    worker = real("deepinfer/worker/worker.py")
    assert worker is not None
    step = worker[worker.index("def execute_model_step") :]
    step = step[: step.index("\n    def ", 10)]
    # The previous async step's outputs are allocated before pre_sampler_sync frees what the last call returned;
    # a prompt step's own outputs come after it.
    prev = step.index("self._post_process_step(self.prev_step_state)")
    sync = step.index("pre_sampler_sync_fn(")
    assert prev < sync < step.index("self._post_process_step(curr_step_state)")
    engine = real("deepinfer/engine/llm_engine.py")
    assert engine is not None
    pre = engine[engine.index("def pre_sampler_sync(") :]
    assert "self.deferred_release.release()" in pre[: pre.index("\n    def ")]
    for name in ("_execute_model_async_step", "flush_inflight_reqs"):
        body = engine[engine.index(f"def {name}(") :]
        assert "self.deferred_release.collect_request_outputs(request_outputs)" in body[: body.index("\n    def ")]
    assert live_outputs_bound(16, 5) == 2 * 16 * 6 + 16


def test_so_args_are_what_the_real_engine_reads(real: Reader) -> None:
    """The constraint the adapter passes (engine/base.py `so_args`) uses only keys the 0.1.0 builder reads and
    schema types its compiler dispatches; the trigger/bound rules are the matcher's."""
    from deepinfer_server._native import SubmitConstraint as C
    from deepinfer_server.engine.base import SCHEMA_TYPES, so_args
    from deepinfer_server.grammar import SCHEMA_NAMES

    builder = real("deepinfer/structure_output/so_matcher_builder.py")
    compiler = real("deepinfer/structure_output/compiler.py")
    matcher = real("deepinfer/structure_output/matcher.py")
    assert builder and compiler and matcher
    read = set(re.findall(r"so_args\[\"(\w+)\"\]", builder)) | set(re.findall(r"so_args\.get\(\"(\w+)\"", builder))
    assert read == {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}, read
    compiled = set(re.findall(r"schema_type == \"(\w+)\"", compiler))
    assert set(SCHEMA_TYPES.values()) == compiled == set(SCHEMA_NAMES.values()) == {"json", "regex", "ebnf"}
    assert "compile_json_schema(schema, strict_mode=True)" in compiler  # grammar.strict_schema mirrors this
    full = so_args(C(schema_type=1, schema='{"type":"object"}', triggers=[7, 8], bound=9))
    assert full == {
        "schema_type": "json",
        "schema": '{"type":"object"}',
        "trigger_token_ids": [7, 8],
        "bound_token_id": 9,
    }
    assert set(full) <= read
    assert so_args(C(schema_type=3, schema='root ::= "a"', triggers=[], bound=None)) == {
        "schema_type": "ebnf",
        "schema": 'root ::= "a"',
    }
    # A bound needs a non-empty trigger list; an empty list is the builder's default (no trigger).
    assert "bound_token_id requires non-empty trigger_token_ids" in matcher
    assert 'trigger_tokens = so_args.get("trigger_token_ids")' in builder and "trigger_tokens = []" in builder


def test_prompt_logprobs_are_what_the_real_engine_returns(real: Reader) -> None:
    """The prompt's logprobs: asked with `SamplingParams(prompt_logprobs=True)`, read with the static accessor
    `get_prompt_logprobs` (floats), one per prompt token after the first, gathered over every prefill chunk and set
    on the request's first output. They follow the request's temperature, top-p and top-k (why the server runs a
    scoring request at temperature 1, both off), and YoCo prefill truncation turns them off: the adapter refuses
    such requests, reading the same variable with the same default."""
    assert "prompt_logprobs" in USED.sampling_kw and "get_prompt_logprobs" in USED.output_accessors
    pyi, proc, prep = (
        real("deepinfer/_C/engine.pyi"),
        real("csrc/engine/process_output.hpp"),
        real("csrc/engine/prepare_sample.cpp"),
    )
    engine, environ = real("deepinfer/engine/llm_engine.py"), real("deepinfer/environ.py")
    utils = real("deepinfer/model_executor/layers/sampler_utils.py")
    assert pyi and proc and prep and engine and environ and utils
    assert re.search(r"def get_prompt_logprobs\(ptr[^)]*\) -> list\[float\]", pyi)
    assert "only prompt_len - 1 logprobs in prompt_logprobs" in proc and "is_last_prompt_chunk()" in proc
    assert "return seq_metadata.seqlen_q - int(seq_metadata.is_last_prompt_chunk());" in prep
    assert "inputs.logits.temperatures[start:end], inputs.logits.top_ps[start:end], inputs.logits.top_ks" in utils
    assert 'DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE = EnvVar.choice(default="off"' in environ
    assert 'if self.yoco_prefill_truncation_mode != "off" and sampling_params.prompt_logprobs:' in engine
    assert "sampling_params.prompt_logprobs = False" in engine
    build = ADAPTER_SOURCES[1].read_text(encoding="utf-8")
    assert 'str(envs.DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE) == "off"' in build


@pytest.mark.parametrize("which", ["real", "fake"])
def test_images_are_what_the_engine_reads(real: Reader, which: str) -> None:
    """A request's images: the adapter reads the engine's `multi_modal_processor.mm_config.image_token_id` and
    passes `multi_modal_data` with exactly the keys `overwrite_prompt` reads, `image_bytes` and `image_sizes`
    ((width, height) per placeholder); a text-only request passes None. The fake models the same names."""
    from deepinfer_server.engine.base import Images, Submit
    from deepinfer_server.engine.deepinfer import DeepInferEngine

    read = real if which == "real" else fake_reader
    _, eng_tree = _module(read, "deepinfer.engine.llm_engine")
    assert "multi_modal_processor" in _self_attrs(_class(eng_tree, "LLMEngine"))
    mm = read("deepinfer/ve/multimodal_processor.py") if which == "real" else read("deepinfer/engine/llm_engine.py")
    assert mm is not None
    assert "self.mm_config.image_token_id" in mm and "def overwrite_prompt" in mm
    keys = set(re.findall(r"multi_modal_data\.get\(\"(image_\w+)\"", mm))
    assert keys == {"image_bytes", "image_sizes"}, keys

    class Processor:  # the attribute path the adapter reads
        class mm_config:
            image_token_id = 7

    engine = DeepInferEngine.__new__(DeepInferEngine)
    engine.engine = type("E", (), {"multi_modal_processor": Processor})()
    engine.image_placeholder_id = 5
    np = pytest.importorskip("numpy")
    ids = np.asarray([1, 5, 2, 5], dtype=np.int32)
    pics = Images([b"a", b"bc"], [(3, 4), (5, 6)], 10)
    req = Submit(1, [1, 5, 2, 5], 4, 1.0, 1.0, -1, None, False, images=pics)
    got = engine._images(ids, req)
    assert got == {"image_bytes": [b"a", b"bc"], "image_sizes": [(3, 4), (5, 6)]} and set(got) == keys
    assert ids.tolist() == [1, 7, 2, 7]  # the placeholders moved to the engine's image token
    assert engine._images(ids, Submit(2, [1], 4, 1.0, 1.0, -1, None, False)) is None


@pytest.mark.parametrize("which", ["real", "fake"])
def test_a_reload_can_close_the_engine_and_build_another(real: Reader, which: str) -> None:
    """What `DeepInferEngine.reload` relies on: the weights load only in the constructor (no in-place update to
    call instead); `close()` stops the workers, whose `stop` destroys the CUDA graphs and the process group, so a
    second constructor can initialise distributed again (it does so only when it is not initialised); and
    `__del__` of the engine dropped after `close()` does not close it twice."""
    read = real if which == "real" else fake_reader
    engine = read("deepinfer/engine/llm_engine.py")
    assert engine is not None
    _, tree = _module(read, "deepinfer.engine.llm_engine")
    methods = _methods(_class(tree, "LLMEngine"))
    close, delete = ast.unparse(methods["close"]), ast.unparse(methods["__del__"])
    assert "if self.closed:\n        return" in close and "self.closed = True" in close
    assert "self.close()" in delete
    assert not any("weight" in name and "load" in name for name in methods), sorted(methods)
    if which == "real":
        init, base = ast.unparse(methods["__init__"]), read("deepinfer/worker/base.py")
        assert "self._run_workers('load_model'" in init and "self._init_cache()" in init
        assert "self._run_workers('stop')" in close
        assert base is not None
        stop = ast.unparse(_methods(_class(parse(base), "WorkerBase"))["stop"])
        assert "destroy_cuda_graphs()" in stop and "dist.destroy_process_group()" in stop
        assert "    if not dist.is_initialized():\n        rank = engine_rank * cp_size + cp_rank" in base
    else:  # the fake tears down and initialises again the same way
        assert "dist.destroy_process_group()" in close and "if not dist.is_initialized():" in engine
