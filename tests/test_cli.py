"""`kaon generate` end to end, as a user runs it."""
from __future__ import annotations

import subprocess
import sys


def kaon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kaon_runtime.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_an_answer():
    result = kaon("generate", "--prompt", "What is the capital of France?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert ">>> What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "tokens/s" in result.stdout


def test_bad_model_is_a_clear_error_not_a_traceback():
    result = kaon("generate", "--model", "builtin://nope", "--max-tokens", "4")
    assert result.returncode == 2
    assert "unknown builtin model 'nope'" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_sampling_flag_is_a_clear_error():
    result = kaon("generate", "--temperature", "-1")
    assert result.returncode == 2
    assert "temperature must be >= 0" in result.stderr and "Traceback" not in result.stderr
