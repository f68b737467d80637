"""`deepinfer-server run-batch -i in.jsonl -o out.jsonl [server options]`: vLLM's offline batch form, run through
this server's own Batch API. It starts the server on a free local port (state in memory unless the options name a
store), sends the input as one batch per endpoint its lines name, waits, and writes one result line per input
line, in input order: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`. A line
that names no endpoint this server serves gets an error line. Its progress goes to stderr: a bar on a terminal,
plain lines when piped (`progress`). Exits 0 when every line has a result."""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from typing import Any

from deepinfer_server.progress import Progress

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
START_TIMEOUT = 3600.0  # a real model loads for minutes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-server run-batch",
        description="Run a JSONL batch file offline (vLLM's run-batch); other options go to the server.",
    )
    p.add_argument("-i", "--input-file", required=True, help="JSONL: one OpenAI Batch API request per line")
    p.add_argument("-o", "--output-file", required=True, help="JSONL: one result per input line, in order")
    return p


def main(argv: Sequence[str]) -> int:
    args, server_args = parser().parse_known_args(argv)
    with open(args.input_file, encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    results: dict[int, str] = {}
    groups: dict[str, list[int]] = {}
    for i, line in enumerate(lines):
        try:
            url = json.loads(line).get("url")
        except (ValueError, AttributeError):
            url = None
        if url in ENDPOINTS:
            groups.setdefault(url, []).append(i)
        else:
            results[i] = error_line(line, f"'url' must be one of {', '.join(ENDPOINTS)}")
    server = start_server(server_args) if groups else None
    try:
        for url, indices in groups.items():
            assert server is not None
            results.update(run_one(server[1], url, indices, lines))
    finally:
        if server is not None:
            server[0].send_signal(signal.SIGTERM)
            server[0].wait(timeout=120)
    with open(args.output_file, "w", encoding="utf-8") as out:
        for i in range(len(lines)):
            out.write(results.get(i, error_line(lines[i], "no result")) + "\n")
    return 0 if len(results) == len(lines) else 1


def start_server(server_args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = [] if "--state-store" in server_args else ["--state-store", "memory"]
    cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(port), *store, *server_args]
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"run-batch: the server exited with status {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("run-batch: the server did not start")
        time.sleep(0.2)


def run_one(url: str, endpoint: str, indices: list[int], lines: list[str]) -> dict[int, str]:
    """One endpoint's lines as one batch: their result lines by input index."""
    content = ("\n".join(lines[i] for i in indices) + "\n").encode()
    file_id = upload(url, content)["id"]
    batch = call(url, "/v1/batches", {"input_file_id": file_id, "endpoint": endpoint, "completion_window": "24h"})
    progress = Progress(endpoint)
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        progress.update(batch)
        time.sleep(0.2)
        batch = call(url, f"/v1/batches/{batch['id']}")
    progress.update(batch, final=True)
    if batch["status"] == "failed":
        why = "; ".join(f"line {e.get('line')}: {e.get('message')}" for e in batch.get("errors", {}).get("data", []))
        return {i: error_line(lines[i], f"the batch failed validation: {why}") for i in indices}
    by_id: dict[str, str] = {}
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            with urllib.request.urlopen(f"{url}/v1/files/{batch[key]}/content", timeout=600) as r:
                for line in r.read().decode().splitlines():
                    by_id[json.loads(line)["custom_id"]] = line
    out = {}
    for i in indices:
        custom_id = json.loads(lines[i]).get("custom_id")
        if custom_id in by_id:
            out[i] = by_id[custom_id]
    return out


def call(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise SystemExit(f"run-batch: {path}: {e.code} {e.read().decode()[:500]}") from None


def upload(url: str, content: bytes) -> dict[str, Any]:
    boundary = uuid.uuid4().hex
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="input.jsonl"\r\n'
        "Content-Type: application/jsonl\r\n\r\n"
    ).encode()
    body = head + content + f"\r\n--{boundary}--\r\n".encode()
    req = urllib.request.Request(
        f"{url}/v1/files", data=body, headers={"Content-Type": f"multipart/form-data; boundary={boundary}"}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as e:
        raise SystemExit(f"run-batch: upload: {e.code} {e.read().decode()[:500]}") from None


def error_line(line: str, message: str) -> str:
    try:
        custom_id = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        custom_id = None
    error = {"code": "invalid_request", "message": message}
    return json.dumps({"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None, "error": error})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
