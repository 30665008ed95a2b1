"""Child manifests rendered from an InferenceService: unit tests, then the real apiserver."""
from __future__ import annotations

import subprocess
import sys

import pytest

from kaon_operator import api
from kaon_operator.children import pod_template, resources as r
from kaon_operator.config import NetworkPolicyConfig

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


@pytest.mark.parametrize("resources, tp, requests", [
    (None, 1, {"cpu": "2", "memory": "8Gi"}),  # nothing given: the defaults, per GPU
    (None, 4, {"cpu": "8", "memory": "32Gi"}),
    ({"requests": {"cpu": "500m"}}, 1, {"cpu": "500m", "memory": "8Gi"}),  # each key overrides its own default
    ({"requests": {"memory": "2Gi", "ephemeral-storage": "1Gi"}}, 2,
     {"cpu": "4", "memory": "2Gi", "ephemeral-storage": "1Gi"}),
    # A limit without a request: Kubernetes requests the limit, so no default may undercut it
    # (a default request above a lower limit would be refused).
    ({"limits": {"memory": "4Gi"}}, 1, {"cpu": "2"}),
    ({"limits": {"cpu": "1", "memory": "1Gi"}}, 1, {}),
])
def test_cpu_and_memory_requests_default_per_gpu_unless_given(resources, tp, requests):
    s = spec(engine={"tensorParallelSize": tp}, **({"resources": resources} if resources else {}))
    res = container(r.render(OWNER, s))["resources"]
    assert res["requests"] == {**requests, "nvidia.com/gpu": str(tp)}
    assert res["limits"] == {**((resources or {}).get("limits") or {}), "nvidia.com/gpu": str(tp)}


def test_probes_liveness_readiness_and_a_long_startup():
    c = container(r.render(OWNER, spec()))
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/health"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # big models load slowly
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]


@pytest.mark.parametrize("drain", [None, 0, 5, 120, 3600])
def test_drain_seconds_reach_the_engine_and_the_grace_period_outlasts_it(drain):
    s = spec(**({"drainSeconds": drain} if drain is not None else {}))
    args = container(r.render(OWNER, s))["args"]
    flag = int(args[args.index("--drain-timeout") + 1])
    assert flag == (pod_template.DRAIN_SECONDS if drain is None else drain) and pod_template.DRAIN_SECONDS == 30
    # The kubelet waits for the drain and for uvicorn's own shutdown before it SIGKILLs.
    assert pod_spec(s)["terminationGracePeriodSeconds"] == flag + pod_template.TERMINATION_GRACE_MARGIN_SECONDS


@pytest.mark.parametrize("drain", [-1, 3601, "30s"])
def test_drain_seconds_out_of_range_are_refused(drain):
    with pytest.raises(ValueError):
        spec(drainSeconds=drain)


@pytest.mark.parametrize("uri, fetch", [("builtin://smollm2-135m-instruct", 0), ("/models/llama", 0),
                                        ("pvc://models/llama", 0),
                                        ("hf://org/name", pod_template.FETCH_ALLOWANCE_SECONDS),
                                        ("s3://bucket/llama", pod_template.FETCH_ALLOWANCE_SECONDS)])
def test_progress_deadline_outlasts_the_startup_budget(uri, fetch):
    s = spec(model={"uri": uri})
    c = container(r.render(OWNER, s))
    startup, readiness = c["startupProbe"], c["readinessProbe"]
    budget = (startup["periodSeconds"] * startup["failureThreshold"]
              + readiness["periodSeconds"] * readiness["failureThreshold"])
    deadline = r.deployment(OWNER, s)["spec"]["progressDeadlineSeconds"]
    # A model that loads in all of the time its probes allow never shows ProgressDeadlineExceeded (the
    # Deployment's default, 600 s, is a third of the 30 minutes), with room for scheduling and the pull,
    # and for the download first when the init container fetches the model.
    assert deadline == budget + pod_template.PROGRESS_MARGIN_SECONDS + fetch
    assert deadline > 30 * 60 + 5 * 60


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
    assert mounts == {pod_template.CACHE_DIR: "cache", "/tmp": "tmp"}
    assert {"name": "TRITON_CACHE_DIR", "value": f"{pod_template.CACHE_DIR}/triton"} in c["env"]
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
                     "enablePrefixCaching": False, "image": "example.com/kaon:dev",
                     "extraArgs": ["--log-level", "debug"]})
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
    # Default Surge: a new pod first, no capacity dip (one replica's spare GPUs needed).
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert spec().rollout.strategy == "Surge"
    # Replace: an old pod goes first and its GPUs take the new one, so a full GPU pool rolls out too.
    d = r.deployment(OWNER, spec(replicas=3, rollout={"strategy": "Replace"}))
    assert d["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    with pytest.raises(ValueError):
        spec(rollout={"strategy": "BlueGreen"})


def test_network_policy_admits_only_the_router_and_the_operator_on_the_engine_port():
    config = NetworkPolicyConfig(release_namespace="kaon-system")
    children = r.render(OWNER, spec(), config)
    assert [c["kind"] for c in children] == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    policy = children[-1]
    assert policy["apiVersion"] == "networking.k8s.io/v1"
    assert policy["metadata"]["labels"] == LABELS and policy["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    # It selects this InferenceService's engine pods, the same ones its Deployment runs.
    assert policy["spec"]["podSelector"]["matchLabels"] == children[0]["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress stays open: hf:// and s3:// downloads
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": r.HTTP_PORT}]
    release = {"matchLabels": {"kubernetes.io/metadata.name": "kaon-system"}}
    assert rule["from"] == [
        {"namespaceSelector": release,
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kaon", "app.kubernetes.io/component": "router"}}},
        {"namespaceSelector": release,
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kaon", "app.kubernetes.io/component": "operator"}}}]
    # Both peers are namespace AND pod selectors (one list entry each), never "any pod in kaon-system".
    assert all({"namespaceSelector", "podSelector"} == set(peer) for peer in rule["from"])

    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    extra = r.render(OWNER, spec(), NetworkPolicyConfig("kaon", extra_from=(prometheus,)))[-1]
    assert extra["spec"]["ingress"][0]["from"][-1] == prometheus
    assert extra["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kaon"}
    assert [c["kind"] for c in r.render(OWNER, spec())] == ["Deployment", "Service", "PodDisruptionBudget"]


def test_operator_never_imports_torch_or_the_runtime():
    code = ("import sys, kaon_operator.api, kaon_operator.crd, kaon_operator.children.resources; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kaon_runtime', 'triton')); "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# Against the apiserver ------------------------------------------------------------------------------------------


# Model sources: the fetch init container, credentials from a Secret, the cache, extra pod settings ----------------


def init_containers(s: api.InferenceServiceSpec) -> list[dict]:
    return pod_spec(s).get("initContainers", [])


def test_hf_source_is_fetched_by_an_init_container_with_the_secrets_token():
    s = spec(model={"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "revision": "v1", "credentialsSecret": "hf",
                    "endpoint": "https://hub.example.com"}, engine={"tensorParallelSize": 2})
    (fetch,) = init_containers(s)
    assert fetch["name"] == "fetch" and fetch["image"] == s.engine.image
    assert fetch["args"] == ["kaon", "fetch", "--model", "hf://meta-llama/Llama-3.1-8B-Instruct",
                             "--model-cache", f"{pod_template.CACHE_DIR}/models", "--revision", "v1",
                             "--tensor-parallel-size", "2", "--termination-log", "/dev/termination-log"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN", "optional": True}}} \
        in fetch["env"]
    assert {"name": "HF_ENDPOINT", "value": "https://hub.example.com"} in fetch["env"]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert fetch["volumeMounts"] == pod_spec(s)["containers"][0]["volumeMounts"]  # same cache, same place
    assert "resources" not in fetch  # no GPU held while downloading beyond the pod's own
    engine = pod_spec(s)["containers"][0]
    flags = dict(zip(engine["args"][2::2], engine["args"][3::2]))
    # The engine finds the fetched model by the same URI in the same cache, and never sees the token.
    assert flags["--model"] == "hf://meta-llama/Llama-3.1-8B-Instruct" and flags["--revision"] == "v1"
    assert flags["--model-cache"] == f"{pod_template.CACHE_DIR}/models"
    assert not any(e["name"] in ("HF_TOKEN", "HF_ENDPOINT") for e in engine["env"])
    assert engine["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_s3_source_takes_keys_region_and_endpoint_from_the_secret():
    s = spec(model={"uri": "s3://models/llama", "credentialsSecret": "s3-creds", "ggufFile": "llama-q4.gguf"})
    (fetch,) = init_containers(s)
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in fetch["env"] if "valueFrom" in e}
    assert refs == {k: {"name": "s3-creds", "key": k, "optional": True}
                    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")}
    assert fetch["args"][2:8] == ["--model", "s3://models/llama", "--model-cache", f"{pod_template.CACHE_DIR}/models",
                                  "--gguf-file", "llama-q4.gguf"]
    with_endpoint = spec(model={"uri": "s3://models/llama", "credentialsSecret": "s3-creds",
                                "endpoint": "http://minio.storage:9000"})
    env = init_containers(with_endpoint)[0]["env"]
    # The spec's endpoint replaces the Secret's key (one entry per name: server-side apply refuses duplicates).
    assert [e for e in env if e["name"] == "AWS_ENDPOINT_URL"] == [
        {"name": "AWS_ENDPOINT_URL", "value": "http://minio.storage:9000"}]
    overridden = spec(model={"uri": "hf://org/name"}, engine={"env": [{"name": "HOME", "value": "/home/kaon"}]})
    for c in (pod_spec(overridden)["containers"][0], init_containers(overridden)[0]):
        names = [e["name"] for e in c["env"]]
        assert len(names) == len(set(names)) and {"name": "HOME", "value": "/home/kaon"} in c["env"]


def test_pvc_source_is_mounted_read_only_and_checked_by_the_init_container():
    s = spec(model={"uri": "pvc://models/llama/3.1-8b"})
    pod = pod_spec(s)
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod["volumes"]
    engine = pod["containers"][0]
    assert {"name": "model", "mountPath": "/mnt/models", "readOnly": True} in engine["volumeMounts"]
    assert engine["args"][engine["args"].index("--model") + 1] == "/mnt/models/llama/3.1-8b"
    (fetch,) = pod["initContainers"]
    assert fetch["args"][2:4] == ["--model", "/mnt/models/llama/3.1-8b"] and "--model-cache" not in fetch["args"]
    assert not any("valueFrom" in e for e in fetch["env"])
    whole = pod_spec(spec(model={"uri": "pvc://models"}))["containers"][0]["args"]
    assert whole[whole.index("--model") + 1] == "/mnt/models"


def test_builtin_and_path_models_need_no_init_container():
    assert init_containers(spec()) == []
    assert init_containers(spec(model={"uri": "/models/llama.gguf"})) == []


def test_model_cache_is_a_sized_empty_dir_or_a_shared_claim():
    (cache,) = [v for v in pod_spec(spec())["volumes"] if v["name"] == "cache"]
    assert cache == {"name": "cache", "emptyDir": {"sizeLimit": "100Gi"}}
    shared = spec(model={"uri": "hf://org/name", "cache": {"persistentVolumeClaim": "model-cache"}})
    (cache,) = [v for v in pod_spec(shared)["volumes"] if v["name"] == "cache"]
    assert cache == {"name": "cache", "persistentVolumeClaim": {"claimName": "model-cache"}}
    sized = spec(model={"uri": "hf://org/name", "cache": {"sizeLimit": "20Gi"}})
    assert {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}} in pod_spec(sized)["volumes"]


def test_env_volumes_and_image_pull_secrets_reach_both_containers():
    s = spec(model={"uri": "hf://org/name"},
             engine={"env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"}],
                     "envFrom": [{"configMapRef": {"name": "engine-env"}}],
                     "volumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}}],
                     "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
                     "imagePullSecrets": [{"name": "registry"}]})
    pod = pod_spec(s)
    assert {"name": "certs", "secret": {"secretName": "ca-bundle"}} in pod["volumes"]
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    for c in (pod["containers"][0], pod["initContainers"][0]):
        assert {"name": "HTTPS_PROXY", "value": "http://proxy:3128"} in c["env"], c["name"]
        assert c["envFrom"] == [{"configMapRef": {"name": "engine-env"}}], c["name"]
        assert {"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True} in c["volumeMounts"], c["name"]
    assert "imagePullSecrets" not in pod_spec(spec()) and "envFrom" not in pod_spec(spec())["containers"][0]


def test_the_docs_own_model_examples_are_valid_and_render():
    """Every InferenceService in docs/models.md validates and renders its fetch or mount."""
    import re

    import yaml

    from kaon_operator.crd import ROOT

    text = (ROOT / "docs" / "models.md").read_text()
    docs = [d for block in re.findall(r"```yaml\n(.*?)```", text, re.S) for d in yaml.safe_load_all(block) if d]
    services = [d for d in docs if d["kind"] == "InferenceService"]
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    assert {s["spec"]["model"]["uri"].split("://")[0] for s in services} == {"hf", "s3", "pvc"}
    for svc in services:
        s = api.InferenceServiceSpec.model_validate(svc["spec"])
        assert s.model.credentials_secret in secrets | {None}
        pod = pod_spec(s)
        assert pod["initContainers"][0]["args"][:2] == ["kaon", "fetch"]
