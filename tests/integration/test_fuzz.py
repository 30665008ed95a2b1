"""Fuzz a real `kaon serve` from its own OpenAPI document with schemathesis.

Every operation gets schema-valid requests, and those with a body schema-violating ones too.
None may get a 5xx. The documented ones are 503 while draining (never, here) and 503 once the
engine loop is dead, which no request, however malformed, may cause; 429 only comes from a
full queue, which sequential requests never fill. Responses must also match the document
(error bodies, SSE events, status codes, content types). Generation is kept short: lengths are
clamped to a couple of tokens before each request is sent, and the context is small
(support/fuzz.py, shared with the same run against the router, test_fuzz_router.py).
"""
from __future__ import annotations

import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import CHECKS  # noqa: E402

from support.fuzz import CONTEXT, DOCUMENT_CHECKS, engine_schema, shorten  # noqa: E402
from support.server import API_KEY, MODEL, Server  # noqa: E402

EXAMPLES_PER_MODE = 100  # across all operations

_fuzzed: list[str] = []  # operations called, for the check that follows the fuzzing
# The operations whose document schemathesis finds no invalid body for (/v1/embeddings' input is
# any of four shapes): the negative mode sends them nothing, and only them.
NO_INVALID_INPUT = {"POST /v1/embeddings"}


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("fuzz"), "--api-key", API_KEY, "--max-model-len", str(CONTEXT),
                 "--max-num-seqs", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    return engine_schema(fuzzed_server.url)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
def test_no_server_errors_and_responses_match_the_document(api_schema, mode):
    # Each operation gets its share of the examples: drawn across all of them, one of a dozen
    # could go uncalled. The GETs take no input, so have no invalid one.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    if mode == GenerationMode.NEGATIVE:
        operations = [op for op in operations if not op.label.startswith("GET ")]
    sent: set[str] = set()  # this mode's, not the module's: a mode that sent nothing must fail
    for operation in operations:
        sent |= _fuzz(operation, mode, examples=max(4, EXAMPLES_PER_MODE // len(operations)))
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= sent, f"{mode} sent only to {sorted(sent)}"
    unsent = {op.label for op in operations} - sent
    # schemathesis finds no invalid body for some documents (NO_INVALID_INPUT); every other operation
    # must have been sent something in each mode.
    assert unsent <= (NO_INVALID_INPUT if mode == GenerationMode.NEGATIVE else set()), f"{mode}: none sent to {unsent}"


def _fuzz(operation, mode: GenerationMode, examples: int) -> set[str]:
    """The operations that got at least one case (this one's label, or nothing)."""
    checks = CHECKS.get_by_names(DOCUMENT_CHECKS)
    sent: set[str] = set()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate],  # shrinking would resend slow requests
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(mode))
    def fuzz(case):
        shorten(case.body)
        response = case.call(timeout=60)
        _fuzzed.append(case.operation.label)
        sent.add(case.operation.label)
        assert response.status_code < 500, (
            f"{case.operation.label} -> {response.status_code}: {response.text[:500]}\n"
            f"{case.as_curl_command()}")
        case.validate_response(response, checks=checks)

    try:
        fuzz()
    except Unsatisfiable:
        if mode == GenerationMode.POSITIVE or operation.label not in NO_INVALID_INPUT:
            raise
        # nothing to send here (see NO_INVALID_INPUT); the positive run still fuzzes it
    return sent


# ---- what fuzzing found ------------------------------------------------------------------------


def test_seeds_and_top_k_beyond_64_bits_are_400_not_a_dead_engine(fuzzed_server):
    # They used to pass validation and overflow torch in the engine thread, which killed the
    # engine loop: that request and every later one got a 503.
    url, headers = f"{fuzzed_server.url}/v1/completions", {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 1.0, "n": 2}
    for name, value in [("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("top_k", 1 << 63)]:
        response = httpx.post(url, json={**body, name: value}, headers=headers)
        assert response.status_code == 400 and response.json()["error"]["param"] == name
    for name, value in [("seed", (1 << 63) - 1), ("seed", -(1 << 63)), ("top_k", (1 << 63) - 1)]:
        assert httpx.post(url, json={**body, name: value}, headers=headers).status_code == 200
    assert httpx.get(f"{fuzzed_server.url}/health").status_code == 200


def test_a_client_leaving_mid_body_is_not_a_server_error(fuzzed_server):
    # Starlette raises ClientDisconnect from the body stream; it used to reach the catch-all
    # handler as a 500 with a traceback in the log.
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", fuzzed_server.port)) as sock:
        sock.sendall(head.encode() + b'{"model": ')
        time.sleep(0.3)  # let the server start reading the body
    time.sleep(0.5)
    assert httpx.get(f"{fuzzed_server.url}/health").status_code == 200
    assert "Traceback" not in fuzzed_server.log.read_text()


def test_the_engine_survived_the_fuzzing(fuzzed_server):
    # Runs after the fuzzing (same module, so the same server): it is alive, and requests got
    # as far as generating, so the fuzzing exercised more than the validation.
    if not _fuzzed:
        pytest.skip("the fuzzing did not run")
    assert httpx.get(f"{fuzzed_server.url}/health").status_code == 200
    assert fuzzed_server.metric('kaon_requests_total{finish_reason="length"}') > 0
