"""Issue 48 (low): a 500 tells the client nothing of the exception (its repr can hold paths, keys,
prompts); the log has it. The app on test_pipeline.py's stand-in engine, whose queue fails."""
from __future__ import annotations

import logging

from fastapi.testclient import TestClient

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.server.app import ServerSettings, create_app
from tests.unit.runtime.server.test_pipeline import MODEL, StubEngine

SECRET = "/srv/secrets/hf_token=hf_abcdef"


class Failing(StubEngine):
    def validate(self, prompt, params):
        raise RuntimeError(f"cannot open {SECRET}")


def test_a_500_answers_a_generic_message_and_logs_the_detail(caplog):
    """It failed before: the body was `internal error: RuntimeError('cannot open /srv/secrets/...')`."""
    app = create_app(AsyncEngine(Failing()), ServerSettings(model_name=MODEL))
    with TestClient(app, raise_server_exceptions=False) as http, caplog.at_level(logging.ERROR, "kaon.server"):
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and SECRET not in response.text and "RuntimeError" not in response.text
    assert any(SECRET in (r.exc_text or "") or SECRET in str(r.exc_info) for r in caplog.records)
