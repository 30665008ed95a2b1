"""A real `kaon serve` reads its API keys from a file and sees them rotate without a restart."""
from __future__ import annotations

import time

import httpx

from support.secret_volume import secret_volume
from support.server import MODEL, Server, error_body


def test_kaon_serve_api_key_file_rotates_without_restart(tmp_path):

    volume = tmp_path / "secret"
    volume.mkdir()
    secret_volume(volume, {"a": "key-one"}, "1")
    server = Server(tmp_path, "--api-key-file", str(volume))
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}

        def post(key: str | None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)

        assert post("key-one").status_code == 200
        missing, wrong = post(None), post("nope")
        for refused in (missing, wrong):
            assert refused.status_code == 401 and error_body(refused)["code"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes stay open
        assert httpx.get(f"{server.url}/metrics").status_code == 200
        secret_volume(volume, {"b": "key-two"}, "2")
        pid = server.proc.pid
        # The engine looks again at most RECHECK_S after its last look; poll for the switch
        # (an event, not a timing: the assertion is on which key is accepted).
        deadline = time.monotonic() + 60  # ~RECHECK_S here; a deadline only fails an engine that never looks again
        while post("key-two").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert post("key-two").status_code == 200 and post("key-one").status_code == 401
        assert server.proc.pid == pid and server.proc.poll() is None
    finally:
        server.stop()


def test_the_openapi_document_needs_the_key_when_one_is_set(tmp_path):
    """Issue 48 (low): it failed before: /openapi.json answered 200 to anyone on a keyed server."""
    server = Server(tmp_path, "--api-key", "the-key")
    try:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            refused = httpx.get(f"{server.url}/openapi.json", headers=headers, timeout=30)
            assert refused.status_code == 401 and error_body(refused)["code"] == "invalid_api_key"
        document = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": "Bearer the-key"}, timeout=30)
        assert document.status_code == 200 and "/v1/chat/completions" in document.json()["paths"]
        assert "/openapi.json" not in document.json()["paths"]
    finally:
        server.stop()


def test_one_key_cannot_probe_anothers_cached_prefix(tmp_path):
    """Issue 48 (low): it failed before: the prefix cache was shared across keys, so a tenant could
    tell by timing (here: by the hit counter) that another had just sent a prompt. With several keys
    each key's requests are salted apart; a request's own cache_salt (vLLM's) divides its key's cache
    further (the attacker's copy of the victim's salt was a hit while the salt replaced the key's)."""
    volume = tmp_path / "secret"
    volume.mkdir()
    secret_volume(volume, {"a": "tenant-a", "b": "tenant-b"}, "1")
    server = Server(tmp_path, "--api-key-file", str(volume))
    try:
        prompt = "The victim's confidential memo, paragraph one, reads as follows: " * 12

        def hits_after(key: str, **extra) -> float:
            before = server.metric("kaon_prefix_cache_hits_total")
            reply = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                               json={"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra})
            assert reply.status_code == 200, reply.text
            return server.metric("kaon_prefix_cache_hits_total") - before

        hits_after("tenant-a")  # the victim's prompt, now cached under a's salt
        assert hits_after("tenant-b") == 0  # the attacker's probe finds nothing
        assert hits_after("tenant-a") > 0  # the victim's own next request still hits
        assert hits_after("tenant-a", cache_salt="another") == 0
        # a salt names a cache within its key only: the attacker sending the victim's salt finds nothing
        assert hits_after("tenant-a", cache_salt="another") > 0
        assert hits_after("tenant-b", cache_salt="another") == 0
    finally:
        server.stop()
