"""A float64 model on CPU gets the same answer for the same request, whatever else the engine is doing (issue 49 §2;
layers/rows_alone.py). float64 stays on torch's path (the tests' exactness oracle against transformers' float64), whose
GEMMs moved a row's bits with the step's row count; its projections, head, experts and attention now go through
float64 kernels that compute each row alone (kernels/cpu_f64.py, cpu_decode.c kaon_linear_f64 / kaon_attention_f64).

A tiny Llama (weights spread: near ties are rare), greedy; each prompt alone is the reference, and the same prompts
  - in one batch with prompts of other lengths (batch neighbours),
  - in prefill chunks of 16 tokens (chunked prefill),
  - a second time, their prefix blocks cached (prefix-cache hits; two prompts share three blocks),
must give the same tokens and the same log-probabilities, bit for bit, and every row of every step the same float64
residual stream into the final norm. (That norm, like HF's, computes in float32, and the logits are rounded to float32:
torch's float64 GEMMs' moving bits seldom show through either rounding, so the float64 stream is what this test holds.)
The kernels alone: test_cpu_f64.py.
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from support.tiny_llama import PROMPTS, spread_copy, tiny_llama  # noqa: F401 -- (tiny_llama: the fixture)

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def spread(tiny_llama, tmp_path_factory):  # noqa: F811 -- (the fixture's own name)
    return spread_copy(tiny_llama, tmp_path_factory.mktemp("spread") / "model")


def _recording(llm: LLM) -> list[bytes]:
    """Every row's float64 (hidden, residual) into the final norm from now on, as bytes (a forward hook)."""
    seen: list[bytes] = []

    def record(module, inputs, output):
        x, residual = inputs
        seen.extend(row.numpy().tobytes() for row in torch.cat([x, residual], dim=-1).detach())
    llm.engine.runner.model.model.norm.register_forward_hook(record)
    return seen


def _answers(outputs) -> list[tuple[list[int], list[float]]]:
    found = []
    for output in outputs:
        completion = output.outputs[0]
        found.append((list(completion.token_ids),
                      [step[token] for token, step in zip(completion.token_ids, completion.logprobs)]))
    return found


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(spread):
    """(no prefix cache, whole prompts), (prefix cache, prefill chunks of 16 tokens)."""
    with pytest.MonkeyPatch.context() as env:
        env.delenv("KAON_CPU_PREFILL", raising=False)
        plain = LLM(spread, show_progress=False, device="cpu", dtype="float64", enable_prefix_caching=False)
        chunked = LLM(spread, show_progress=False, device="cpu", dtype="float64", enable_prefix_caching=True,
                      max_num_batched_tokens=16, block_size=8)
    yield plain, chunked
    for llm in (plain, chunked):
        llm.close()


def test_a_float64_model_is_built_with_the_rows_alone_parts(engines):
    plain, _ = engines
    assert plain.engine.runner.model.kernels.cpu_rows_alone


def test_float64_answers_do_not_move_with_batch_chunking_or_cache(engines):
    plain, chunked = engines
    seen_plain, seen_chunked = _recording(plain), _recording(chunked)
    prompts = PROMPTS + [list(range(700, 733))]
    alone = [_answers(plain.generate([p], _greedy(), use_tqdm=False))[0] for p in prompts]
    reference, hidden = set(seen_plain), {}
    seen_plain.clear()
    together = _answers(plain.generate(prompts, _greedy(), use_tqdm=False))
    hidden["batched"] = list(seen_plain)
    chunks = _answers(chunked.generate(prompts, _greedy(), use_tqdm=False))
    hidden["chunked"] = list(seen_chunked)
    seen_chunked.clear()
    cached = _answers(chunked.generate(prompts, _greedy(), use_tqdm=False))  # the prefixes cached now
    cached_alone = [_answers(chunked.generate([p], _greedy(), use_tqdm=False))[0] for p in prompts]
    hidden["cached"] = list(seen_chunked)
    for name, got in (("batched", together), ("chunked", chunks), ("cached", cached), ("cached alone", cached_alone)):
        assert got == alone, name
    assert len(reference) >= sum(map(len, prompts))  # (every prompt row and decode row of its own)
    for name, rows in hidden.items():  # each row one of a prompt's own, alone, bit for bit
        moved = sum(row not in reference for row in rows)
        assert rows and not moved, f"{name}: {moved} of {len(rows)} rows' float64 numbers moved"
