"""What the schemathesis runs (tests/integration/test_fuzz*.py) share: short generations, the checks
against the document, and the schema loaded from a live server.

schemathesis's own pytest plugin does not run under pytest 9.2 (it sets a private attribute
pytest dropped), so the cases come from its Python API, one hypothesis test per mode.
"""
from __future__ import annotations

from schemathesis.checks import load_all_checks
from schemathesis.config import SchemathesisConfig
from schemathesis.openapi import from_url

from support.server import API_KEY

CONTEXT = 256  # the fuzzed engine's --max-model-len
MAX_TOKENS = 2
MAX_N = 2  # n=128 is valid, and costs seconds a request on a small CPU
DOCUMENT_CHECKS = ("response_schema_conformance", "status_code_conformance", "content_type_conformance")


def engine_schema(engine_url: str):
    """The engine's OpenAPI document, every request carrying the engine's key."""
    load_all_checks()
    config = SchemathesisConfig.from_dict({"headers": {"Authorization": f"Bearer {API_KEY}"}})
    return from_url(f"{engine_url}/openapi.json", config=config, headers={"Authorization": f"Bearer {API_KEY}"})


def shorten(body) -> None:
    """Clamp what a valid request would generate; leave invalid values for the server to refuse."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if type(body.get(key)) is int and MAX_TOKENS < body[key] < CONTEXT:
            body[key] = MAX_TOKENS
    # Absent or null: up to the context length otherwise.
    if "input" in body:  # /v1/responses
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = MAX_TOKENS
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    if type(body.get("n")) is int and MAX_N < body["n"] <= 128:
        body["n"] = MAX_N
