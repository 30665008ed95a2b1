"""The Helm chart (charts/kaon), the container images' recipes and the docs' generated CRD reference and metrics list.

helm is the one e2e/build-control-plane.sh builds from Go modules (`make test` builds it with
the control plane). The rendered manifests are checked against the real apiserver's schemas with
`kubectl apply --dry-run=server --validate=strict`, so an unknown or misspelt field fails.
"""
from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from e2e.control_plane import build_binaries
from kaon_operator import crd as crd_module, main as operator_main, reference
from kaon_operator.router.main import build_parser as router_parser

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kaon"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())

# The variants worth rendering: the defaults, everything optional turned on, and peering with
# a single replica.
EVERYTHING = ["operator.replicas=2", "serviceMonitor.enabled=true", "dashboard.enabled=true",
              "router.watchNamespaces={team-a,team-b}", "imagePullSecrets[0].name=registry",
              "operator.nodeSelector.pool=system", "router.service.type=LoadBalancer"]
VARIANTS = {"defaults": [], "everything": EVERYTHING, "peering": ["operator.peering.enabled=true"]}


@pytest.fixture(scope="module")
def helm(tmp_path_factory):
    """Run the cached helm with its caches and config in a temp dir (not the user's)."""
    binary = build_binaries() / "helm"
    home = tmp_path_factory.mktemp("helm")
    env = {"HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"), "HELM_CONFIG_HOME": str(home / "config"),
           "HELM_DATA_HOME": str(home / "data"), "PATH": "/usr/bin:/bin"}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        res = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=120)
        if check and res.returncode:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{res.stderr}")
        return res
    return run


def template(helm, sets: list[str], *, namespace: str = "kaon-system", release: str = "kaon",
             include_crds: bool = False) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace]
    args += [a for s in sets for a in ("--set", s)]
    if include_crds:
        args.append("--include-crds")
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"{len(hits)} {kind} {name or ''}"
    return hits[0]


def container(docs: list[dict], name: str) -> dict:
    return find(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]


# helm itself ------------------------------------------------------------------------------

def test_helm_reports_the_version_it_was_built_from(helm, tmp_path):
    script = (ROOT / "e2e" / "build-control-plane.sh").read_text()
    wanted = re.search(r'HELM_VERSION="\$\{HELM_VERSION:-(v[^}]+)\}"', script).group(1)
    assert helm("version", "--template", "{{.Version}}").stdout == wanted
    # The ldflags also tell helm which Kubernetes its client libraries are from; without them
    # it assumes 1.20 for .Capabilities and lint's deprecation checks.
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    (probe / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (probe / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: probe}\n"
        "data: {kube: '{{ .Capabilities.KubeVersion.Version }}'}\n")
    kube = yaml.safe_load(helm("template", "probe", str(probe)).stdout)["data"]["kube"]
    assert re.fullmatch(r"v1\.(\d+)\.0", kube) and int(kube.split(".")[1]) >= 36, kube


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_is_clean(helm, variant):
    args = ["lint", "--strict", str(CHART)] + [a for s in VARIANTS[variant] for a in ("--set", s)]
    out = helm(*args).stdout
    findings = [line for line in out.splitlines() if line.startswith("[")]
    assert findings == ["[INFO] Chart.yaml: icon is recommended"], out


# what the chart renders --------------------------------------------------------------------

def test_defaults_render_operator_router_and_their_rbac(helm):
    docs = template(helm, [])
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == sorted([
        ("ServiceAccount", "kaon-operator"), ("ClusterRole", "kaon-operator"), ("ClusterRoleBinding", "kaon-operator"),
        ("Role", "kaon-operator"), ("RoleBinding", "kaon-operator"),  # the autoscaler's Lease
        ("Deployment", "kaon-operator"), ("Service", "kaon-operator-metrics"),
        ("ServiceAccount", "kaon-router"), ("ClusterRole", "kaon-router"), ("ClusterRoleBinding", "kaon-router"),
        ("Deployment", "kaon-router"), ("Service", "kaon-router")])
    operator = find(docs, "Deployment", "kaon-operator")
    assert operator["spec"]["replicas"] == 1
    # Standalone: a rolling update would run two active operators for a moment.
    assert operator["spec"]["strategy"] == {"type": "Recreate"}
    c = container(docs, "kaon-operator")
    assert c["command"] == ["kaon-operator"]  # operator/pyproject.toml's script; the image sets no entrypoint
    assert c["args"] == ["--liveness-port=8081", "--metrics-port=9090", "--autoscale-interval=5",
                         "--release-namespace=kaon-system"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "liveness"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"liveness": 8081, "metrics": 9090}
    assert c["image"] == "ghcr.io/kaon-dev/kaon-operator:0.1.0"


def test_both_deployments_run_non_root_read_only_with_resources(helm):
    docs = template(helm, [])
    for name in ("kaon-operator", "kaon-router"):
        pod = find(docs, "Deployment", name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        c = pod["containers"][0]
        assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                        "capabilities": {"drop": ["ALL"]}}
        assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]


def test_router_service_and_probes(helm):
    docs = template(helm, [])
    c = container(docs, "kaon-router")
    assert c["command"] == ["kaon-router"] and c["args"][:2] == ["--host=0.0.0.0", "--port=8080"]
    assert c["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"},
                          {"name": "admin", "containerPort": 8081, "protocol": "TCP"}]
    assert "--admin-port=8081" in c["args"]  # probes answer there even at --max-connections
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "admin"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}
    service = find(docs, "Service", "kaon-router")["spec"]
    assert service["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    assert service["selector"] == find(docs, "Deployment", "kaon-router")["spec"]["selector"]["matchLabels"]


def test_router_flags_in_values_are_the_commands_own_defaults(helm):
    defaults = router_parser().parse_args([])
    router = VALUES["router"]
    assert (router["queueTimeout"], router["maxQueued"], router["backoff"], router["connectTimeout"],
            router["firstByteTimeout"], router["idleTimeout"], router["maxAttempts"], router["maxBodyBytes"],
            router["logLevel"], router["writeTimeout"]) == (
        defaults.queue_timeout, defaults.max_queued, defaults.backoff, defaults.connect_timeout,
        defaults.first_byte_timeout, defaults.idle_timeout, defaults.max_attempts, defaults.max_body_bytes,
        defaults.log_level, defaults.write_timeout)
    assert f"--idle-timeout={router['idleTimeout']}" in container(template(helm, []), "kaon-router")["args"]
    # Helm reads numbers as floats; a large one must not come out as 4.194304e+06.
    args = container(template(helm, []), "kaon-router")["args"]
    assert f"--max-body-bytes={defaults.max_body_bytes}" in args
    router_parser().parse_args(args[1:])


def test_the_operator_finds_the_charts_router_pods(helm):
    from kaon_operator.autoscaling import autoscale_loop  # the labels and port the autoscaler scrapes routers by

    docs = template(helm, [])
    pod = find(docs, "Deployment", "kaon-router")["spec"]["template"]
    selector = dict(term.split("=") for term in autoscale_loop.ROUTER_PODS.split(","))
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert {"name": "http", "containerPort": autoscale_loop.ROUTER_METRICS_PORT, "protocol": "TCP"} in \
        pod["spec"]["containers"][0]["ports"]
    # Scraped on the admin port, where protected services' held requests show too.
    assert autoscale_loop.router_url({**pod, "metadata": {"name": "r", "namespace": "kaon-system", **pod["metadata"]},
                                      "status": {"podIP": "10.0.0.1", "phase": "Running",
                                                 "conditions": [{"type": "Ready", "status": "True"}]}}) \
        == "http://10.0.0.1:8081/metrics"
    # It looks for them in its release namespace, where the chart puts them.
    assert "--release-namespace=kaon-system" in container(docs, "kaon-operator")["args"]


@pytest.mark.parametrize("sets", [["operator.replicas=3"], ["operator.peering.enabled=true"]])
def test_peering_passes_a_name_and_a_priority_per_process_and_creates_the_peering(helm, sets):
    docs = template(helm, sets)
    args = container(docs, "kaon-operator")["args"]
    assert "--peering=kaon-operator" in args and "--priority=random" in args
    assert find(docs, "ClusterKopfPeering")["metadata"]["name"] == "kaon-operator"
    assert "strategy" not in find(docs, "Deployment", "kaon-operator")["spec"]  # peering makes rolling safe


def test_priority_random_draws_distinct_positive_priorities():
    draws = {operator_main.priority("random") for _ in range(100)}
    assert len(draws) == 100 and all(0 < d < 2**31 for d in draws)
    assert operator_main.priority("-5") == -5
    with pytest.raises(Exception, match="not an integer"):
        operator_main.priority("high")


def test_peering_with_watched_namespaces_is_refused(helm):
    res = helm("template", "kaon", str(CHART), "--set", "operator.replicas=2",
               "--set", "operator.watchNamespaces={a}", check=False)
    assert res.returncode != 0 and "namespaced KopfPeering" in res.stderr


def test_watched_namespaces_become_flags(helm):
    docs = template(helm, ["operator.watchNamespaces={a,b}", "router.watchNamespaces={c}"])
    assert [a for a in container(docs, "kaon-operator")["args"] if a.startswith("--namespace")] == \
        ["--namespace=a", "--namespace=b"]
    assert [a for a in container(docs, "kaon-router")["args"] if a.startswith("--namespace")] == ["--namespace=c"]


def test_the_spec_policy_values_become_the_operators_flags(helm):
    assert VALUES["operator"]["allowedImages"] == [] and VALUES["operator"]["allowSecretVolumes"] is False
    args = container(template(helm, []), "kaon-operator")["args"]
    assert not [a for a in args if a.startswith(("--allowed-image", "--allow-secret"))]
    args = container(template(helm, ["operator.allowedImages={ghcr.io/kaon-dev/kaon,registry.example/ml/}",
                                     "operator.allowSecretVolumes=true"]), "kaon-operator")["args"]
    assert [a for a in args if a.startswith("--allowed-image")] == [
        "--allowed-image=ghcr.io/kaon-dev/kaon", "--allowed-image=registry.example/ml/"]
    assert "--allow-secret-volumes" in args


def test_network_policy_is_on_by_default_and_the_switch_reaches_the_operator(helm):
    args = container(template(helm, []), "kaon-operator")["args"]
    assert VALUES["networkPolicy"]["enabled"] is True
    assert not [a for a in args if a.startswith(("--network-policy", "--no-network-policy"))]  # the flag's default: on
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    args = container(template(helm, ["networkPolicy.additionalFrom[0].namespaceSelector.matchLabels"
                                      ".kubernetes\\.io/metadata\\.name=monitoring",
                                      "networkPolicy.additionalFrom[0].podSelector.matchLabels"
                                      ".app\\.kubernetes\\.io/name=prometheus"]), "kaon-operator")["args"]
    (flag,) = [a for a in args if a.startswith("--network-policy-from=")]
    assert operator_main.network_peer(flag.split("=", 1)[1]) == peer
    args = container(template(helm, ["networkPolicy.enabled=false"]), "kaon-operator")["args"]
    assert "--no-network-policy" in args and not [a for a in args if a.startswith("--network-policy-from")]
    with pytest.raises(Exception, match="NetworkPolicyPeer"):
        operator_main.network_peer('{"cidr": "10.0.0.0/8"}')


def test_operator_may_set_block_owner_deletion_and_manage_network_policies(helm):
    rules = _rules(template(helm, []), "kaon-operator")

    def verbs(group: str, resource: str) -> set[str]:
        return {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}
    assert verbs("kaon.dev", "inferenceservices/finalizers") == {"update"}  # OwnerReferencesPermissionEnforcement
    assert verbs("networking.k8s.io", "networkpolicies") == {"get", "list", "watch", "create", "patch", "delete"}


def test_service_monitors_scrape_operator_router_and_every_engine(helm):
    docs = template(helm, ["serviceMonitor.enabled=true", "serviceMonitor.labels.release=prometheus"])
    operator = find(docs, "ServiceMonitor", "kaon-operator")
    assert operator["spec"]["endpoints"][0]["port"] == "metrics"
    assert operator["spec"]["selector"]["matchLabels"] == \
        find(docs, "Service", "kaon-operator-metrics")["spec"]["selector"]
    router = find(docs, "ServiceMonitor", "kaon-router")["spec"]["endpoints"][0]
    assert router["port"] == "http" and router["honorLabels"] is True  # keep the series' own namespace label
    engines = find(docs, "PodMonitor", "kaon-engines")
    assert engines["spec"]["namespaceSelector"] == {"any": True}
    assert engines["spec"]["selector"] == {  # the engine pods and spec.prefill's prefill pods
        "matchLabels": {"app.kubernetes.io/name": "kaon"},
        "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": ["engine", "prefill"]}]}
    assert all(d["metadata"]["labels"]["release"] == "prometheus" for d in (operator, engines))


# one source of truth -----------------------------------------------------------------------

def _rules(docs: list[dict], name: str) -> list[dict]:
    return find(docs, "ClusterRole", name)["rules"]


def test_cluster_role_rules_equal_the_deploy_files(helm):
    docs = template(helm, [])
    for component in ("operator", "router"):
        deployed = list(yaml.safe_load_all((ROOT / "deploy" / f"{component}-rbac.yaml").read_text()))
        assert _rules(docs, f"kaon-{component}") == _rules(deployed, f"kaon-{component}")
    deployed = list(yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text()))
    assert find(docs, "Role", "kaon-operator")["rules"] == find(deployed, "Role", "kaon-operator")["rules"]


def test_chart_crds_equal_the_repositorys(helm):
    assert (CHART / "crds" / "inferenceservice.yaml").read_text() == crd_module.CRD_PATH.read_text()
    assert (CHART / "crds" / "kopf-peering.yaml").read_text() == (ROOT / "crds" / "kopf-peering.yaml").read_text()
    assert crd_module.main(["--check"]) == 0  # both copies are what api.py generates
    names = {d["metadata"]["name"] for d in template(helm, [], include_crds=True)
             if d["kind"] == "CustomResourceDefinition"}
    assert names == {"inferenceservices.kaon.dev", "inferenceroutes.kaon.dev", "clusterkopfpeerings.kopf.dev"}
    assert (CHART / "crds" / "inferenceroute.yaml").read_text() == (ROOT / "crds" / "inferenceroute.yaml").read_text()


def test_docs_crd_reference_is_current():
    assert reference.main(["--check"]) == 0, "run: python -m kaon_operator.reference"


def test_crd_reference_lists_every_field():
    schema = crd_module.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    fields = {row[0] for part in ("spec", "status") for row in reference.rows(schema[part], part)}
    assert {"spec.model.uri", "spec.autoscaling.scaleToZeroIdleSeconds", "spec.routing.strategy",
            "status.conditions[].reason", "status.lastScaleDecision.from", "status.url"} <= fields
    assert all(row[3] for part in ("spec", "status") for row in reference.rows(schema[part], part)), \
        "a field without a description: give it a docstring in api.py"


def _metric_names() -> set[str]:
    """Every metric name the engine, the router and the operator define (counters get _total)."""
    names = set()
    for path in ("runtime/kaon_runtime/server/metrics.py", "operator/kaon_operator/router/metrics.py",
                 "operator/kaon_operator/metrics.py", "operator/kaon_operator/router/route_gateway.py",
                 "runtime/kaon_runtime/server/disagg.py"):
        for kind, name in re.findall(r'(\w+)\(\s*"(kaon_\w+)"', (ROOT / path).read_text()):
            counter = kind in ("Counter", "CounterMetricFamily", "CheapCounter")  # their samples get _total
            names.add(f"{name}_total" if counter and not name.endswith("_total") else name)
    return names


def test_docs_metrics_reference_names_every_metric():
    documented = set(re.findall(r"`(kaon_\w+)", (ROOT / "docs" / "metrics.md").read_text()))
    assert _metric_names() <= documented, sorted(_metric_names() - documented)


def test_dashboard_plots_the_five_signals_from_metrics_that_exist(helm):
    cm = find(template(helm, ["dashboard.enabled=true"]), "ConfigMap", "kaon-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["kaon.json"])
    exprs = {p["title"]: p["targets"][0]["expr"] for p in dashboard["panels"]}
    for title, metric in {"Queue depth": "kaon_num_requests_waiting",
                          "P99 time to first token": "kaon_time_to_first_token_seconds_bucket",
                          "Ready replicas": "kaon_router_ready_endpoints",
                          "Generated tokens/s": "kaon_generation_tokens_total",
                          "KV cache usage": "kaon_kv_cache_usage_ratio"}.items():
        assert metric in exprs[title]
    known = _metric_names()
    for expr in exprs.values():
        for name in re.findall(r"kaon_\w+", expr):
            assert re.sub(r"_(bucket|sum|count)$", "", name) in known, name


# valid against the Kubernetes schemas ------------------------------------------------------

# Not the prometheus-operator's CRDs (they are not vendored here): the subset of their schema
# that the chart uses, with the same field names and types. Strict field validation then
# refuses any field outside it, so a misspelt field fails as it would on a real cluster.
_STR, _BOOL = {"type": "string"}, {"type": "boolean"}
_SELECTOR = {"type": "object", "properties": {"matchLabels": {"type": "object", "additionalProperties": _STR},
                                              "matchExpressions": {"type": "array", "items": {"type": "object",
                                                  "properties": {"key": _STR, "operator": _STR,
                                                                 "values": {"type": "array", "items": _STR}}}}}}
_INTERVAL = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?"
                                          r"(([0-9]+)s)?(([0-9]+)ms)?)$"}
_RELABEL = {"type": "array", "items": {"type": "object", "properties": {
    "sourceLabels": {"type": "array", "items": _STR}, "targetLabel": _STR, "action": _STR, "regex": _STR,
    "replacement": _STR}}}
_ENDPOINT = {"type": "object", "properties": {"port": _STR, "path": _STR, "interval": _INTERVAL,
                                              "honorLabels": _BOOL, "relabelings": _RELABEL}}
_NAMESPACES = {"type": "object", "properties": {"any": _BOOL, "matchNames": {"type": "array", "items": _STR}}}


def _monitoring_crd(kind: str, endpoints: str) -> dict:
    plural = kind.lower() + "s"
    spec = {"type": "object", "required": ["selector"], "properties": {
        "selector": _SELECTOR, "namespaceSelector": _NAMESPACES, endpoints: {"type": "array", "items": _ENDPOINT}}}
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.monitoring.coreos.com"},
            "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "properties": {"spec": spec}}}}]}}


@pytest.fixture(scope="module")
def monitoring_crds(crd):
    crds = {"apiVersion": "v1", "kind": "List", "items": [_monitoring_crd("ServiceMonitor", "endpoints"),
                                                          _monitoring_crd("PodMonitor", "podMetricsEndpoints")]}
    crd.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crds))
    for plural in ("servicemonitors", "podmonitors"):
        crd.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{plural}.monitoring.coreos.com")
    return crd


@pytest.mark.parametrize("variant", VARIANTS)
def test_rendered_chart_is_valid_on_the_apiserver(helm, monitoring_crds, namespace, variant):
    # A release name of its own, so nothing collides with the RBAC other tests apply for real.
    docs = template(helm, VARIANTS[variant], namespace=namespace, release=f"kaon-{variant}", include_crds=True)
    for served in ("team-a", "team-b"):  # router.watchNamespaces: the router's Roles live there
        monitoring_crds.kubectl("create", "namespace", served, check=False)
    res = monitoring_crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
                                  check=False)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("(server dry run)") == len(docs), res.stdout


def test_the_validation_catches_a_misspelt_field(helm, monitoring_crds, namespace):
    docs = template(helm, ["serviceMonitor.enabled=true"], namespace=namespace, release="kaon-typo")
    find(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    find(docs, "Deployment", "kaon-typo-router")["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    res = monitoring_crds.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                                  input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}),
                                  check=False)
    assert res.returncode != 0
    assert "intervall" in res.stderr and "readynessProbe" in res.stderr


def test_notes_say_how_to_serve_a_model_and_call_it(helm, crd):
    # helm renders NOTES.txt only when installing; a server dry run creates nothing.
    # --take-ownership: the operator tests, when they run first, leave the operator's ServiceAccount
    # in kaon-system, and helm would refuse to adopt it even in a dry run.
    notes = helm("install", "kaon", str(CHART), "--namespace", "kaon-system", "--dry-run=server", "--take-ownership",
                 "--set", "operator.replicas=2", "--kubeconfig", str(crd.kubeconfig)).stdout
    notes = notes[notes.index("NOTES:"):]
    for line in ("kubectl apply -f examples/smollm2.yaml", "kubectl get infsvc smollm2 -w",
                 "kubectl -n kaon-system port-forward svc/kaon-router 8080:80",
                 "curl http://127.0.0.1:8080/v1/chat/completions", "http://kaon-router.kaon-system.svc/v1",
                 "kopf peering kaon-operator"):
        assert line in notes, notes


# the images ------------------------------------------------------------------------------

# Libraries only the engine uses; the operator image has none of them. (tokenizers and jinja2 it has: the
# router's kv-aware strategy tokenizes a prompt as the engine will, router/kv_tokens.py.)
ENGINE_ONLY = ("torch", "triton", "numpy", "gguf", "safetensors", "tqdm", "fastapi", "uvicorn", "transformers")


def test_operator_and_router_run_without_the_engines_libraries():
    blocker = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {ENGINE_ONLY!r}:
            raise ImportError("the operator image has no " + name)
sys.meta_path.insert(0, Block())
import kaon_operator.handlers, kaon_operator.router.main, kaon_operator.router.watch, kaon_operator.crd
from kaon_operator.main import main
main(["--help"])
"""
    res = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "usage: kaon-operator" in res.stdout, res.stderr


def _third_party_imports(package: Path) -> set[str]:
    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and not n.startswith("kaon_")}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist: str) -> set[str]:
    reqs = importlib.metadata.requires(dist) or []
    return {_normalize(re.match(r"[A-Za-z0-9_.-]+", r).group()) for r in reqs if "extra ==" not in r}


def _dependencies(pyproject: Path) -> dict[str, str]:
    """name -> requirement (spaces removed) of a pyproject.toml's [project] dependencies."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return {_normalize(re.match(r"[A-Za-z0-9_.-]+", d).group()): d.replace(" ", "") for d in deps}


def test_the_operator_image_installs_what_kaon_operator_imports_and_nothing_of_the_engine():
    own = _dependencies(ROOT / "operator" / "pyproject.toml")
    project = _dependencies(ROOT / "pyproject.toml")
    for name, spec in own.items():  # the same version bounds as the repository's pyproject.toml
        assert project[name] == spec, (project[name], spec)
    installed = set(own) | {dep for dist in own for dep in _requires(dist)}
    by_module = importlib.metadata.packages_distributions()
    for module in _third_party_imports(ROOT / "operator" / "kaon_operator"):
        assert any(_normalize(d) in installed for d in by_module[module]), f"{module} is not in operator/pyproject.toml"
    assert not set(own) & {_normalize(m) for m in ENGINE_ONLY}
    scripts = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {k: v for k, v
                       in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].items()
                       if k in ("kaon-operator", "kaon-router")}


def test_the_operator_image_builds_from_operator_alone():
    """`docker build operator/`: every COPY source lies inside that directory (a COPY --from= copies an earlier
    stage's files: the compiled router's cache)."""
    dockerfile = (ROOT / "operator" / "Dockerfile").read_text()
    sources = [line.split()[1:-1] for line in dockerfile.splitlines()
               if line.startswith(("COPY", "ADD")) and not line.startswith("COPY --from=")]
    assert sources, "the image copies kaon_operator, kaon_wire and its pyproject.toml"
    for source in (s for group in sources for s in group):
        resolved = (ROOT / "operator" / source).resolve()
        assert resolved.is_relative_to(ROOT / "operator") and resolved.exists(), source
    assert {s for group in sources for s in group} == {"pyproject.toml", "kaon_operator", "kaon_wire"}


def test_images_run_as_the_users_pods_expect():
    from kaon_operator.children import pod_template, resources

    runtime = (ROOT / "runtime" / "Dockerfile").read_text()
    assert f"USER {pod_template.RUN_AS}:{pod_template.RUN_AS}" in runtime
    assert "ENTRYPOINT []" in runtime  # engine pods pass the whole command line ("kaon", "serve", ...) as args
    assert "EXPOSE 8000" in runtime and resources.HTTP_PORT == 8000
    operator = (ROOT / "operator" / "Dockerfile").read_text()
    uid = VALUES["podSecurityContext"]["runAsUser"]
    assert f"USER {uid}:{uid}" in operator and "ENTRYPOINT" not in operator  # the chart sets the command


def test_the_chart_can_deploy_valkey_for_the_route_cache(helm):
    assert not [d for d in template(helm, []) if d["metadata"]["name"] == "kaon-valkey"]
    docs = template(helm, ["valkey.enabled=true"])
    deployment = find(docs, "Deployment", "kaon-valkey")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][-2:] == ["--maxmemory-policy", "allkeys-lru"]
    assert find(docs, "Service", "kaon-valkey")["spec"]["ports"][0]["port"] == 6379
