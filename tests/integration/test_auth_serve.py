"""A real `kaon serve` reads its API keys from a file and sees them rotate without a restart.

One server for the module (an engine start is ~5 CPU s), keyed both ways: `--api-key` (FIXED) and
`--api-key-file` (a Secret volume). Each test that needs certain file keys rotates them in first and
waits until they are taken (`Keyed.rotate`), so the tests hold in any order."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from support.secret_volume import secret_volume
from support.server import MODEL, Server, error_body

FIXED = "the-key"


@dataclass
class Keyed:
    server: Server
    volume: Path
    generations: itertools.count = field(default_factory=lambda: itertools.count(2))

    def accepts(self, key: str) -> bool:
        reply = httpx.get(f"{self.server.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)
        return reply.status_code == 200

    def rotate(self, keys: dict[str, str]) -> None:
        """The kubelet's swap to `keys`; back once the server accepts every one of them (it looks again
        at most RECHECK_S after its last look: a deadline only fails an engine that never looks again)."""
        secret_volume(self.volume, keys, str(next(self.generations)))
        deadline = time.monotonic() + 60
        while not all(self.accepts(k) for k in keys.values()) and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-serve")
    volume = root / "secret"
    volume.mkdir()
    secret_volume(volume, {"a": "key-one"}, "1")
    server = Server(root, "--api-key", FIXED, "--api-key-file", str(volume))
    yield Keyed(server, volume)
    server.stop()


def test_kaon_serve_api_key_file_rotates_without_restart(keyed):
    server, volume = keyed.server, keyed.volume
    keyed.rotate({"a": "key-one"})
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
    assert not keyed.accepts("key-two")
    secret_volume(volume, {"b": "key-two"}, str(next(keyed.generations)))
    pid = server.proc.pid
    # The engine looks again at most RECHECK_S after its last look; poll for the switch
    # (an event, not a timing: the assertion is on which key is accepted).
    deadline = time.monotonic() + 60  # ~RECHECK_S here; a deadline only fails an engine that never looks again
    while post("key-two").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert post("key-two").status_code == 200 and post("key-one").status_code == 401
    assert server.proc.pid == pid and server.proc.poll() is None


def test_the_openapi_document_needs_the_key_when_one_is_set(keyed):
    """Issue 48 (low): it failed before: /openapi.json answered 200 to anyone on a keyed server."""
    server = keyed.server
    for headers in ({}, {"Authorization": "Bearer nope"}):
        refused = httpx.get(f"{server.url}/openapi.json", headers=headers, timeout=30)
        assert refused.status_code == 401 and error_body(refused)["code"] == "invalid_api_key"
    document = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {FIXED}"}, timeout=30)
    assert document.status_code == 200 and "/v1/chat/completions" in document.json()["paths"]
    assert "/openapi.json" not in document.json()["paths"]


def test_one_key_cannot_probe_anothers_cached_prefix(keyed):
    """Issue 48 (low): it failed before: the prefix cache was shared across keys, so a tenant could
    tell by timing (here: by the hit counter) that another had just sent a prompt. With several keys
    each key's requests are salted apart; a request's own cache_salt (vLLM's) divides its key's cache
    further (the attacker's copy of the victim's salt was a hit while the salt replaced the key's)."""
    server = keyed.server
    keyed.rotate({"a": "tenant-a", "b": "tenant-b"})
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
