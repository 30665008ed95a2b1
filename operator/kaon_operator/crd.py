"""Generate the InferenceService CRD from the pydantic models in api.py and api_status.py.

    python -m kaon_operator.crd            # rewrites crds/inferenceservice.yaml and the chart's copy
    python -m kaon_operator.crd --check    # exits 1 if either file is stale

pydantic emits JSON Schema; Kubernetes wants a *structural* OpenAPI v3 schema: no
$ref, no `anyOf` with null (an optional field is simply not required), boolean
`exclusiveMinimum`, `x-kubernetes-*` markers for free-form objects and
int-or-string quantities. `openapi()` does that translation.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel

from kaon_operator import api, api_status

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "inferenceservice.yaml"
# Helm installs what lies in a chart's crds/ and can read nothing outside the chart, so the
# chart carries a copy, written by the same generator (and compared by tests/integration/test_chart.py).
CHART_CRD_PATH = ROOT / "charts" / "kaon" / "crds" / "inferenceservice.yaml"

_KEEP = ("type", "description", "enum", "format", "minimum", "maximum", "minLength", "maxLength",
         "pattern", "minItems", "maxItems", "maxProperties")
_NULL = {"type": "null"}

# Names a Service can take (DNS-1035 label): children are named after the InferenceService.
_NAME_RULE = {"rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$') && size(self.metadata.name) <= 63",
              "message": "metadata.name must be a DNS-1035 label (lowercase letters, digits, '-'; "
                         "starting with a letter; at most 63 characters)"}


def openapi(schema: dict, defs: dict, *, defaults: bool = True) -> dict:
    """Translate one pydantic JSON Schema node into a structural OpenAPI v3 node."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        return openapi({**target, **siblings}, defs, defaults=defaults)
    if "anyOf" in schema:
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        options = [s for s in schema["anyOf"] if s != _NULL]
        if len(options) == 1:  # Optional[X]: optional by not being required
            return openapi({**options[0], **rest}, defs, defaults=defaults)
        if sorted(o.get("type") for o in options) == ["integer", "string"]:
            node = openapi(rest, defs, defaults=defaults)
            return {**node, "x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}]}
        raise ValueError(f"no structural schema for anyOf {schema['anyOf']}")

    node = {k: schema[k] for k in _KEEP if k in schema}
    if "const" in schema:
        node["enum"] = [schema["const"]]
    if "exclusiveMinimum" in schema:
        node["minimum"], node["exclusiveMinimum"] = schema["exclusiveMinimum"], True
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        node["properties"] = {name: openapi(prop, defs, defaults=defaults)
                              for name, prop in schema["properties"].items()}
        if schema.get("required"):
            node["required"] = list(schema["required"])
    elif kind == "object":
        extra = schema.get("additionalProperties", True)
        if extra is True or extra == {}:
            node["x-kubernetes-preserve-unknown-fields"] = True
        else:
            node["additionalProperties"] = openapi(extra, defs, defaults=defaults)
    elif kind == "array":
        node["items"] = openapi(schema["items"], defs, defaults=defaults)
    if defaults and schema.get("default") is not None:
        node["default"] = schema["default"]
    for key in ("x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
                "x-kubernetes-preserve-unknown-fields"):
        if key in schema:
            node[key] = schema[key]
    return node


def _schema_of(model: type[BaseModel], *, defaults: bool) -> dict:
    schema = model.model_json_schema(by_alias=True, ref_template="#/$defs/{model}")
    return openapi(schema, schema.get("$defs", {}), defaults=defaults)


def printer_columns() -> list[dict]:
    return [
        {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas",
         "description": "Engine replicas that are ready"},
        {"name": "Desired", "type": "integer", "jsonPath": ".spec.replicas",
         "description": "Engine replicas wanted"},
        {"name": "Standby", "type": "integer", "jsonPath": ".status.standbyReplicas",
         "description": "Replicas loaded and asleep, woken by a scale-up (spec.autoscaling.standby)"},
        {"name": "Prefill", "type": "integer", "jsonPath": ".status.prefillReadyReplicas",
         "description": "Prefill replicas that are ready (spec.prefill)", "priority": 1},
        {"name": "Model", "type": "string", "jsonPath": ".spec.model.uri"},
        {"name": "Queue", "type": "number", "jsonPath": ".status.observedMetrics.queueDepth",
         "description": "Waiting requests, all replicas"},
        {"name": "P99", "type": "number", "jsonPath": ".status.observedMetrics.p99LatencySeconds",
         "description": "P99 latency in seconds (autoscaling.latencyMetric)"},
        {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason",
         "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def build_crd() -> dict:
    spec = _schema_of(api.InferenceServiceSpec, defaults=True)
    # Status is written by the operator alone; defaults there would only hide its omissions.
    status = _schema_of(api_status.InferenceServiceStatus, defaults=False)
    root = {"type": "object", "required": ["spec"],
            "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                           "metadata": {"type": "object"}, "spec": spec, "status": status},
            "x-kubernetes-validations": [_NAME_RULE]}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.KIND.lower(), "shortNames": ["infsvc"], "categories": ["kaon"]},
            "versions": [{
                "name": api.VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": root},
                "subresources": {"status": {}, "scale": {"specReplicasPath": ".spec.replicas",
                                                         "statusReplicasPath": ".status.replicas",
                                                         "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": printer_columns(),
            }],
        },
    }


def render() -> str:
    header = "# Generated by `python -m kaon_operator.crd` from operator/kaon_operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a file differs from the models")
    parser.add_argument("--output", type=Path, action="append",
                        help="write here instead (repeatable; default: crds/ and the chart's crds/)")
    args = parser.parse_args(argv)
    return write_or_check(render(), args.output or [CRD_PATH, CHART_CRD_PATH], args.check, "kaon_operator.crd")


def write_or_check(text: str, outputs: list[Path], check: bool, module: str) -> int:
    """Write a generated CRD to each path, or (check) exit status 1 naming each path that differs."""
    if check:
        stale = [path for path in outputs if not path.exists() or path.read_text() != text]
        for path in stale:
            print(f"{path} is stale: run python -m {module}", file=sys.stderr)
        return 1 if stale else 0
    for path in outputs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
