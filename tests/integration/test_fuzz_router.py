"""Fuzz kaon-router in front of a real `kaon serve`, from the engine's own OpenAPI document.

The router speaks the engine's API and passes its answers through, so the engine's document is
the router's contract too. schemathesis sends schema-valid and schema-violating requests for
every operation the router serves (POST /v1/*, GET /v1/models, /health, /ready, /metrics; not
the engine's /tokenize and /detokenize, which the router does not route, nor the LoRA adapter
loading routes, which name no `model` and act on one pod) to the router, which
reads them (admission, key, `model`, the rewrite of a qualified name) and forwards them to the
engine. What it covers that the engine's own run (test_fuzz.py) does not: the router's parsing
and refusals, its relaying of every kind of engine answer (JSON, SSE, errors) and its own
endpoints, checked against the same document.

- No 5xx, except the router's documented answers when no engine can take the request (502
  upstream_unreachable/upstream_failed, 503 no_ready_replica/queue_full/router_overloaded,
  504 upstream_timeout), each in OpenAI's error shape; the engine stays up throughout, so
  these should not happen at all, and the run counts them.
- Every other response matches the document (status code, content type, body schema).
- No hang: each request has a timeout well above a two-token generation on a busy CPU.

The InferenceService is protected: the router checks the key (its published SHA-256 digest)
before the engine does. Generation is kept short as in test_fuzz.py. About 60 s on the shared
2-vCPU machine, most of it loading the model.
"""
from __future__ import annotations

import hashlib

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from kaon_operator.router.config import RouterConfig  # noqa: E402
from kaon_operator.router.endpoints import EndpointTable  # noqa: E402
from kaon_operator.router.proxy import Router  # noqa: E402
from support.fuzz import CONTEXT, DOCUMENT_CHECKS, engine_schema, shorten  # noqa: E402
from support.router import NS, isvc, pod, serving_in_thread  # noqa: E402
from support.server import API_KEY, Server  # noqa: E402

SERVED = "smollm2"
EXAMPLES_PER_MODE = 80  # across all operations
REQUEST_TIMEOUT_S = 45.0  # no hang: far above a two-token request, below the router's first-byte limit
FIRST_BYTE_TIMEOUT_S = 60.0
ROUTED = r"^/v1/|^/health$|^/ready$|^/metrics$"
PER_POD = r"_lora_adapter$"  # vLLM's adapter loading acts on the one engine it reaches: no `model` to route by
# The router's own 5xx when no engine can take a request (docs/routing.md), the only ones allowed.
UNAVAILABLE = {502: {"upstream_unreachable", "upstream_failed"},
               503: {"no_ready_replica", "queue_full", "router_overloaded", "router_starting"},
               504: {"upstream_timeout"}}

_unavailable: list[str] = []
called_total: list[str] = []  # the 5xx the router gave (allowed ones), for the check after the fuzzing


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("fuzz-router"), "--api-key", API_KEY, "--max-model-len", str(CONTEXT),
                 "--max-num-seqs", "8", "--served-model-name", SERVED)
    yield srv
    srv.stop()


def protected_service() -> dict:
    """The InferenceService of the engine, with spec.auth and the digest of its key published."""
    service = isvc(SERVED)
    service["spec"]["auth"] = {"apiKeySecret": "keys"}
    service["status"] = {"auth": {"apiKeySecret": "keys",
                                  "keyDigests": [hashlib.sha256(API_KEY.encode()).hexdigest()]}}
    return service


@pytest.fixture(scope="module")
def router(engine):
    table = EndpointTable(default_namespace=NS)
    table.apply_service("ADDED", protected_service())
    table.apply_pod("ADDED", pod("engine-0", SERVED, port=engine.port))
    table.synced = True
    router = Router(table, RouterConfig(first_byte_timeout=FIRST_BYTE_TIMEOUT_S))
    with serving_in_thread(router) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(engine):
    return engine_schema(engine.url).include(path_regex=ROUTED).exclude(path_regex=PER_POD)


def qualify(body, i: int) -> None:
    """Every other request names the service as `namespace/name`, which the router rewrites to the
    served name before forwarding (a second JSON encoding of whatever the fuzzer sent)."""
    if isinstance(body, dict) and body.get("model") == SERVED and i % 2:
        body["model"] = f"{NS}/{SERVED}"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_server_errors_and_responses_match_the_document(api_schema, router, mode):
    checks = CHECKS.get_by_names(DOCUMENT_CHECKS)
    called: set[str] = set()

    @settings(max_examples=EXAMPLES_PER_MODE, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],  # shrinking would resend slow requests
              suppress_health_check=list(HealthCheck))
    @given(case=api_schema.as_strategy(mode))
    def fuzz(case):
        shorten(case.body)
        qualify(case.body, len(called_total))
        called_total.append(case.operation.label)
        response = case.call(base_url=router, timeout=REQUEST_TIMEOUT_S)  # a hang raises a timeout
        called.add(case.operation.label)
        context = f"{case.operation.label} -> {response.status_code}: {response.text[:500]}\n{case.as_curl_command()}"
        if response.status_code >= 500:
            code = response.json()["error"]["code"]
            assert code in UNAVAILABLE.get(response.status_code, ()), context
            _unavailable.append(context)
            return
        case.validate_response(response, checks=checks)

    fuzz()
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= called
    if mode == GenerationMode.POSITIVE:  # the GETs take no input, so have no invalid one
        assert len(called) == len(list(api_schema.get_all_operations()))


def test_the_router_and_the_engine_survived_the_fuzzing(engine, router):
    # After the fuzzing (same module, same processes): both answer, a request still goes through,
    # and the engine was never unreachable from the router while it was up.
    assert httpx.get(f"{router}/health").status_code == 200
    assert httpx.get(f"{engine.url}/health").status_code == 200
    ordinary = httpx.post(f"{router}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60,
                          json={"model": f"{NS}/{SERVED}", "prompt": "Hi", "max_tokens": 2})
    assert ordinary.status_code == 200, ordinary.text
    assert engine.metric('kaon_requests_total{finish_reason="length"}') > 1  # the fuzzing's got as far as generating
    assert not _unavailable, "\n\n".join(_unavailable)
