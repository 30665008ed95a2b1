"""Issue 53: a real `kaon serve` of the bundled model sleeps and wakes at both levels (vLLM's routes).

Asleep it gives memory back (its RSS falls by the KV pool at level 1, by the weights too at level 2),
/ready is 503 while /health stays 200, a generating request gets a clear 503; awake again it answers
exactly what it answered before; only the admin key may put it to sleep.
"""
from __future__ import annotations

import httpx
import pytest

from support.server import MODEL, Server, error_body

ADMIN = "the-admin-key"
SERVING = "a-serving-key"
KV_BYTES = 256 << 20  # a pool whose release the RSS shows plainly over the noise of the allocator

pytestmark = pytest.mark.slow


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_sleep_and_wake_at_both_levels(tmp_path):
    server = Server(tmp_path, "--enable-sleep-mode", "--admin-key", ADMIN, "--api-key", SERVING,
                    "--kv-cache-bytes", str(KV_BYTES))
    admin = {"Authorization": f"Bearer {ADMIN}"}
    served = {"Authorization": f"Bearer {SERVING}"}
    try:
        http = httpx.Client(base_url=server.url, timeout=120)

        def answer() -> str:
            reply = http.post("/v1/completions", headers=served,
                              json={"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4,
                                    "temperature": 0})
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]

        before = answer()
        awake_rss = _rss_bytes(server.proc.pid)

        for headers in ({}, served, {"Authorization": "Bearer wrong"}):  # no key, a serving key, a wrong one
            refused = http.post("/sleep", params={"level": 1}, headers=headers)
            assert refused.status_code == 401 and error_body(refused)["code"] == "invalid_api_key"
        assert http.get("/is_sleeping", headers=served).status_code == 401
        assert http.get("/is_sleeping", headers=admin).json() == {"is_sleeping": False}
        bad = http.post("/sleep", params={"level": 3}, headers=admin)
        assert bad.status_code == 400 and "level" in error_body(bad)["message"]

        freed = {}
        for level in (1, 2):
            assert http.post("/sleep", params={"level": level}, headers=admin).status_code == 200
            assert http.get("/is_sleeping", headers=admin).json() == {"is_sleeping": True}
            freed[level] = awake_rss - _rss_bytes(server.proc.pid)
            not_ready = http.get("/ready")
            assert not_ready.status_code == 503 and error_body(not_ready)["code"] == "engine_asleep"
            assert http.get("/health").status_code == 200  # alive: a liveness probe must not restart it
            refused = http.post("/v1/chat/completions", headers=served,
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert error_body(refused)["code"] == "engine_asleep"
            assert http.get("/v1/models", headers=served).status_code == 200  # needs no weights, as in vLLM
            again = http.post("/sleep", params={"level": 3 - level}, headers=admin)
            assert again.status_code == 400 and error_body(again)["code"] == "already_asleep"
            assert http.post("/wake_up", headers=admin).status_code == 200
            assert http.get("/is_sleeping", headers=admin).json() == {"is_sleeping": False}
            assert http.get("/ready").status_code == 200
            assert answer() == before, f"the answer changed after a sleep at level {level}"

        # Level 1 frees the pool; level 2 the weights too (SmolLM2-135M in float32: 0.5 GB).
        assert freed[1] > 0.8 * KV_BYTES, freed
        assert freed[2] > freed[1] + (300 << 20), freed
        assert http.post("/wake_up", headers=admin).status_code == 200  # awake already: nothing to do
    finally:
        server.stop()
