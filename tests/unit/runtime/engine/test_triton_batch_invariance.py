"""The engine on the Triton backend with KAON_GPU_BATCH_INVARIANT=1: a prompt's answer does not depend on the step.

Issue 49 §2 on the GPU's kernels, run here in Triton's interpreter (the fused C step off, so Triton decodes as on
a GPU) with support.row_dot's tl.dot, whose rows are computed alike as a GPU's are (the interpreter's own dot sums
a row by its place in the tile: see that module). Greedy, each prompt alone is the reference; the same prompts in
one batch, and in chunks of at most 16 tokens, asked twice so that the second ask starts after cached blocks
(the 41-token prompt then computes one token: a one-token chunk, which goes to the decode path), give the same
tokens and log-probabilities, bit for bit. On a GPU the compiled kernels run as they are
(bench/gpu/engine_check.py check 5 measures the same on real hardware).
"""
from __future__ import annotations

import json

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from support.tiny_llama import DEVICE

pytestmark = pytest.mark.slow  # whole models generating on Triton's interpreter

transformers = pytest.importorskip("transformers")

VOCAB = 256  # the vocabulary head goes through the invariant GEMM too: in the interpreter, a column tile a program
PREFIX = list(range(10, 34))  # three blocks of 8, shared by two prompts
# 41 tokens (5 blocks and one: cached, it computes a one-token chunk), 5, and 74 sharing the first's prefix.
PROMPTS = [PREFIX + list(range(100, 117)), list(range(200, 205)), PREFIX + list(range(40, 90))]


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory):
    """support.tiny_llama's model shape (GQA, head_dim 16) with 256 tokens named by a word-level tokenizer."""
    from tokenizers import Tokenizer, models
    path = tmp_path_factory.mktemp("small-vocab-llama")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # spread: random init's attention is near uniform, where other summation orders can
        for p in model.parameters():  # land on the same bits (a decode kernel splitting its context passed)
            if p.dim() > 1:
                p.normal_(0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t2")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    return str(path)


def _answers(outputs) -> list[tuple[list[int], list[float]]]:
    completions = [o.outputs[0] for o in outputs]
    return [(c.token_ids, [step[t] for t, step in zip(c.token_ids, c.logprobs)]) for c in completions]


@pytest.fixture
def invariant_triton(monkeypatch, row_dot):
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("KAON_GPU_BATCH_INVARIANT", "1")
    from kaon_runtime.engine import model_loader
    from kaon_runtime.kernels import paged_attention
    select = model_loader.select_kernels  # float32 decodes on CPU would go to the fused C step: off
    monkeypatch.setattr(model_loader, "select_kernels", lambda device, *_, **__: select(device, False))
    # The interpreter never splits a decode's context; a GPU does, by the batch: 16-key partitions here, as
    # the decode kernel would get them (the invariant backend does not take it; the test fails if it does).
    monkeypatch.setattr(paged_attention, "_auto_partition", lambda programs, max_len, device: 16)


def test_a_prompts_answer_does_not_depend_on_its_batch_chunks_or_cache(small_vocab_llama, invariant_triton):
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    options = dict(show_progress=False, device=DEVICE, dtype="float32", block_size=8)
    with LLM(small_vocab_llama, enable_prefix_caching=False, max_num_batched_tokens=128, **options) as plain:
        runner = plain.engine.runner
        assert runner.kernels.batch_invariant and runner.kernels.attention.batch_invariant
        assert runner.model.model.cpu_decode is None
        alone = [_answers(plain.generate([p], greedy, use_tqdm=False))[0] for p in PROMPTS]
        together = _answers(plain.generate(PROMPTS, greedy, use_tqdm=False))
    with LLM(small_vocab_llama, enable_prefix_caching=True, max_num_batched_tokens=16, **options) as chunked:
        first = _answers(chunked.generate(PROMPTS, greedy, use_tqdm=False))
        cached = _answers(chunked.generate(PROMPTS, greedy, use_tqdm=False))
        assert chunked.engine.block_manager.prefix_hits > 0
    for name, answers in (("batched", together), ("chunked", first), ("chunked and cached", cached)):
        differing = [i for i, (a, b) in enumerate(zip(answers, alone)) if a != b]
        assert not differing, f"{name}: prompts {differing} answered otherwise than alone"
