"""deploy/kubernetes/: the core kinds validated by kubernetes-validate in strict mode against a pinned Kubernetes
version; the InferencePool and the HTTPRoute against the CRD schemas of a pinned Inference Extension and Gateway API
release; and the numbers that must agree with each other and with the server's flags (probes, grace period, /dev/shm,
labels, ports, the endpoint picker's pool).

The two CRD files are not in this repository: they are read from `DEEPINFER_CRD_DIR` (default: the steering
repository's `shared/reference/crds/` beside the clone), each pinned by its release, source URL and SHA-256 below.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from deepinfer_server.cli import build_parser, check_args
from deepinfer_server.ranks import OUTPUT_RING_BYTES, _pow2_at_least

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.34.0"  # the oldest Kubernetes these manifests target (preStop sleep is GA in 1.34)
CRD_DIR = Path(os.environ.get("DEEPINFER_CRD_DIR", ROOT.parent / "shared" / "reference" / "crds"))
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "file": "inference.networking.k8s.io_inferencepools.yaml",
        "release": "gateway-api-inference-extension v1.6.0 (commit 992e5c292afb248801ce8d9234eb5b9d28eea231)",
        "source": "https://github.com/kubernetes-sigs/gateway-api-inference-extension/blob/v1.6.0/"
        "config/crd/bases/inference.networking.k8s.io_inferencepools.yaml",
        "sha256": "55e0dbf39c50c4bbdd60106493a4573df4bb44479f9ce46762f1af718883e5cd",
    },
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "file": "gateway.networking.k8s.io_httproutes.yaml",
        "release": "gateway-api v1.6.1, standard channel (commit 8bb74df00e56ec8f944d48c25e6c1c9c2f6848e3)",
        "source": "https://github.com/kubernetes-sigs/gateway-api/blob/v1.6.1/"
        "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml",
        "sha256": "a424a0d6c953b162e71d1d97bb7e75012d8f1ac264e7274f2763d1b96ab39852",
    },
}
# Kinds of other operators, checked here only for the fields this repository relies on.
OPERATOR_KINDS = {("monitoring.coreos.com/v1", "PodMonitor")}


def docs() -> list[dict[str, Any]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        if f.name != "kustomization.yaml":
            out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def server_container() -> dict[str, Any]:
    return next(c for c in one("Deployment", "deepinfer-server")["spec"]["template"]["spec"]["containers"])


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(f.name for f in K8S.glob("*.yaml") if f.name != "kustomization.yaml")


def test_core_kinds_pass_kubernetes_validate_strict() -> None:
    core = [d for d in docs() if (d["apiVersion"], d["kind"]) not in {*CRDS, *OPERATOR_KINDS}]
    assert {d["kind"] for d in core} >= {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap", "Role"}
    for d in core:
        kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
    # strict mode is on: a misspelt field is an error, as `kubectl apply --validate=strict` makes it
    bad = copy.deepcopy(one("Deployment", "deepinfer-server"))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpget"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBERNETES_VERSION, strict=True)


def strict_schema(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as JSON Schema that rejects unknown fields, as the API server prunes and strict field
    validation rejects them. (CEL rules, x-kubernetes-validations, are not evaluated here.)"""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if "properties" in schema:
        out["properties"] = {k: strict_schema(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator:
    pin = CRDS[(api_version, kind)]
    path = CRD_DIR / pin["file"]
    if not path.exists():
        pytest.skip(
            f"the {kind} CRD is not provided: put {pin['release']}'s {pin['source']} (sha256 {pin['sha256']}) "
            f"in {CRD_DIR} or point DEEPINFER_CRD_DIR at it"
        )
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == pin["sha256"], f"{path} is not {pin['release']}'s file"
    crd = yaml.safe_load(raw)
    group, version = api_version.split("/")
    assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
    served = next(v for v in crd["spec"]["versions"] if v["name"] == version)
    assert served["served"] and served["storage"]
    schema = strict_schema(served["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: the API server's, not the CRD's
    return jsonschema.Draft202012Validator(schema)


@pytest.mark.parametrize(("api_version", "kind"), list(CRDS))
def test_inference_pool_and_http_route_match_the_pinned_crds(api_version: str, kind: str) -> None:
    validator = crd_validator(api_version, kind)
    doc = one(kind)
    assert doc["apiVersion"] == api_version
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert not errors, errors
    bad = copy.deepcopy(doc)  # the schema bites: an unknown field and an out-of-range port
    bad["spec"]["unknownField"] = 1
    if kind == "InferencePool":
        bad["spec"]["targetPorts"][0]["number"] = 70000
    else:
        bad["spec"]["rules"][0]["backendRefs"][0]["port"] = 70000
    messages = " | ".join(e.message for e in validator.iter_errors(bad))
    assert "unknownField" in messages and "70000" in messages, messages


def test_the_server_pod_is_sized_and_probed_for_a_model_load_and_a_drain() -> None:
    dep = one("Deployment", "deepinfer-server")
    pod = dep["spec"]["template"]["spec"]
    c = server_container()
    args = c["args"]
    parsed = build_parser().parse_args([*args, "--engine", "deepinfer"])
    assert check_args(parsed) is None  # the flags are the server's own
    # GPUs: the whole node, requested and limited alike; one replica per node
    gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == int(c["resources"]["requests"]["nvidia.com/gpu"]) == 8
    assert parsed.data_parallel_size * parsed.context_parallel_size == gpus == parsed.expert_parallel_size
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    # /dev/shm: memory-backed, and far more than the rings the launcher creates (NCCL and DeepEP use it too)
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm")
    shm = next(v for v in pod["volumes"] if v["name"] == mount["name"])["emptyDir"]
    assert shm["medium"] == "Memory"
    m = re.fullmatch(r"(\d+)Gi", shm["sizeLimit"])
    assert m, shm
    request_ring = _pow2_at_least(max(1 << 20, 4 * 2 * (4 * parsed.max_model_len + 64)))
    rings = parsed.data_parallel_size * (request_ring + OUTPUT_RING_BYTES)
    assert int(m.group(1)) << 30 >= 64 * rings, (shm, rings)
    # the model cache volume holds HF_HOME and the JIT cache (the image's /cache)
    claim = lambda path: next(  # noqa: E731
        v for v in pod["volumes"] if v["name"] == next(m for m in c["volumeMounts"] if m["mountPath"] == path)["name"]
    )["persistentVolumeClaim"]["claimName"]
    assert one("PersistentVolumeClaim", claim("/cache"))
    # uploaded files on a volume every replica mounts (--files-dir), their metadata in PostgreSQL from a Secret
    files = one("PersistentVolumeClaim", claim("/state"))
    assert files["spec"]["accessModes"] == ["ReadWriteMany"]
    assert parsed.files_dir.startswith("/state/")
    store = next(e for e in c["env"] if e["name"] == "DEEPINFER_SERVER_STATE_STORE")
    assert store["valueFrom"]["secretKeyRef"]["name"] == "deepinfer-server-state"
    # startup: as long as the server's own --startup-timeout; readiness is /health; liveness is not (a draining
    # replica answers 503 there and must not be killed for it)
    sp, rp, lp = c["startupProbe"], c["readinessProbe"], c["livenessProbe"]
    assert sp["httpGet"]["path"] == rp["httpGet"]["path"] == "/health"
    assert sp["periodSeconds"] * sp["failureThreshold"] >= parsed.startup_timeout
    assert lp["httpGet"]["path"] != "/health"
    port = next(p for p in c["ports"] if p["name"] == "http")
    assert port["containerPort"] == parsed.port
    # the grace period covers the preStop wait, the drain and the ranks' shutdown
    pre = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pre + parsed.drain_timeout + parsed.rank_shutdown_timeout


def test_the_pool_selects_the_server_pods_and_names_its_endpoint_picker() -> None:
    labels = one("Deployment", "deepinfer-server")["spec"]["template"]["metadata"]["labels"]
    pool = one("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        p["containerPort"] for p in server_container()["ports"]
    ]
    ref = pool["spec"]["endpointPickerRef"]
    epp_svc = one("Service", ref["name"])
    assert ref["port"]["number"] in [p["port"] for p in epp_svc["spec"]["ports"]]
    epp = one("Deployment", ref["name"])
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    epp_args = epp["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(epp_args, "--pool-name") == pool["metadata"]["name"]
    assert flag(epp_args, "--pool-group") == pool["apiVersion"].split("/")[0]
    sa = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = one("RoleBinding", sa)
    assert binding["subjects"][0]["name"] == one("ServiceAccount", sa)["metadata"]["name"]
    rules = one("Role", binding["roleRef"]["name"])["rules"]
    assert any("pods" in r["resources"] for r in rules) and any("inferencepools" in r["resources"] for r in rules)
    # its config names the metrics it scrapes on the pool's pods: /metrics, vLLM's names (no engine-type label)
    config = yaml.safe_load(one("ConfigMap", ref["name"])["data"][flag(epp_args, "--config-file").rsplit("/", 1)[1]])
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics"
    assert not any(k.endswith("engine-type") for k in labels)
    # the grace period of the picker is at least the pool's pods' (the chart's rule)
    assert (
        epp["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        >= one("Deployment", "deepinfer-server")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    )
    route = one("HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )


def test_the_pod_monitor_scrapes_the_server_pods() -> None:
    pm = one("PodMonitor")
    labels = one("Deployment", "deepinfer-server")["spec"]["template"]["metadata"]["labels"]
    assert pm["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ep = pm["spec"]["podMetricsEndpoints"][0]
    assert ep["path"] == "/metrics" and ep["port"] in [p["name"] for p in server_container()["ports"]]
    svc = one("Service", "deepinfer-server")
    assert svc["spec"]["selector"].items() <= labels.items()
