"""The InferenceService CRD: generated from api.py, and enforced by a real kube-apiserver."""
from __future__ import annotations

import copy
import json
import types
import typing
from datetime import datetime

import pydantic
import pytest
import yaml

from kaon_operator import api, crd as crd_module

MINIMAL = {"model": {"uri": "builtin://smollm2-135m-instruct"}}


def manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}


def with_(path: str, value, base: dict = MINIMAL) -> dict:
    """A copy of `base` with the dotted `path` set to `value` (None deletes it)."""
    spec = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


def spec_schema() -> dict:
    return crd_module.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


# The file and the models --------------------------------------------------------------------------------------


def test_crd_file_is_generated_from_the_models():
    assert crd_module.CRD_PATH.read_text() == crd_module.render(), \
        "crds/inferenceservice.yaml is stale: run `python -m kaon_operator.crd`"
    assert crd_module.main(["--check"]) == 0


_NO_DEFAULT = object()
_OPENAPI_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", datetime: "string"}


def _check_field(annotation, default, node: dict, where: str) -> None:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:  # Optional[X]
        return _check_field(args[0], default, node, where)
    if annotation == api.Quantity:
        assert node.get("x-kubernetes-int-or-string"), where
    elif origin is typing.Literal:
        assert node["type"] == "string" and node["enum"] == list(typing.get_args(annotation)), where
    elif isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        _check_model(annotation, node, where)
    elif origin is list:
        assert node["type"] == "array", where
        _check_field(args[0], _NO_DEFAULT, node["items"], f"{where}[]")
    elif origin is dict:
        assert node["type"] == "object", where
        value = args[1]
        if value is typing.Any:
            assert node.get("x-kubernetes-preserve-unknown-fields"), where
        else:
            _check_field(value, _NO_DEFAULT, node["additionalProperties"], f"{where}{{}}")
    elif annotation is typing.Any:
        assert node.get("x-kubernetes-preserve-unknown-fields"), where
    else:
        assert node["type"] == _OPENAPI_TYPES[annotation], where
    if default not in (_NO_DEFAULT, None) and "default" in node:
        expected = (default.model_dump(by_alias=True, exclude_none=True) if isinstance(default, pydantic.BaseModel)
                    else default)
        assert node["default"] == expected, where


def _check_model(model: type[pydantic.BaseModel], node: dict, where: str) -> None:
    fields = {(f.alias or name): f for name, f in model.model_fields.items()}
    assert node["type"] == "object"
    assert set(node["properties"]) == set(fields), where
    required = {alias for alias, f in fields.items() if f.is_required()}
    assert set(node.get("required", [])) == required, where
    for alias, field in fields.items():
        default = field.get_default(call_default_factory=True)
        if field.is_required():
            default = _NO_DEFAULT
        sub = node["properties"][alias]
        _check_field(field.annotation, default, sub, f"{where}.{alias}")
        if where.startswith("spec") and default not in (_NO_DEFAULT, None):
            assert "default" in sub, f"{where}.{alias} has a pydantic default but none in the CRD"


def test_every_field_type_enum_and_default_matches_the_models():
    root = crd_module.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    _check_model(api.InferenceServiceSpec, root["spec"], "spec")
    _check_model(api.InferenceServiceStatus, root["status"], "status")


def _cel_messages(node: dict) -> list[str]:
    found = [v["message"] for v in node.get("x-kubernetes-validations", [])]
    for child in [*node.get("properties", {}).values(), node.get("items"), node.get("additionalProperties")]:
        if isinstance(child, dict):
            found += _cel_messages(child)
    return found


# Against the apiserver ------------------------------------------------------------------------------------------

INVALID = [
    ("min-gt-max", with_("autoscaling", {"minReplicas": 5, "maxReplicas": 2}), "minReplicas must be <= maxReplicas"),
    ("tp-128", with_("engine.tensorParallelSize", 128), "should be less than or equal to 64"),
    ("quant-int3", with_("model.quantization", "int3"), 'Unsupported value: "int3"'),
    ("negative-replicas", with_("replicas", -1), "should be greater than or equal to 0"),
    ("missing-model", {"replicas": 1}, "spec.model: Required value"),
    ("relative-uri", with_("model.uri", "models/x.gguf"),
     "must be hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>, pvc://<claim>/<path>, builtin://<name> or "
     "an absolute path"),
    ("gs-uri", with_("model.uri", "gs://bucket/llama"), "must be hf://<org>/<name>[@<revision>], s3://"),
    ("hf-without-name", with_("model.uri", "hf://meta-llama"),
     "an hf:// URI must be hf://<org>/<name> or hf://<org>/<name>@<revision>"),
    ("s3-bad-bucket", with_("model.uri", "s3://My_Bucket/llama"),
     "an s3:// URI must be s3://<bucket>/<prefix> with a valid bucket name (3-63 of a-z, 0-9, '.', '-')"),
    ("pvc-bad-claim", with_("model.uri", "pvc://Models_1/llama"),
     "a pvc:// URI must be pvc://<claim>/<path> with a valid PersistentVolumeClaim name"),
    ("pvc-dotdot", with_("model.uri", "pvc://models/../../etc"), "must not contain '..' path segments"),
    ("revision-on-a-path", with_("model", {"uri": "/models/x", "revision": "v1"}),
     "revision is for hf:// URIs that do not name one with @<revision>"),
    ("revision-twice", with_("model", {"uri": "hf://org/name@v1", "revision": "v2"}),
     "revision is for hf:// URIs that do not name one with @<revision>"),
    ("secret-on-pvc", with_("model", {"uri": "pvc://models/llama", "credentialsSecret": "creds"}),
     "credentialsSecret is for hf:// and s3:// sources"),
    ("endpoint-on-a-path", with_("model", {"uri": "/models/x", "endpoint": "http://minio:9000"}),
     "endpoint is for hf:// and s3:// sources"),
    ("gguf-on-builtin", with_("model.ggufFile", "x.gguf"),
     "ggufFile is for hf:// and s3:// sources (point a path or pvc:// URI at the file itself)"),
    ("inline-token", with_("model", {"uri": "hf://org/name", "token": "hf_xxx"}),
     'unknown field "spec.model.token"'),
    ("reserved-volume", with_("engine.volumes", [{"name": "cache", "emptyDir": {}}]),
     "volume names cache, tmp, dshm, model are the operator's own"),
    ("reserved-mount", with_("engine.volumeMounts", [{"name": "certs", "mountPath": "/var/cache/kaon"}]),
     "mount paths /var/cache/kaon, /tmp, /dev/shm, /mnt/models are the operator's own"),
    ("gpu-in-resources", with_("resources", {"limits": {"nvidia.com/gpu": 2}}),
     "nvidia.com/gpu comes from engine.tensorParallelSize; do not set it here"),
    ("zero-without-idle", with_("autoscaling", {"minReplicas": 0}), "minReplicas 0 needs scaleToZeroIdleSeconds"),
    ("idle-without-zero", with_("autoscaling", {"scaleToZeroIdleSeconds": 60}),
     "scaleToZeroIdleSeconds needs minReplicas 0"),
    ("kv-fraction-0", with_("engine.kvCacheFraction", 0), "should be greater than 0"),
    ("latency-metric", with_("autoscaling.latencyMetric", "p50"), 'Unsupported value: "p50"'),
    ("unknown-field", with_("engine.tensorParalelSize", 2), 'unknown field "spec.engine.tensorParalelSize"'),
]


def test_every_cel_rule_has_a_refusal_case():
    messages = _cel_messages(spec_schema())
    assert messages
    for message in messages:
        assert any(message in expected for _, _, expected in INVALID), f"no test case for CEL rule {message!r}"


@pytest.mark.parametrize("spec", [case[1] for case in INVALID], ids=[case[0] for case in INVALID])
def test_pydantic_refuses_what_the_apiserver_refuses(spec):
    with pytest.raises(pydantic.ValidationError):
        api.InferenceServiceSpec.model_validate(spec)


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


VALID_SOURCES = ["hf://meta-llama/Llama-3.1-8B-Instruct", "hf://Qwen/Qwen2.5-0.5B@refs/pr/1", "s3://models/llama/3.1-8b",
                 "s3://my.bucket", "pvc://models/llama-3.1-8b", "pvc://models", "builtin://smollm2-135m-instruct",
                 "/models/llama.gguf"]


def test_every_model_source_is_accepted_by_pydantic_and_the_apiserver(crd, namespace):
    for i, uri in enumerate(VALID_SOURCES):
        spec = with_("model.uri", uri)
        api.InferenceServiceSpec.model_validate(spec)
        crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest(f"src-{i}", spec)))


def test_any_tensor_parallel_size_up_to_64_is_accepted():
    for tp in (1, 3, 6, 64):  # the engine's own check decides whether the model's heads split
        assert api.InferenceServiceSpec.model_validate(with_("engine.tensorParallelSize", tp))


def test_a_full_spec_round_trips(crd, namespace):
    spec = {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B", "revision": "0e9e39f", "ggufFile": "llama-q4.gguf",
                  "credentialsSecret": "hf-token", "endpoint": "https://hub.example.com",
                  "cache": {"persistentVolumeClaim": "model-cache", "sizeLimit": "200Gi"},
                  "servedName": "llama", "quantization": "fp8", "maxModelLen": 8192},
        "engine": {"tensorParallelSize": 6, "maxNumSeqs": 128, "maxNumBatchedTokens": 8192, "kvCacheFraction": 0.9,
                   "enablePrefixCaching": False, "image": "example.com/kaon:dev", "extraArgs": ["--log-level", "debug"],
                   "env": [{"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                           {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                   "envFrom": [{"configMapRef": {"name": "engine-env"}}],
                   "volumes": [{"name": "certs", "secret": {"secretName": "ca-bundle"}}],
                   "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra", "readOnly": True}],
                   "imagePullSecrets": [{"name": "registry"}], "startupTimeoutSeconds": 3600, "stallTimeoutSeconds": 60},
        "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"memory": "64Gi"}},
        "scheduling": {"nodeSelector": {"gpu": "h100"},
                       "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                       "affinity": {"nodeAffinity": {}}},
        "replicas": 2,
        "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "targetConcurrencyPerReplica": 3,
                        "targetUtilization": 0.8, "targetQueueDepthPerReplica": 2.5,
                        "targetP99LatencySeconds": 1.5, "latencyMetric": "e2e", "scaleUpWindowSeconds": 10,
                        "scaleDownStabilizationSeconds": 120, "maxStep": 4, "scaleToZeroIdleSeconds": 600,
                        "scaleFromZeroTimeoutSeconds": 300},
        "routing": {"strategy": "prefix-affinity", "loadBound": 1.5},
        "rollout": {"strategy": "Replace"},
        "drainSeconds": 120,
    }
    expected = api.InferenceServiceSpec.model_validate(spec).model_dump(by_alias=True, exclude_none=True)
    assert expected == spec
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("full", spec)))
    assert crd.kubectl_json("get", "-n", namespace, "infsvc", "full")["spec"] == spec


def test_status_scale_subresource_and_printer_columns(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("llama", MINIMAL)))
    status = api.InferenceServiceStatus(
        replicas=2, ready_replicas=1, selector="kaon.dev/inferenceservice=llama",
        conditions=[api.Condition(type="Ready", status="False", reason="Progressing", message="1/2 ready")],
        observed_metrics=api.ObservedMetrics(queue_depth=7, p99_latency_seconds=0.42), observed_generation=1)
    crd.kubectl("patch", "-n", namespace, "infsvc", "llama", "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status.model_dump(mode="json", by_alias=True, exclude_none=True)}))

    crd.kubectl("scale", "-n", namespace, "infsvc/llama", "--replicas=3")
    obj = crd.kubectl_json("get", "-n", namespace, "infsvc", "llama")
    assert obj["spec"]["replicas"] == 3
    assert api.InferenceServiceStatus.model_validate(obj["status"]) == status
    scale = crd.kubectl_json("get", "-n", namespace, "infsvc", "llama", "--subresource=scale")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 2, "selector": "kaon.dev/inferenceservice=llama"}

    table = crd.kubectl("get", "-n", namespace, "infsvc").stdout.splitlines()
    assert table[0].split() == ["NAME", "READY", "DESIRED", "MODEL", "QUEUE", "P99", "AGE"]
    assert table[1].split()[:6] == ["llama", "1", "3", "builtin://smollm2-135m-instruct", "7", "0.42"]
    wide = crd.kubectl("get", "-n", namespace, "infsvc", "-o", "wide").stdout.splitlines()
    assert "STATUS" in wide[0].split() and "Progressing" in wide[1].split()


def test_status_is_validated_too(crd, namespace):
    crd.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(manifest("llama", MINIMAL)))
    res = crd.kubectl("patch", "-n", namespace, "infsvc", "llama", "--subresource=status", "--type=merge",
                      "-p", json.dumps({"status": {"conditions": [{"type": "Happy", "status": "True"}]}}), check=False)
    assert res.returncode != 0 and 'Unsupported value: "Happy"' in res.stderr, res.stderr


def test_short_name_and_category(crd):
    resources = crd.kubectl("api-resources", "--api-group=kaon.dev", "-o", "wide").stdout
    assert "infsvc" in resources and "kaon" in resources
    assert yaml.safe_load(crd_module.CRD_PATH.read_text())["spec"]["names"]["shortNames"] == ["infsvc"]
