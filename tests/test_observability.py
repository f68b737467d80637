"""The Grafana dashboard (deploy/grafana/) and the Prometheus alert rules (deploy/prometheus/) against a running
server: every metric their PromQL reads is exported, with the label values they match on and group by; the rules pass
`promtool check rules` and their unit tests (`promtool test rules`), which fail when a rule is changed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from conftest import MODEL, Server, start_server

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "deepinfer-server.json"
RULES = ROOT / "deploy" / "prometheus" / "deepinfer-rules.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "deepinfer-rules.test.yaml"
PROMTOOL = shutil.which("promtool")
# Labels the scrape adds (Prometheus Operator's PodMonitor: pod, namespace; every job: instance, job).
TARGET_LABELS = {"pod", "namespace", "instance", "job", "le"}
SYNTHETIC = frozenset({"up"})  # series Prometheus writes itself for every target
PROMQL_WORDS = {
    "sum", "max", "min", "avg", "count", "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
    "unless", "rate", "irate", "increase", "histogram_quantile", "label_values", "bool", "offset", "topk", "bottomk",
    "abs", "clamp_min", "clamp_max", "time", "vector", "scalar", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """The metric names an expression selects: identifiers outside strings, label matchers, durations and
    grouping clauses that are neither functions, keywords nor numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def grouping_labels(expr: str) -> set[str]:
    out: set[str] = set()
    for m in re.finditer(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        out |= {x.strip() for x in m.group(1).split(",") if x.strip()}
    return out


def exact_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(metric, label, value) of every `label="value"` matcher without a template variable."""
    out = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        for lm in re.finditer(r'(\w+)\s*=\s*"([^"$]*)"', m.group(2)):
            out.append((m.group(1), lm.group(1), lm.group(2)))
    return out


def test_the_promql_parser_finds_names_and_only_names() -> None:
    expr = 'histogram_quantile(0.95, sum by (le, pod) (rate(vllm:x_bucket{a="b c", d=~"$v"}[5m]))) / on (pod) y > 1'
    assert promql_metric_names(expr) == {"vllm:x_bucket", "y"}
    assert grouping_labels(expr) == {"le", "pod"}
    assert exact_matchers(expr) == [("vllm:x_bucket", "a", "b c")]


@pytest.fixture(scope="module")
def exported() -> Iterator[dict[str, list[dict[str, str]]]]:
    """Sample name -> the label sets it is exported with, from a running server that has served a request."""
    srv: Server = start_server("--dp", "2", "--served-model-name", MODEL)
    try:
        r = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200
        text = httpx.get(f"{srv.url}/metrics", timeout=5).text
    finally:
        srv.stop()
    out: dict[str, list[dict[str, str]]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
            assert m, line
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            out.setdefault(m.group(1), []).append(labels)
    yield out


def check_exprs(
    exprs: list[str], exported: dict[str, list[dict[str, str]]], allowed: frozenset[str] = frozenset()
) -> None:
    assert exprs
    for expr in exprs:
        names = promql_metric_names(expr)
        assert names, expr
        missing = names - set(exported) - allowed
        assert not missing, f"{expr}: not exported by the server: {missing}"
        labels = {k for n in names & set(exported) for ls in exported[n] for k in ls}
        assert grouping_labels(expr) <= labels | TARGET_LABELS, (expr, grouping_labels(expr) - labels)
        for metric, label, value in exact_matchers(expr):
            assert any(ls.get(label) == value for ls in exported.get(metric, [])), (expr, metric, label, value)


def test_every_metric_the_dashboard_queries_is_exported(exported: dict[str, list[dict[str, str]]]) -> None:
    dash = json.loads(DASHBOARD.read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["definition"].replace("label_values(", "").split(",")[0] for v in dash["templating"]["list"][1:]]
    check_exprs(exprs, exported)
    queried = set().union(*(promql_metric_names(e) for e in exprs))
    # what the issue asks the dashboard to show
    for needed in (
        "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket", "vllm:generation_tokens_total", "vllm:num_requests_running",
        "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "deepinfer_rejected_requests_total",
        "deepinfer_aborted_requests_total", "deepinfer_rank_heartbeat_age_seconds", "deepinfer_ring_used_bytes",
    ):  # fmt: skip
        assert needed in queried, needed
    assert any("rate_limit_exceeded" in e for e in exprs)  # the 429s
    assert any("by (reason)" in e and "aborted" in e for e in exprs)  # aborts by reason


def test_every_metric_the_alert_rules_query_is_exported(exported: dict[str, list[dict[str, str]]]) -> None:
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert names >= {"DeepInferRankHeartbeatStale", "DeepInferUnhealthy", "DeepInferSustained429",
                     "DeepInferTTFTHigh", "DeepInferErrorRate"}  # fmt: skip
    check_exprs([r["expr"] for r in rules], exported, SYNTHETIC)


needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (scripts/test.sh installs Debian's prometheus package as root)"
)


@needs_promtool
def test_promtool_checks_the_rules_and_their_unit_tests_pass() -> None:
    assert PROMTOOL is not None
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 6 rules found" in check.stdout + check.stderr
    test = subprocess.run([PROMTOOL, "test", "rules", str(RULE_TESTS)], capture_output=True, text=True)
    assert test.returncode == 0, test.stdout + test.stderr


@needs_promtool
@pytest.mark.parametrize(
    ("old", "new"),
    [("deepinfer_rank_heartbeat_age_seconds) > 60", "deepinfer_rank_heartbeat_age_seconds) > 600"),
     ('reason!="client_disconnect"', 'reason!="engine_error"'), ("for: 10m", "for: 1h")],
)  # fmt: skip
def test_the_rule_unit_tests_fail_when_a_rule_changes(tmp_path: Path, old: str, new: str) -> None:
    assert PROMTOOL is not None
    text = RULES.read_text()
    assert old in text
    (tmp_path / RULES.name).write_text(text.replace(old, new))
    (tmp_path / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    test = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / RULE_TESTS.name)], capture_output=True, text=True)
    assert test.returncode != 0 and "FAILED" in test.stdout + test.stderr
