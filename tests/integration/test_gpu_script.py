"""bench/gpu/run.sh, the one command a GPU lease runs, proven end to end on the CPU (--dry-run) before a lease.

The packages the GPU machine's image lacks and run.sh does not carry (bench/gpu/requirements.txt)
are made unimportable here, so a stage that would fail there on a missing import fails here too.

Opt-in (KAON_GPU_DRY_RUN=1): the nested run of every stage took 140 s of a 2-core machine, the
second slowest test of the suite, for a script that matters only before a GPU lease; run it then,
and after changing bench/gpu/:
    KAON_GPU_DRY_RUN=1 .venv/bin/python -m pytest -q tests/integration/test_gpu_script.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Absent from the GPU image (the device tool's KINDS.md lists what it has) and not carried.
# (schemathesis, absent too, is a pytest plugin here: blocking it would stop pytest itself, not a stage.)
ABSENT = ["xgrammar", "kopf", "kubernetes", "minio", "cryptography", "openai", "langchain_openai",
          "compressed_tensors", "llama_cpp", "llguidance", "outlines_core", "e2e"]
STAGE_FILES = ["run.log", "kernels.xml", "engine-tests.xml", "engine.json", "gemv.json", "roofline.json",
               "throughput.json", "throughput-profile.txt"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("KAON_GPU_DRY_RUN") != "1",
                    reason="opt-in, before a GPU lease: KAON_GPU_DRY_RUN=1 (140 s of the suite's time)")
def test_the_gpu_script_runs_every_stage_on_the_cpu(tmp_path):
    blocked = tmp_path / "absent"
    for name in ABSENT:
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} is not on the GPU machine')\n")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "PYTHONPATH": str(blocked)}
    run = subprocess.run(["bash", "bench/gpu/run.sh", "all", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # The device tool brings back at most 8 files: the stages write exactly these.
    assert sorted(p.name for p in out.iterdir()) == sorted(STAGE_FILES)
    for tests in ("kernels.xml", "engine-tests.xml"):
        suite = ET.parse(out / tests).getroot().find("testsuite")
        assert suite is not None and int(suite.get("tests")) > 0
        assert suite.get("failures") == "0" and suite.get("errors") == "0"
    engine = json.loads((out / "engine.json").read_text())
    assert engine["errors"] == {}
    assert set(engine["checks"]) == {"families", "cuda_graphs", "kv_sizing", "process_group", "invariance",
                                     "invariance_cost"}
    assert set(engine["seconds"]) == set(engine["checks"])
    # On the CPU the fused C step computes each row alone: the dense model's answers cannot move (the
    # GPU switch, KAON_GPU_BATCH_INVARIANT, changes nothing on the torch backend).
    for name in ("llama-bfloat16", "llama-float32", "llama-bfloat16-invariant", "llama-float32-invariant"):
        row = engine["checks"]["invariance"][name]
        assert row["batched_equal"] == row["chunked_cached_equal"] == row["of"] == 4, row
    assert all(engine["checks"]["families"][f]["float32"]["identical"] == 4 for f in ("llama", "qwen3", "mixtral"))
    cost = engine["checks"]["invariance_cost"]
    assert all(cost[f"switch_{s}_batch_{b}_tok_s"] > 0 for s in (0, 1) for b in (1, 4)), cost
    roofline = json.loads((out / "roofline.json").read_text())
    assert [r["quantization"] for r in roofline["rows"]] == ["none", "int4", "int4:before", "int8", "int8:before",
                                                              "fp8", "fp8:before"]
    assert all("error" not in r and r["decode_tok_s"] > 0 for r in roofline["rows"])
    assert json.loads((out / "throughput.json").read_text())["kaon_output_tok_s"] > 0
    assert "under the profiler" in (out / "throughput-profile.txt").read_text()
    gemv = json.loads((out / "gemv.json").read_text())["shapes"]["tiny"]["rows"]
    assert all(row["rel_error"] < 1e-3 for key, row in gemv.items() if key.startswith("int")), gemv
    assert any(" gemv " in key for key in gemv)
    # The batch-invariant GEMMs' bench (bench/gpu/invariant_gemm.py, in the gemv stage): each format checked against
    # its reference, and no row prefix moved (a row's place in a tile, the shifted window, the interpreter cannot show)
    invariant = json.loads((out / "gemv.json").read_text())["invariant_gemm"]["shapes"]["tiny"]
    assert all("error" not in kind for times in invariant["times"].values() for kind in times.values()
               if isinstance(kind, dict)), invariant["times"]
    assert all(counts["prefix 1"] == counts["prefix 8"] == 0 for counts in
               (kinds["invariant"] for kinds in invariant["moved"].values())), invariant["moved"]
