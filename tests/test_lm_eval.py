"""EleutherAI's lm-evaluation-harness (`lm-eval`) scores a multiple-choice task against the server end to end, the
way a user evaluates a model behind an OpenAI-compatible endpoint: `--model local-completions` on /v1/completions.

A multiple-choice task is scored by loglikelihood: for each choice lm-eval sends the question and the choice as one
prompt with `echo: true, logprobs: 1, max_tokens: 1`, and sums the prompt logprobs of the choice's tokens
(`choices[].logprobs.token_logprobs[ctxlen:-1]`, ctxlen being the question's token count by lm-eval's own
tokenizer; `top_logprobs` over the same range gives `is_greedy`). The task (tests/lm_eval_task/) is six questions
read from a local jsonl (`dataset_path: json`), so nothing comes from the Hugging Face Hub.

The tokenizer is the one a user has: the checkpoint's (`tokenizer=<dir with tokenizer.json>`,
`tokenizer_backend=huggingface`); the server here serves the bundled tokenizer, so lm-eval loads that directory. The
requests stay tokenized (lm-eval's default, `tokenized_requests=True`): the prompt goes as token IDs, which the
server takes as given, so lm-eval's ctxlen indexes the server's `token_logprobs` exactly. As text the server would
tokenize it again and prepend BOS, one token more than lm-eval counted, and every choice would be scored off by one.
(`tokenizer_backend=remote` needs vLLM's `/tokenizer_info`, which the server does not have.)

lm-eval has no torch dependency of its own (torch is in its `hf` extra), but `transformers` (its Hugging Face
tokenizer), `datasets` (pyarrow, pandas) and the packages it imports at start-up (sacrebleu, pytablewriter) are large
and unused elsewhere: they are installed once with `--no-deps` into a cache directory, what the test venv already
has (numpy, requests, aiohttp, tenacity, tqdm, fsspec, xxhash, ...) is reused, and lm-eval runs in a subprocess with
that directory on PYTHONPATH. torch is not installed and nothing on this path imports it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server
from tokenizers import Tokenizer

from deepinfer_server.launcher import BUNDLED_TOKENIZER

VERSION = "0.4.13"
# lm-eval, and what a local-completions run on a local json task imports that the test venv does not have.
PINS = (
    f"lm-eval=={VERSION}",
    "transformers==5.25.0",  # AutoTokenizer (tokenizer_backend=huggingface); PyTorch-free for tokenizers
    "safetensors==0.8.0",  # transformers checks its version at import
    # transformers checks these two at import too (tokenizers<0.24, huggingface-hub<3): pinned here so a newer
    # one in the venv cannot break the run.
    "tokenizers==0.23.3",
    "huggingface-hub==2.4.0",
    "datasets==5.2.0",  # dataset_path: json
    "pyarrow==26.0.1",
    "pandas==3.1.1",
    "python-dateutil==4.0.0",
    "multiprocess==0.70.19",
    "dill==0.4.1",
    "jinja2==3.1.6",  # doc_to_text templates
    "sacrebleu==2.6.0",  # imported by lm_eval.api.metrics
    "portalocker==4.4.2",
    "tabulate==0.10.0",
    "colorama==0.4.6",
    "lxml==6.1.3",
    "pytablewriter==1.2.1",  # the results table
    "dataproperty==1.1.1",
    "typepy==2.0.0",
    "mbstrdecoder==1.1.5",
    "tabledata==1.3.5",
    "tcolorpy==0.1.7",
    "pathvalidate==3.3.1",
    "chardet==7.7.0",
)
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer-server" / f"lm-eval-{VERSION}"
TASK_DIR = Path(__file__).with_name("lm_eval_task")
TASK = "deepinfer_mc"


@pytest.fixture(scope="module")
def lm_eval() -> Path:
    """lm-eval and the packages its run needs, installed without their dependencies (cached; reinstalled when the
    pins change)."""
    marker = CACHE / ".complete"
    pins = "\n".join(PINS)
    if not marker.is_file() or marker.read_text() != pins:
        shutil.rmtree(CACHE, ignore_errors=True)
        CACHE.mkdir(parents=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(CACHE), *PINS]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=420)
        if done.returncode != 0:
            pytest.fail(f"cannot install lm-eval {VERSION} from the package index: {done.stderr[-800:]}")
        marker.write_text(pins)
    return CACHE


def questions() -> list[dict[str, Any]]:
    lines = (TASK_DIR / "questions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_the_request_lm_eval_sends_for_a_loglikelihood(http: httpx.Client) -> None:
    """lm-eval 0.4.13's body for one (context, continuation) pair, as it sends it, and what its `parse_logprobs`
    reads back: `token_logprobs[ctxlen:-1]` and `top_logprobs[ctxlen:-1]` of each choice (sorted by `index`). It
    drops the last entry as the one generated token's, so the list is the prompt's then exactly one more; a top
    entry is a non-empty {token: logprob} (`is_greedy` compares the token's logprob with its max)."""
    tok = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    context = tok.encode("Question: What is the capital of France?\nAnswer:", add_special_tokens=False).ids
    whole = tok.encode("Question: What is the capital of France?\nAnswer: Paris", add_special_tokens=False).ids
    assert whole[: len(context)] == context and len(whole) > len(context)
    body = {"model": MODEL, "prompt": [whole], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234}
    r = http.post("/v1/completions", json={**body, "echo": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["index"] == 0
    logprobs, top = choice["logprobs"]["token_logprobs"], choice["logprobs"]["top_logprobs"]
    assert len(logprobs) == len(top) == len(whole) + 1, choice["logprobs"]
    assert logprobs[0] is None  # the first prompt token has no context
    for lp, alternatives in zip(logprobs[1:], top[1:], strict=True):
        assert isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0, choice["logprobs"]
        assert isinstance(alternatives, dict) and alternatives, choice["logprobs"]
        assert all(isinstance(v, float) and v <= 0.0 for v in alternatives.values()), choice["logprobs"]


@pytest.mark.timeout(600)  # a first run installs lm-eval (about 30 s, 500 MB unpacked)
def test_lm_eval_scores_a_multiple_choice_task(server: Server, lm_eval: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    model_args = ",".join(
        (
            f"model={MODEL}",
            f"base_url={server.url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={BUNDLED_TOKENIZER.parent}",
            "tokenized_requests=True",
            "max_retries=1",  # a refused request fails the run at once, with the server's error in the log
        )
    )
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args]
    cmd += ["--include_path", str(TASK_DIR), "--tasks", TASK, "--output_path", str(out), "--log_samples"]
    env = {
        **os.environ,
        "PYTHONPATH": str(lm_eval),
        # Hermetic and offline: the task's data is local (its data_files path is relative to the task folder, the
        # working directory), and the datasets cache goes to tmp_path.
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "TQDM_DISABLE": "1",
    }
    done = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=180)
    refused = [line for line in done.stderr.splitlines() if "API request failed" in line][:2]  # the server's error
    assert done.returncode == 0, "\n".join((f"lm-eval failed (exit {done.returncode}):", *refused, done.stderr[-3000:]))

    (results_file,) = out.glob("*/results_*.json")
    results = json.loads(results_file.read_text())
    acc = results["results"][TASK]["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0, results["results"]
    docs = questions()
    assert results["n-samples"][TASK] == {"original": len(docs), "effective": len(docs)}

    # Per question, one (loglikelihood, is_greedy) per choice: a log-probability, so finite and at most 0.
    (samples_file,) = out.glob(f"*/samples_{TASK}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert len(samples) == len(docs)
    for sample, doc in zip(samples, docs, strict=True):
        scores = [float(loglikelihood) for loglikelihood, _greedy in sample["filtered_resps"]]
        assert len(scores) == len(doc["choices"]), sample
        assert all(math.isfinite(s) and s <= 0.0 for s in scores), sample
