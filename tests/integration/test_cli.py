"""`kaon generate` end to end, as a user runs it."""
from __future__ import annotations

import subprocess
import sys


def kaon(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kaon_runtime.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_an_answer():
    # Not "What is the capital of France?": its first token is a 0.08-nat tie for the bundled model ("The capital
    # of France is Paris." / "L'Étoile, ..."), which the default int4 arithmetic tips (docs/serving.md)
    result = kaon("generate", "--prompt", "Who wrote 'Pride and Prejudice'?", "--max-tokens", "12")
    assert result.returncode == 0, result.stderr
    assert ">>> Who wrote 'Pride and Prejudice'?" in result.stdout
    assert "Austen" in result.stdout
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


def test_every_flag_the_operator_renders_is_one_kaon_serve_takes():
    from kaon_operator import api
    from kaon_operator.children import pod_template, resources
    from kaon_runtime.cli import build_parser

    spec = api.InferenceServiceSpec.model_validate({
        "model": {"uri": "/models/llama", "servedName": "llama", "maxModelLen": 4096},
        "engine": {"maxNumSeqs": 32, "maxNumBatchedTokens": 2048, "kvCacheFraction": 0.5,
                   "enablePrefixCaching": False}})
    argv = pod_template.engine_args("x", spec)
    assert argv[0] == "kaon"
    args = build_parser().parse_args(argv[1:])
    assert (args.model, args.served_model_name, args.max_model_len) == ("/models/llama", "llama", 4096)
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_fraction) == (32, 2048, 0.5)
    assert args.enable_prefix_caching is False and args.port == resources.HTTP_PORT
    assert args.drain_timeout == pod_template.DRAIN_SECONDS and args.tensor_parallel_size == 1


def test_a_tensor_parallel_size_the_model_cannot_split_fails_clearly_at_start():
    result = kaon("serve", "--tensor-parallel-size", "2")  # SmolLM2: 9 heads, 3 KV heads
    assert result.returncode == 2, result.stderr
    assert "tensor_parallel_size 2 does not divide its 9 attention heads" in result.stderr
    assert "Traceback" not in result.stderr


def test_kaon_operator_and_kaon_router_hand_over_to_their_own_commands():
    # The runtime never imports kaon_operator (tests/unit/test_imports.py): the old spellings replace
    # the process with `python -m kaon_operator` / `python -m kaon_operator.router`.
    for command, usage, flag in (("operator", "usage: kaon-operator", "--peering"),
                                 ("router", "usage: kaon-router", "--queue-timeout")):
        result = subprocess.run([sys.executable, "-m", "kaon_runtime.cli", command, "--help"], capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert usage in result.stdout and flag in result.stdout


def test_a_fatal_start_error_is_written_to_the_termination_log(tmp_path, monkeypatch, capsys):
    """In a pod the kubelet mounts /dev/termination-log: the one line lands there, so the pod's
    status (and the InferenceService's Degraded message) carries it; elsewhere only stderr has it."""
    from kaon_runtime import cli
    log = tmp_path / "termination-log"
    log.write_text("")
    monkeypatch.setattr(cli, "TERMINATION_LOG", log)
    assert cli.main(["serve", "--model", "builtin://nope"]) == 2
    assert log.read_text().startswith("kaon: error: unknown builtin model 'nope'") and log.read_text().count("\n") == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == log.read_text().strip()
    monkeypatch.setattr(cli, "TERMINATION_LOG", tmp_path / "absent")  # no kubelet: nothing created
    assert cli.main(["serve", "--model", "builtin://nope"]) == 2
    assert not (tmp_path / "absent").exists()


def test_kaon_serve_sizes_the_kv_pool_by_bytes_or_blocks_and_refuses_a_bad_size_clearly():
    from kaon_runtime.cli import build_parser, engine_config

    def config(*flags: str):
        return engine_config(build_parser().parse_args(["serve", *flags]))

    assert (config().kv_cache_bytes, config().num_kv_blocks) == (1 << 30, None)
    assert config("--kv-cache-bytes", "268435456").kv_cache_bytes == 256 << 20
    assert config("--num-kv-blocks", "96").num_kv_blocks == 96
    assert (config().kv_cache_dtype, config("--kv-cache-dtype", "float16").kv_cache_dtype) == ("auto", "float16")
    for flag, value, why in (("--num-kv-blocks", "0", "must be at least 1, got 0"),
                             ("--kv-cache-bytes", "-1", "must be at least 1, got -1"),
                             ("--kv-cache-bytes", "1GiB", "expected a whole number, got '1GiB'")):
        result = kaon("serve", flag, value)
        assert result.returncode == 2, result.stderr
        assert f"argument {flag}: {why}" in result.stderr and "Traceback" not in result.stderr


def test_kaon_serve_takes_a_prefill_delay_and_refuses_a_bad_one_clearly():
    from kaon_runtime.cli import build_parser, engine_config

    assert engine_config(build_parser().parse_args(["serve"])).prefill_delay_ms == 0
    assert engine_config(build_parser().parse_args(["serve", "--prefill-delay-ms", "750"])).prefill_delay_ms == 750
    for value, why in (("-5", "must be a finite number >= 0, got -5"), ("nan", "must be a finite number >= 0, got nan"),
                       ("soon", "expected a number, got 'soon'")):
        result = kaon("serve", "--prefill-delay-ms", value)
        assert result.returncode == 2, result.stderr
        assert f"argument --prefill-delay-ms: {why}" in result.stderr and "Traceback" not in result.stderr
