"""Engines come and go inside one process (issue 49 §4): ten LLMs of mixed settings (tensor and pipeline
parallel, LoRA slots, n-gram and draft-model speculation) built and dropped in a row, each leaving by
close(), a with block or garbage collection, the next often starting while the last is still bound.

Each must work (the same greedy tokens: the settings change how, not what, the tiny model computes) and
leave nothing behind once gone: no worker process, no socket (a store's port, a group's connection), no
thread of kaon's (a pipeline group's accept loop), no
torch.distributed default group, its model's memory freed; and the process ends without
multiprocessing's resource tracker warning of leaked semaphores or shared memory.
Before each engine owned its process groups, the second LLM failed with "trying to initialize the
default process group twice!".
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.hf_dirs import write_hf_dir
from support.server import RUNTIME

transformers = pytest.importorskip("transformers")
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, gguf_path) -> str:
    """A 3-layer random Llama (PP=3 gives each stage a layer) with 4 heads and 2 KV heads (TP=2 splits it)."""
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("churn")
    write_hf_dir(transformers.LlamaForCausalLM(config), path, gguf_path, {"eos_token": "<|im_end|>"})
    return str(path)


@pytest.mark.slow
def test_ten_engines_in_a_row_leave_nothing_behind(tiny):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(RUNTIME), str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "PYTHONWARNINGS": "default"}
    done = subprocess.run([sys.executable, "-m", "support.engine_churn", tiny], cwd=TESTS, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    *engines, end = lines
    assert len(engines) == 10
    assert all(e["tokens"] == engines[0]["tokens"] for e in engines), [e["tokens"] for e in engines]
    for e in engines:
        assert not e["default_group"], e
        if e["leaving"] == "rebind":  # still bound: only it is alive, with its own workers; the one before is gone
            assert e["in_memory"] == [e["index"]] and len(e["children"]) == e["workers"], e
        else:
            assert e["in_memory"] == [] and e["children"] == [] and e["sockets"] == 0 and e["threads"] == [], e
    assert end["in_memory"] == [] and end["children"] == [] and end["sockets"] == 0 and not end["default_group"]
    assert end["threads"] == [], end  # each pipeline engine's accept thread stayed, holding its group's pipes
    assert "resource_tracker" not in done.stderr and "leaked" not in done.stderr, done.stderr[-3000:]
