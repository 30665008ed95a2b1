"""Issue 48 item 4: 2,048 embeddings of 4,096 dimensions are normalized and serialized off the
event loop. The app runs under a real uvicorn on a real socket, on the stand-in engine of
test_pipeline.py, with the engine's part (embeddings.embed) replaced by finished vectors: what is
left is exactly the server's work on them, while /health is polled."""
from __future__ import annotations

import random
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.server import embeddings
from kaon_runtime.server.app import ServerSettings, create_app
from tests.unit.runtime.server.test_pipeline import MODEL, StubEngine

pytestmark = pytest.mark.slow  # a 2,048 x 4,096 reply through a real uvicorn (make unit leaves it out)

INPUTS, DIMS = 2048, 4096


def test_a_maximal_embeddings_reply_does_not_hold_health(monkeypatch):
    """It failed before: /health waited seconds behind the normalization and JSON of the reply."""
    rng = random.Random(0)
    vectors = [[rng.uniform(-1, 1) for _ in range(DIMS)] for _ in range(INPUTS)]

    async def finished(engine, metrics, prompts, pooling, truncate=None):
        return [RequestOutput(f"e{i}", None, [1], embedding=v) for i, v in enumerate(vectors)]

    monkeypatch.setattr(embeddings, "embed", finished)
    stub = StubEngine()
    stub.model_config = type(stub.model_config)(vocab_size=256, hidden_size=DIMS)
    app = create_app(AsyncEngine(stub), ServerSettings(model_name=MODEL, task="embed", max_body_bytes=1 << 20))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        while not server.started:
            time.sleep(0.05)
        worst, done = 0.0, threading.Event()
        reply: list[httpx.Response] = []

        def attack():
            reply.append(httpx.post(f"{url}/v1/embeddings", timeout=120,
                                    json={"model": MODEL, "input": ["hi"] * INPUTS}))
            done.set()

        began = time.monotonic()
        threading.Thread(target=attack, daemon=True).start()
        with httpx.Client(timeout=60) as http:
            while not done.wait(0.05):
                start = time.monotonic()
                assert http.get(f"{url}/health").status_code == 200
                worst = max(worst, time.monotonic() - start)
        total = time.monotonic() - began
        assert reply[0].status_code == 200 and len(reply[0].json()["data"]) == INPUTS
        # Held on the loop, /health waited out the whole reply (5.5 of ~6 s here). Off it, no wait is
        # more than a fraction of the reply's time: relative, so a busy CI machine (everything slower,
        # the client's read of ~80 MB in this same process too) cannot fail it, while the bug still does.
        assert worst < max(1.0, total / 3), (worst, total)
    finally:
        server.should_exit = True
        thread.join(10)
