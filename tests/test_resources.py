"""Child manifests rendered from an InferenceService: unit tests, then the real apiserver."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kaon_operator import api, resources as r

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000001")
LABELS = {"app.kubernetes.io/name": "kaon", "app.kubernetes.io/instance": "llama",
          "app.kubernetes.io/component": "engine", "kaon.dev/inferenceservice": "llama"}


def spec(**overrides) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"}, **overrides})


def container(manifests: list[dict]) -> dict:
    (c,) = manifests[0]["spec"]["template"]["spec"]["containers"]
    return c


def pod_spec(s: api.InferenceServiceSpec) -> dict:
    return r.deployment(OWNER, s)["spec"]["template"]["spec"]


def test_every_child_has_the_labels_and_an_owner_reference():
    children = r.render(OWNER, spec())
    assert [c["kind"] for c in children] == ["Deployment", "Service", "PodDisruptionBudget"]
    for child in children:
        meta = child["metadata"]
        assert meta["name"] == "llama" and meta["namespace"] == "serving"
        assert meta["labels"] == LABELS
        assert meta["ownerReferences"] == [{"apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceService",
                                            "name": "llama", "uid": OWNER.uid, "controller": True,
                                            "blockOwnerDeletion": True}]
    deploy = children[0]
    assert deploy["spec"]["template"]["metadata"]["labels"] == LABELS
    selected = deploy["spec"]["selector"]["matchLabels"]
    assert selected.items() <= LABELS.items()
    assert children[1]["spec"]["selector"] == selected == children[2]["spec"]["selector"]["matchLabels"]
    assert r.selector("llama") == "kaon.dev/inferenceservice=llama,app.kubernetes.io/component=engine"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_gpus_requested_equal_tensor_parallel_size(tp):
    res = container(r.render(OWNER, spec(engine={"tensorParallelSize": tp})))["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == str(tp)


def test_cpu_and_memory_pass_through_beside_the_gpus():
    s = spec(resources={"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
             engine={"tensorParallelSize": 2})
    res = container(r.render(OWNER, s))["resources"]
    assert res == {"requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
                   "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"}}


def test_probes_liveness_readiness_and_a_long_startup():
    c = container(r.render(OWNER, spec()))
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # big models load slowly
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


def test_termination_grace_outlasts_the_engine_drain():
    s = spec()
    args = container(r.render(OWNER, s))["args"]
    drain = int(args[args.index("--drain-timeout") + 1])
    assert pod_spec(s)["terminationGracePeriodSeconds"] > drain


def test_shared_memory_only_for_tensor_parallel():
    assert "dshm" not in {v["name"] for v in pod_spec(spec())["volumes"]}
    pod = pod_spec(spec(engine={"tensorParallelSize": 4}))
    (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_model_cache_volume_and_writable_tmp_under_a_read_only_root():
    pod = pod_spec(spec())
    c = pod["containers"][0]
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert mounts == {r.CACHE_DIR: "cache", "/tmp": "tmp"}
    assert {"name": "TRITON_CACHE_DIR", "value": f"{r.CACHE_DIR}/triton"} in c["env"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


def test_non_root_and_locked_down():
    pod = pod_spec(spec())
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    sc = pod["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
    assert pod["automountServiceAccountToken"] is False


def test_engine_command_line_follows_the_spec():
    s = spec(model={"uri": "/models/llama", "servedName": "llama-8b", "quantization": "int4", "maxModelLen": 4096},
             engine={"tensorParallelSize": 2, "maxNumSeqs": 32, "maxNumBatchedTokens": 2048, "kvCacheFraction": 0.5,
                     "enablePrefixCaching": False, "image": "example.com/kaon:dev", "extraArgs": ["--log-level", "debug"]})
    c = container(r.render(OWNER, s))
    assert c["image"] == "example.com/kaon:dev"
    args = c["args"]
    assert args[:2] == ["kaon", "serve"]
    flags = dict(zip(args[2::2], args[3::2]))
    assert flags["--model"] == "/models/llama" and flags["--served-model-name"] == "llama-8b"
    assert flags["--tensor-parallel-size"] == "2" and flags["--max-num-seqs"] == "32"
    assert flags["--max-num-batched-tokens"] == "2048" and flags["--kv-cache-fraction"] == "0.5"
    assert flags["--quantization"] == "int4" and flags["--max-model-len"] == "4096"
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "8000"
    assert "--no-enable-prefix-caching" in args and args[-2:] == ["--log-level", "debug"]

    defaults = container(r.render(OWNER, spec()))["args"]
    assert defaults[defaults.index("--served-model-name") + 1] == "llama"  # the InferenceService's name
    assert "--quantization" not in defaults and "--max-model-len" not in defaults
    assert "--no-enable-prefix-caching" not in defaults


def test_scheduling_passes_through():
    toleration = {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]}}}
    pod = pod_spec(spec(scheduling={"nodeSelector": {"gpu": "h100"}, "tolerations": [toleration],
                                    "affinity": affinity}))
    assert pod["nodeSelector"] == {"gpu": "h100"} and pod["affinity"] == affinity
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                                  toleration]
    assert "nodeSelector" not in pod_spec(spec()) and "affinity" not in pod_spec(spec())


@pytest.mark.parametrize("replicas,autoscaling,expected", [
    (1, None, 0),  # a single replica can still be drained
    (3, None, 2),
    (0, None, 0),
    (5, {"enabled": True, "minReplicas": 2, "maxReplicas": 8}, 2),
    (2, {"enabled": True, "minReplicas": 2, "maxReplicas": 8}, 1),  # at the floor: one eviction at a time
    (1, {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "scaleToZeroIdleSeconds": 60}, 0),
])
def test_pdb_is_tied_to_the_minimum_replicas(replicas, autoscaling, expected):
    s = spec(replicas=replicas, **({"autoscaling": autoscaling} if autoscaling else {}))
    assert r.pod_disruption_budget(OWNER, s)["spec"]["minAvailable"] == expected


def test_deployment_replicas_and_rollout():
    d = r.deployment(OWNER, spec(replicas=3))
    assert d["spec"]["replicas"] == 3
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_operator_never_imports_torch_or_the_runtime():
    code = ("import sys, kaon_operator.api, kaon_operator.crd, kaon_operator.resources; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kaon_runtime', 'triton')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# Against the apiserver ------------------------------------------------------------------------------------------

VARIANTS = [
    {},
    {"engine": {"tensorParallelSize": 8, "enablePrefixCaching": False, "extraArgs": ["--log-level", "debug"]},
     "model": {"uri": "/models/llama", "quantization": "fp8", "maxModelLen": 8192, "servedName": "llama"},
     "resources": {"requests": {"cpu": "500m", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
     "scheduling": {"nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                           "labelSelector": {"matchLabels": LABELS}}}]}}},
     "replicas": 4,
     "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "scaleToZeroIdleSeconds": 300}},
]


def create_isvc(cp, namespace: str, name: str, spec_dict: dict) -> r.Owner:
    body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}, **spec_dict}}
    obj = json.loads(cp.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(body)).stdout)
    return r.Owner(name=name, namespace=namespace, uid=obj["metadata"]["uid"])


def apply(cp, manifests: list[dict], *extra: str) -> None:
    cp.kubectl("apply", "--server-side", "--field-manager=kaon-operator", *extra, "-f", "-",
               input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))


def test_rendered_manifests_are_accepted_by_the_apiserver(crd, namespace):
    for i, variant in enumerate(VARIANTS):
        owner = create_isvc(crd, namespace, f"v{i}", variant)
        s = api.InferenceServiceSpec.model_validate(
            crd.kubectl_json("get", "-n", namespace, "infsvc", owner.name)["spec"])
        apply(crd, r.render(owner, s), "--dry-run=server")


def test_applied_children_run_on_fake_gpu_nodes_and_are_garbage_collected(crd, namespace):
    owner = create_isvc(crd, namespace, "llama", {"engine": {"tensorParallelSize": 4}, "replicas": 2})
    s = api.InferenceServiceSpec.model_validate(crd.kubectl_json("get", "-n", namespace, "infsvc", "llama")["spec"])
    apply(crd, r.render(owner, s))
    apply(crd, r.render(owner, s))  # idempotent: a second apply by the same manager changes nothing
    crd.kubectl("rollout", "status", "-n", namespace, "deployment/llama", "--timeout=60s")

    pods = crd.kubectl_json("get", "pods", "-n", namespace, "-l", r.selector("llama"))["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["status"]["phase"] == "Running" and pod["status"]["podIP"].startswith("127.1.")
        assert pod["spec"]["nodeName"].startswith("gpu-node-")

    crd.kubectl("delete", "-n", namespace, "infsvc", "llama")
    for kind in ("deployment", "service", "poddisruptionbudget"):
        crd.kubectl("wait", "-n", namespace, "--for=delete", f"{kind}/llama", "--timeout=60s")
