"""The InferenceService CRD enforced by a real kube-apiserver: refusals, defaults, round trips, subresources."""
from __future__ import annotations

import json

import yaml

from kaon_operator import api, api_status, crd as crd_module
from support.crd_cases import INVALID, MINIMAL, VALID_QUANTITIES, VALID_SOURCES, manifest, with_


def test_apiserver_refuses_invalid_specs_with_clear_messages(crd, namespace):
    for i, (case, spec, expected) in enumerate(INVALID):
        res = crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest(f"bad-{i}", spec)),
                          check=False)
        assert res.returncode != 0, f"{case}: the apiserver accepted {spec}"
        assert expected in res.stderr, f"{case}: {res.stderr}"


def test_apiserver_refuses_a_name_a_service_cannot_take(crd, namespace):
    res = crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("1llama", MINIMAL)),
                      check=False)
    assert res.returncode != 0 and "metadata.name must be a DNS-1035 label" in res.stderr, res.stderr


def test_apiserver_fills_in_the_same_defaults_as_pydantic(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("minimal", MINIMAL)))
    stored = crd.kubectl_json("get", "-n", namespace, "infsvc", "minimal")["spec"]
    expected = api.InferenceServiceSpec.model_validate(MINIMAL).model_dump(by_alias=True, exclude_none=True)
    assert stored == expected
    assert stored["engine"]["tensorParallelSize"] == 1 and stored["replicas"] == 1


def test_every_model_source_is_accepted_by_pydantic_and_the_apiserver(crd, namespace):
    for i, uri in enumerate(VALID_SOURCES):
        spec = with_("model.uri", uri)
        api.InferenceServiceSpec.model_validate(spec)
        crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest(f"src-{i}", spec)))


def test_quantities_are_checked_by_both_and_the_refusal_names_the_field(crd, namespace):
    spec = with_("resources", {"requests": {f"example.com/r{i}": q for i, q in enumerate(VALID_QUANTITIES)}})
    spec = with_("model.cache", {"sizeLimit": "1.5Gi"}, spec)
    api.InferenceServiceSpec.model_validate(spec)
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("quantities", spec)))
    res = crd.kubectl("create", "-n", namespace, "-f", "-", check=False,
                      input=json.dumps(manifest("typo", with_("resources", {"limits": {"memory": "16GB"}}))))
    assert res.returncode != 0 and "spec.resources.limits[memory]" in res.stderr, res.stderr


def test_a_full_spec_round_trips(crd, namespace):
    spec = {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "0e9e39f", "ggufFile": "llama-q4.gguf",
                  "credentialsSecret": "hf-token", "endpoint": "https://hub.example.com",
                  "cache": {"persistentVolumeClaim": "model-cache", "sizeLimit": "200Gi", "node": False},
                  "servedName": "llama", "quantization": "fp8", "maxModelLen": 8192},
        "engine": {"tensorParallelSize": 6, "maxNumSeqs": 128, "maxNumBatchedTokens": 8192, "kvCacheFraction": 0.9,
                   "enablePrefixCaching": False, "image": "example.com/kaon:dev", "extraArgs": ["--log-level", "debug"],
                   "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                   "envFrom": [{"configMapRef": {"name": "engine-env"}}],
                   "volumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}}],
                   "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
                   "imagePullSecrets": [{"name": "registry"}], "startupTimeoutSeconds": 3600,
                   "stallTimeoutSeconds": 60, "task": "generate", "maxLoras": 8, "maxLoraRank": 32,
                   "nodesPerReplica": 2, "pipelineParallelSize": 2},
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
        "scheduling": {"nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {}}},
        "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "targetConcurrencyPerReplica": 3,
                        "targetUtilization": 0.8, "targetQueueDepthPerReplica": 2.5,
                        "targetP99LatencySeconds": 1.5, "latencyMetric": "e2e", "scaleUpWindowSeconds": 10,
                        "scaleDownStabilizationSeconds": 120, "maxStep": 4, "scaleToZeroIdleSeconds": 600,
                        "scaleFromZeroTimeoutSeconds": 300, "policy": "predictive", "profile": "llama-profile",
                        "standby": 1},
        "routing": {"strategy": "prefix-affinity", "loadBound": 1.5},
        "adapters": [{"name": "sql", "uri": "s3://adapters/sql"}, {"name": "chat", "uri": "pvc://loras/chat"}],
        "rollout": {"strategy": "Replace"},
        "drainSeconds": 120,
    }
    expected = api.InferenceServiceSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True)
    assert expected == spec
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("full", spec)))
    assert crd.kubectl_json("get", "-n", namespace, "infsvc", "full")["spec"] == spec


def test_status_scale_subresource_and_printer_columns(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("llama", MINIMAL)))
    status = api_status.InferenceServiceStatus(
        replicas=2, ready_replicas=1, selector="kaon.dev/inferenceservice=llama",
        conditions=[api_status.Condition(type="Ready", status="False", reason="Progressing", message="1/2 ready")],
        observed_metrics=api_status.ObservedMetrics(queue_depth=7, p99_latency_seconds=0.42), observed_generation=1)
    crd.kubectl("patch", "-n", namespace, "infsvc", "llama", "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}))

    crd.kubectl("scale", "-n", namespace, "infsvc/llama", "--replicas=3")
    obj = crd.kubectl_json("get", "-n", namespace, "infsvc", "llama")
    assert obj["spec"]["replicas"] == 3
    assert api_status.InferenceServiceStatus.model_validate(obj["status"]) == status
    scale = crd.kubectl_json("get", "-n", namespace, "infsvc", "llama", "--subresource=scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 2, "selector": "kaon.dev/inferenceservice=llama"}

    table = crd.kubectl("get", "-n", namespace, "infsvc").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "DESIRED", "STANDBY", "MODEL", "QUEUE", "P99", "AGE"]
    assert table[1].split()[:6] == ["llama", "1", "3", "builtin://smollm2-135m-instruct", "7", "0.42"]
    wide = crd.kubectl("get", "-n", namespace, "infsvc", "-o", "wide").stdout.splitlines()
    assert "STATUS" in wide[0].split() and "Progressing" in wide[1].split()
    assert "PREFILL" in wide[0].split()  # spec.prefill's ready replicas (docs/disaggregation.md)


def test_status_is_validated_too(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("llama", MINIMAL)))
    res = crd.kubectl("patch", "-n", namespace, "infsvc", "llama", "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"conditions": [{"type": "Happy", "status": "True"}]}}), check=False)
    assert res.returncode != 0 and 'Unsupported value: "Happy"' in res.stderr, res.stderr


def test_short_name_and_category(crd):
    resources = crd.kubectl("api-resources", "--api-group=kaon.dev", "-o", "wide").stdout
    assert "infsvc" in resources and "kaon" in resources
    assert yaml.safe_load(crd_module.CRD_PATH.read_text())["spec"]["names"]["shortNames"] == ["infsvc"]
