"""`kaon profile` (issue 40) as the profiling Job runs it: a real `kaon serve` of the bundled model,
measured on a small grid, written within a termination message's 4 KiB as the operator's
PerfModel reads it; and its failures: one line, a non-zero exit, no traceback."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kaon_operator.autoscaling.perf_model import PerfModel

MODEL = "builtin://smollm2-135m-instruct"
RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


def profile(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    path = f"{RUNTIME}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    environment = {**os.environ, **(env or {}), "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "kaon_runtime.cli", "profile", *args], capture_output=True,
                          text=True, env=environment, timeout=300)


def test_kaon_profile_writes_the_operators_model_within_a_termination_message(tmp_path):
    out = tmp_path / "termination-log"
    # The grid from the environment, as the Job gets it from spec.engine.env.
    done = profile("--out", str(out), "--max-bytes", "4096", "--", "--model", MODEL, "--max-num-seqs", "8",
                   env={"KAON_PROFILE_ARGS": "--batch-sizes 1,2 --context-lengths 0,64 --prompt-lengths 32,128 "
                                             "--decode-tokens 6 --repeats 2"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(out.read_bytes()) <= 4096
    model = PerfModel.from_json(out.read_text())
    # The slopes' sizes are timings (a loaded machine can make a 32-token prefill slower than a
    # 128-token one): the fit of known grids is tests/unit/operator/autoscaling/test_profiling.py's.
    assert model.a > 0 and min(model.b, model.c, model.d) >= 0 and model.cold_start_seconds > 0
    assert {(p.batch, p.prefill_tokens > 0) for p in model.grid} == {(1, False), (2, False), (0, True)}
    assert len(model.grid) == 6 and model.max_num_seqs == 8 and model.key["model"] == MODEL
    assert model.kv_cache_tokens and model.kv_cache_tokens % 16 == 0  # the engine's blocks x block size


def test_kaon_profile_fails_in_one_line():
    assert profile().returncode == 2  # no `kaon serve` arguments
    done = profile("--", "--model", "/nonexistent/model.gguf")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("kaon profile: error: kaon serve exited with ")
    assert "Traceback" not in done.stderr.split("kaon profile: error")[-1]
