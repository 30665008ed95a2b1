"""The InferenceService CRD: generated from api.py, and enforced by a real kube-apiserver."""
from __future__ import annotations

import types
import typing
from datetime import datetime

import pydantic
import pytest

from kaon_operator import api, api_status, crd as crd_module
from support.crd_cases import INVALID, with_


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
    if annotation in (api.Quantity, int | str):  # a field's annotation comes without Annotated's metadata
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
    _check_model(api_status.InferenceServiceStatus, root["status"], "status")


def _cel_messages(node: dict) -> list[str]:
    found = [v["message"] for v in node.get("x-kubernetes-validations", [])]
    for child in [*node.get("properties", {}).values(), node.get("items"), node.get("additionalProperties")]:
        if isinstance(child, dict):
            found += _cel_messages(child)
    return found


# Against the apiserver ------------------------------------------------------------------------------------------


def test_every_cel_rule_has_a_refusal_case():
    messages = _cel_messages(spec_schema())
    assert messages
    for message in messages:
        assert any(message in expected for _, _, expected in INVALID), f"no test case for CEL rule {message!r}"


@pytest.mark.parametrize("spec", [case[1] for case in INVALID], ids=[case[0] for case in INVALID])
def test_pydantic_refuses_what_the_apiserver_refuses(spec):
    with pytest.raises(pydantic.ValidationError):
        api.InferenceServiceSpec.model_validate(spec)


def test_any_tensor_parallel_size_up_to_64_is_accepted():
    for tp in (1, 3, 6, 64):  # the engine's own check decides whether the model's heads split
        assert api.InferenceServiceSpec.model_validate(with_("engine.tensorParallelSize", tp))


