"""`kaon serve`'s running batch: without --max-num-seqs a CPU engine runs the measured CPU default (8,
engine/admission.py), not the GPU's 64; the flag always wins, and `kaon profile` records what the server runs."""
from __future__ import annotations

from kaon_runtime.cli import build_parser, engine_config
from kaon_runtime.server.perf_profile import _serve_settings


def _config(*flags: str):
    return engine_config(build_parser().parse_args(["serve", "--model", "builtin://smollm2-135m-instruct", *flags]))


def test_a_cpu_server_runs_eight_sequences_unless_told_otherwise():
    assert _config("--device", "cpu").max_num_seqs == 8
    assert _config("--device", "cpu", "--max-num-seqs", "64").max_num_seqs == 64
    assert _config("--device", "cuda").max_num_seqs == 64


def test_a_cpu_server_gathers_backlogged_prompts_in_half_its_batch_and_a_gpu_one_does_not():
    assert _config("--device", "cpu").prefill_group == 4
    assert _config("--device", "cpu", "--max-num-seqs", "64").prefill_group == 32
    assert _config("--device", "cpu", "--max-num-seqs", "1").prefill_group == 1
    assert _config("--device", "cpu", "--prefill-group", "1").prefill_group == 1  # off
    assert _config("--device", "cpu", "--max-num-seqs", "2", "--prefill-group", "5").prefill_group == 2
    assert _config("--device", "cuda").prefill_group == 1


def test_the_profile_records_the_batch_the_server_runs():
    assert _serve_settings(["--model", "m", "--device", "cpu"]).max_num_seqs == 8
    assert _serve_settings(["--model", "m", "--device", "cpu", "--max-num-seqs", "16"]).max_num_seqs == 16


def test_the_profile_records_the_step_budget_the_server_runs():
    assert _serve_settings(["--model", "m"]).max_num_batched_tokens == 1024
    assert _serve_settings(["--model", "m", "--role", "decode"]).max_num_batched_tokens == 256
    assert _serve_settings(["--model", "m", "--role", "decode", "--max-num-batched-tokens", "512"]
                           ).max_num_batched_tokens == 512
