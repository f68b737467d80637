"""Offline checks of the deployment files: Dockerfile, docker/entrypoint.sh, the GPUStack backend YAML and
scripts/smoke.py (run end to end against an in-process fake OpenAI server).

Fast, no network, no GPU, no gpustack import (scripts/check_gpustack_backend.py does the GPUStack-side check).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
BACKEND_YAML = REPO / "gpustack-deepinfer-server-backend.yaml"
SMOKE = REPO / "scripts" / "smoke.py"

DEEPINFER_COMMIT = "9bd9cf243fc53ef9afbf8f04d391d989117d6ab9"


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text(encoding="utf-8")


def test_dockerfile_pins(dockerfile: str) -> None:
    assert DEEPINFER_COMMIT in dockerfile
    assert "github.com/deepseek-ai/DeepInfer" in dockerfile
    assert re.search(r"git checkout\b", dockerfile)
    assert "nvidia/cuda:13.2.0-devel-ubuntu24.04" in dockerfile
    assert "python3.12" in dockerfile
    assert re.search(r"DEEPSEEK_RECIPE_VERSION=0\.2\.0|deepseek-recipe==0\.2\.0", dockerfile)
    assert "DEEPINFER_ACCELERATOR=nvidia" in dockerfile


def test_dockerfile_build_args(dockerfile: str) -> None:
    assert re.search(r"^ARG MAX_JOBS=8$", dockerfile, re.M)
    assert re.search(r"^ARG FLASH_MLA_SKIP_REG_SPILL_CHECK=0$", dockerfile, re.M)
    # The override reaches the build only when set to 1.
    assert '= "1" ]' in dockerfile and "unset FLASH_MLA_SKIP_REG_SPILL_CHECK" in dockerfile


def test_dockerfile_pip_check_allows_only_the_nccl_override(dockerfile: str) -> None:
    assert "pip check" in dockerfile
    assert "nvidia-nccl-cu13==2\\.29\\.7" in dockerfile and "nvidia-nccl-cu13 2\\.32\\.3" in dockerfile


def test_dockerfile_wheel_stage_and_runtime(dockerfile: str) -> None:
    assert re.search(r"^FROM .* AS wheel$", dockerfile, re.M)
    assert "rustup" in dockerfile
    assert "maturin build --release" in dockerfile
    assert "COPY --from=wheel" in dockerfile
    # rustup only in the builder stage
    final = dockerfile.split("AS final", 1)[1]
    assert "rustup" not in final and "cargo" not in final
    assert "DEEPINFER_JIT_CACHE_DIR=/cache/jit" in dockerfile
    assert "HF_HOME=/cache/huggingface" in dockerfile
    assert re.search(r"^EXPOSE 8000$", dockerfile, re.M)
    assert "COPY docker/entrypoint.sh /usr/local/bin/deepinfer-entrypoint.sh" in dockerfile
    assert re.search(r'^ENTRYPOINT \["/usr/local/bin/deepinfer-entrypoint.sh"\]$', dockerfile, re.M)


def test_the_image_runs_unprivileged_with_a_cache_others_cannot_write(dockerfile: str) -> None:
    """Remote code (--trust-remote-code) and JIT artifacts in /cache run inside the server: the server is not root
    and no other user may write there."""
    final = dockerfile.split("AS final", 1)[1]
    users = re.findall(r"^USER (\S+)$", final, re.M)
    assert users, "the final stage sets no USER: it runs as root"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) not in (0, 1000), users  # 1000 is the base image's own `ubuntu` user
    assert final.rindex("USER ") > final.rindex("\nRUN "), "a RUN after USER would build as the server's user"
    assert re.search(rf"useradd [^\n]*--uid {uid}\b", final), "the uid has no account"
    assert not re.search(r"chmod [^\n]*(1777|0?777|o\+w|a\+w)", final), "something is made world-writable"
    assert re.search(rf"chown -R {uid}:0 /cache", final)


def _pip_check_gate(dockerfile: str) -> str:
    m = re.search(r"^RUN (allowed=.*?)\n\n", dockerfile, re.S | re.M)
    assert m, "pip check RUN step not found"
    return m.group(1).replace("\\\n", " ")


NCCL_LINE = (
    'torch 2.13.0+cu132 has requirement nvidia-nccl-cu13==2.29.7; platform_system == "Linux", '
    "but you have nvidia-nccl-cu13 2.32.3."
)


@pytest.mark.parametrize(
    ("status", "output", "expect_ok"),
    [
        (0, "No broken requirements found.", True),
        (1, NCCL_LINE, True),
        (1, NCCL_LINE + "\nfoo 1.0 requires bar, which is not installed.", False),
        (1, NCCL_LINE.replace("2.32.3", "2.33.0"), False),
        (1, "", False),
    ],
)
def test_dockerfile_pip_check_gate(dockerfile: str, tmp_path: Path, status: int, output: str, expect_ok: bool) -> None:
    fake = tmp_path / "pip"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{output}\nEOF\nexit {status}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    r = subprocess.run(
        ["bash", "-o", "pipefail", "-c", _pip_check_gate(dockerfile)], env=env, capture_output=True, text=True
    )
    assert (r.returncode == 0) == expect_ok, (r.stdout, r.stderr)


# ---------------------------------------------------------------------------------------------------------------
# docker/entrypoint.sh
# ---------------------------------------------------------------------------------------------------------------

STUB = """#!/bin/sh
printf 'memlock=%s\\n' "$(ulimit -l)"
printf 'stack=%s\\n' "$(ulimit -s)"
for a in "$@"; do printf 'arg=[%s]\\n' "$a"; done
"""

ARGS = ["/models/DeepSeek V4.1", "--served-model-name", "my model", "", "--x=$HOME *", "it's"]


@pytest.fixture
def stub_env(tmp_path: Path) -> dict[str, str]:
    stub = tmp_path / "stub-server"
    stub.write_text(STUB)
    stub.chmod(0o755)
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("DEEPINFER_JIT_CACHE_DIR", "HF_HOME")}
    env.update(
        DEEPINFER_SERVER_BIN=str(stub),
        DEEPINFER_CACHE_ROOT=str(cache),
        DEEPINFER_JIT_CACHE_DIR=str(tmp_path / "gpustack" / "jit"),
        HF_HOME=str(cache / "huggingface"),
    )
    return env


def _parse_stub(stdout: str) -> tuple[dict[str, str], list[str]]:
    limits = dict(line.split("=", 1) for line in stdout.splitlines() if not line.startswith("arg="))
    args = [line[len("arg=[") : -1] for line in stdout.splitlines() if line.startswith("arg=")]
    return limits, args


def _can_raise_limits(prefix: list[str]) -> bool:
    r = subprocess.run([*prefix, "bash", "-c", "ulimit -l unlimited && ulimit -s 65536"], capture_output=True)
    return r.returncode == 0


def test_dockerfile_stops_with_sigterm(dockerfile: str) -> None:
    """SIGTERM drains (tests/test_lifecycle.py); another stop signal would skip the drain."""
    assert re.search(r"^STOPSIGNAL SIGTERM$", dockerfile, re.M)
    assert dockerfile.rstrip().endswith('ENTRYPOINT ["/usr/local/bin/deepinfer-entrypoint.sh"]')


def test_entrypoint_is_executable_and_strict() -> None:
    text = ENTRYPOINT.read_text()
    assert os.access(ENTRYPOINT, os.X_OK)
    assert "set -eu" in text
    assert 'exec "$SERVER_BIN" "$@"' in text
    assert "ulimit" in text and "65536" in text and "unlimited" in text


def test_entrypoint_passes_args_and_creates_caches(stub_env: dict[str, str], tmp_path: Path) -> None:
    r = subprocess.run([str(ENTRYPOINT), *ARGS], env=stub_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    _, args = _parse_stub(r.stdout)
    assert args == ARGS
    assert (tmp_path / "cache" / "jit").is_dir()
    assert (tmp_path / "cache" / "huggingface").is_dir()
    assert (tmp_path / "gpustack" / "jit").is_dir()


def test_entrypoint_propagates_exit_status(stub_env: dict[str, str], tmp_path: Path) -> None:
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\nexit 7\n")
    failing.chmod(0o755)
    r = subprocess.run([str(ENTRYPOINT)], env={**stub_env, "DEEPINFER_SERVER_BIN": str(failing)}, timeout=30)
    assert r.returncode == 7


def test_entrypoint_raises_limits_when_permitted(stub_env: dict[str, str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("not root: raising the limits needs root")
    if not _can_raise_limits([]):
        pytest.skip("root without CAP_SYS_RESOURCE here (e.g. an unprivileged container): limits cannot be raised")
    r = subprocess.run([str(ENTRYPOINT), "x"], env=stub_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    limits, args = _parse_stub(r.stdout)
    assert limits == {"memlock": "unlimited", "stack": "65536"}
    assert args == ["x"]
    assert "WARNING" not in r.stderr


def test_entrypoint_warns_and_continues_when_limits_cannot_be_raised(stub_env: dict[str, str]) -> None:
    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    low_kib = 8192 if hard == resource.RLIM_INFINITY else min(8192, hard // 1024)
    # Lower the stack limit (soft and hard) below the requested 64 MiB. A privileged root could raise it back,
    # so drop CAP_SYS_RESOURCE for the child when setpriv is available.
    prefix: list[str] = []
    if os.geteuid() == 0 and shutil.which("setpriv"):
        prefix = ["setpriv", "--inh-caps=-sys_resource", "--bounding-set=-sys_resource"]
    lowered = [*prefix, "bash", "-c", f'ulimit -s {low_kib} && exec "$@"', "lowered"]
    probe = subprocess.run([*lowered, "bash", "-c", "ulimit -s 65536"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("cannot create a process that is unable to raise its stack limit here")
    r = subprocess.run([*lowered, str(ENTRYPOINT), *ARGS], env=stub_env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    limits, args = _parse_stub(r.stdout)
    assert args == ARGS
    assert limits["stack"] == str(low_kib)
    assert "WARNING" in r.stderr and "stack" in r.stderr
    assert "error setting limit" not in r.stderr and "cannot modify limit" not in r.stderr  # shell noise hidden


# ---------------------------------------------------------------------------------------------------------------
# GPUStack backend YAML
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(BACKEND_YAML.read_text(encoding="utf-8"))
    assert isinstance(data, dict)
    return data


# The keys GPUStack's /from-yaml import keeps (gpustack/routes/inference_backend.py, allowed_keys).
FROM_YAML_KEYS = {
    "backend_name",
    "version_configs",
    "default_version",
    "default_backend_param",
    "default_run_command",
    "default_entrypoint",
    "health_check_path",
    "description",
    "default_env",
    "enabled",
    "backend_source",
    "parameter_format",
    "common_parameters",
}


def test_backend_yaml_schema(backend: dict[str, Any]) -> None:
    assert set(backend) <= FROM_YAML_KEYS, set(backend) - FROM_YAML_KEYS
    assert backend["backend_name"] == "DeepInfer-server-custom"
    assert backend["backend_name"].endswith("-custom")
    assert backend["health_check_path"] == "/health"
    assert backend["parameter_format"] == "space"
    assert backend["description"]
    version = backend["default_version"]
    assert version == "0.1.0"
    cfg = backend["version_configs"][version]
    assert cfg["image_name"] == "quay.io/gpustack/deepinfer-server:latest"
    assert cfg["custom_framework"] == "cuda"
    assert "default_entrypoint" not in backend  # the image entrypoint must run (ulimits)
    for p in ("--max-model-len", "--max-num-seqs", "--data-parallel-size", "--gpu-memory-utilization"):
        assert p in backend["common_parameters"]


def test_backend_yaml_run_command(backend: dict[str, Any]) -> None:
    import shlex

    cmd = backend["default_run_command"]
    for var in ("{{model_path}}", "{{port}}", "{{model_name}}", "{{gpu_count}}"):
        assert var in cmd
    args = shlex.split(cmd)
    assert args[0] == "{{model_path}}"  # args only: no program name
    pairs = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert pairs["--port"] == "{{port}}"
    assert pairs["--host"] == "0.0.0.0"
    assert pairs["--served-model-name"] == "{{model_name}}"
    assert pairs["--expert-parallel-size"] == "{{gpu_count}}"
    assert pairs["--data-parallel-size"] == "1"
    assert pairs["--startup-timeout"] == "3600"
    assert "--trust-remote-code" in args


def test_backend_yaml_env(backend: dict[str, Any]) -> None:
    env = backend["default_env"]
    assert all(isinstance(v, str) for v in env.values()), "GPUStack requires string env values"
    assert env["DEEPINFER_JIT_CACHE_DIR"] == "/var/lib/gpustack/cache/deepinfer/jit"
    assert env["NCCL_IB_HCA"] == "=mlx5_0"
    assert env["NCCL_IB_SL"] == "0"
    assert env["EP_OVERRIDE_RDMA_SL"] == "0"
    assert env["GPUSTACK_HOST_IPC"] == "true"
    assert float(env["GPUSTACK_MODEL_RUNTIME_SHM_SIZE_GIB"]) >= 16


# ---------------------------------------------------------------------------------------------------------------
# scripts/smoke.py against a fake OpenAI server
# ---------------------------------------------------------------------------------------------------------------

MODEL = "fake-model"


class FakeHandler(BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        v = self.server.variant
        if self.path == "/health":
            self._json(503 if v == "health_503" else 200, {"status": "ok"})
        elif self.path == "/v1/models":
            entry: dict[str, Any] = {"id": MODEL, "object": "model", "owned_by": "deepinfer", "max_model_len": 4096}
            if v == "no_max_model_len":
                del entry["max_model_len"]
            self._json(200, {"object": "list", "data": [entry]})
        else:
            self._json(404, {"error": {"message": "not found"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        req = json.loads(self.rfile.read(length))
        self.server.requests.append({"path": self.path, "headers": dict(self.headers), "body": req})
        if self.path != "/v1/chat/completions":
            self._json(404, {"error": {"message": "not found"}})
            return
        if req.get("stream"):
            self._stream(req)
        else:
            self._complete(req)

    def _usage(self, prompt: int, completion: int, stream: bool = False) -> dict[str, int]:
        broken = self.server.variant == ("bad_stream_usage" if stream else "bad_usage")
        total = prompt + completion + (1 if broken else 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}

    def _complete(self, req: dict[str, Any]) -> None:
        v = self.server.variant
        messages = req["messages"]
        message: dict[str, Any] = {"role": "assistant", "content": "Hello there!"}
        finish = "stop"
        if req.get("tools") and not any(m["role"] == "tool" for m in messages) and v != "no_tool":
            args = "{not json" if v == "bad_tool_args" else json.dumps({"city": "Paris"})
            message = {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": args}}
                ],
            }
            finish = "tool_calls"
        elif any(m["role"] == "tool" for m in messages):
            message["content"] = "It is sunny in Paris, 18 degrees."
        elif req.get("tools"):
            message["content"] = "I cannot check the weather, but Paris is lovely."
        resp = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": self._usage(12, 5),
        }
        self._json(200, resp)

    def _stream(self, req: dict[str, Any]) -> None:
        v = self.server.variant
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict[str, Any]:
            return {
                "id": "chatcmpl-2",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": MODEL,
                "choices": choices,
                "usage": usage,
            }

        events = [
            chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
            chunk([{"index": 0, "delta": {"content": "1, 2"}, "finish_reason": None}]),
            chunk([{"index": 0, "delta": {"content": ", 3, 4, 5"}, "finish_reason": None}]),
            chunk([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
        ]
        include_usage = (req.get("stream_options") or {}).get("include_usage")
        if include_usage:
            events.append(chunk([], self._usage(10, 9, stream=True)))
            if v == "double_usage":
                events.append(chunk([], self._usage(10, 9, stream=True)))
        lines = [": keep-alive"] + [f"data: {json.dumps(e)}" for e in events]
        if v == "non_json_line":
            lines.insert(2, "data: {oops")
        if v != "no_done":
            lines.append("data: [DONE]")
        for line in lines:
            self.wfile.write(f"{line}\n\n".encode())
            self.wfile.flush()


class FakeServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, variant: str) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.variant = variant
        self.requests: list[dict[str, Any]] = []


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[FakeServer]:
    server = FakeServer(getattr(request, "param", "ok"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def run_smoke(server: FakeServer, *extra: str) -> subprocess.CompletedProcess[str]:
    url = f"http://127.0.0.1:{server.server_address[1]}"
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    return subprocess.run(
        [sys.executable, str(SMOKE), "--base-url", url, "--timeout", "10", *extra],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_smoke_is_stdlib_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    text = SMOKE.read_text()
    imported = set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_][\w]*)", text, re.M))
    assert imported <= allowed, imported - allowed


def test_smoke_ok(fake_server: FakeServer) -> None:
    r = run_smoke(fake_server, "--api-key", "sk-test")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("SMOKE OK")
    for step in ("health", "models", "chat", "stream", "tools", "tools-result"):
        assert f"PASS {step}:" in r.stdout
    assert "SMOKE FAIL" not in r.stderr
    chats = [q for q in fake_server.requests if q["path"] == "/v1/chat/completions"]
    assert len(chats) == 4
    for q in chats:
        assert q["body"]["model"] == MODEL
        assert q["body"]["thinking"] == {"type": "disabled"}
        assert q["headers"].get("Authorization") == "Bearer sk-test"
    assert chats[0]["body"]["max_tokens"] == 64 and chats[0]["body"]["stream"] is False
    assert chats[1]["body"]["stream"] is True
    assert chats[1]["body"]["stream_options"] == {"include_usage": True}
    assert chats[2]["body"]["tool_choice"] == "auto"
    assert chats[2]["body"]["tools"][0]["function"]["name"] == "get_weather"
    second = chats[3]["body"]["messages"]
    assert second[1]["role"] == "assistant" and second[1]["tool_calls"][0]["id"] == "call_0"
    assert second[2] == {"role": "tool", "tool_call_id": "call_0", "content": second[2]["content"]}
    assert json.loads(second[2]["content"])["city"] == "Paris"


def test_smoke_explicit_model(fake_server: FakeServer) -> None:
    assert run_smoke(fake_server, "--model", MODEL).returncode == 0
    r = run_smoke(fake_server, "--model", "other-model")
    assert r.returncode == 1
    assert "SMOKE FAIL: models:" in r.stderr and "other-model" in r.stderr


@pytest.mark.parametrize(
    ("fake_server", "step", "needle"),
    [
        ("health_503", "health", "503"),
        ("no_max_model_len", "models", "max_model_len"),
        ("bad_usage", "chat", "total_tokens"),
        ("no_done", "stream", "[DONE]"),
        ("bad_stream_usage", "stream", "total_tokens"),
        ("double_usage", "stream", "exactly one usage"),
        ("non_json_line", "stream", "not JSON"),
        ("bad_tool_args", "tools", "not valid JSON"),
    ],
    indirect=["fake_server"],
)
def test_smoke_detects_broken_server(fake_server: FakeServer, step: str, needle: str) -> None:
    r = run_smoke(fake_server)
    assert r.returncode == 1, r.stdout
    assert f"SMOKE FAIL: {step}:" in r.stderr, r.stderr
    assert needle in r.stderr
    assert "SMOKE OK" not in r.stdout


@pytest.mark.parametrize("fake_server", ["no_tool"], indirect=True)
def test_smoke_without_tool_call(fake_server: FakeServer) -> None:
    r = run_smoke(fake_server)
    assert r.returncode == 0, r.stderr
    assert "WARN tools:" in r.stderr
    r = run_smoke(fake_server, "--require-tool-call")
    assert r.returncode == 1
    assert "SMOKE FAIL: tools:" in r.stderr


def test_smoke_unreachable_server() -> None:
    with FakeServer("ok") as server:
        port = server.server_address[1]
    r = subprocess.run(
        [sys.executable, str(SMOKE), "--base-url", f"http://127.0.0.1:{port}", "--timeout", "5"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 1
    assert "SMOKE FAIL: health:" in r.stderr
