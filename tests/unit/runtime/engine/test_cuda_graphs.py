"""Decode steps through CUDA graphs: the ladder, the padding of static buffers, and the tokens they give.

Without a GPU the static-buffer path runs eagerly (what a graph would record, replayed by
running it): that checks padding, stale block-table columns and the ladder's fallbacks.
With a GPU, the last test captures real graphs and compares them with eager decoding (bf16).
"""
from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.engine.cuda_graphs import graph_size, ladder
from support.tiny_llama import DEVICE, PROMPTS, first_difference_at_a_near_tie, spread_copy

# Whole models generating: `make test` runs these, `make unit` (the inner loop) leaves them out.
pytestmark = pytest.mark.slow


def test_ladder_starts_fine_then_steps_by_eight_and_ends_at_the_limit():
    assert ladder(1) == [1]
    assert ladder(3) == [1, 2, 3]
    assert ladder(20) == [1, 2, 4, 8, 16, 20]
    sizes = ladder(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a <= 8 for a, b in pairwise(sizes))


def test_graph_size_is_the_smallest_that_holds_the_batch():
    sizes = ladder(20)
    assert [graph_size(n, sizes) for n in (1, 3, 5, 16, 17, 20)] == [1, 4, 8, 16, 20, 20]
    assert graph_size(21, sizes) is None


# Five prompts of different lengths finishing at different steps: rows are reused by other
# sequences, batches shrink through the ladder (5 -> padded to 8, then 4, 2, 1) and a prompt
# is prefilled in chunks next to decodes, which must stay eager.
BF16_NEAR_TIE = 0.25  # bf16 keeps 8 bits of a logit: one of 10 is rounded to 0.0625 (the GPU test below)
MORE_PROMPTS = PROMPTS + [list(range(700, 703)), list(range(800, 840))]
MAX_TOKENS = [9, 3, 6, 12, 4]


def _generate(path, graphs_up_to: int | None):
    llm = LLM(path, show_progress=False, device=DEVICE, dtype="float32", block_size=8, max_num_batched_tokens=32)
    if graphs_up_to is not None:
        llm.engine.runner.config.cuda_graph_max_batch = graphs_up_to
        llm.engine.runner.prepare_decode_graphs(llm.engine.max_model_len, capture=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outputs = llm.generate(MORE_PROMPTS, params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("graphs_up_to", [8, 2], ids=["all-decodes", "big-batches-eager"])
def test_static_decode_path_gives_the_eager_tokens(tiny_llama, monkeypatch, backend, graphs_up_to):
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", backend)
    _, expected = _generate(tiny_llama, None)
    llm, tokens = _generate(tiny_llama, graphs_up_to)
    graphs = llm.engine.runner.decode_graphs
    assert graphs.sizes == ladder(graphs_up_to) and graphs.replays > 0
    assert tokens == expected


@pytest.mark.parametrize("device,backend,max_batch,applies", [
    ("cpu", "torch", 256, False), (DEVICE, "triton", 0, False), (DEVICE, "triton", 256, DEVICE == "cuda")])
def test_graphs_are_captured_only_where_they_apply(tiny_llama, monkeypatch, device, backend, max_batch, applies):
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", backend)
    llm = LLM(tiny_llama, show_progress=False, device=device, dtype="float32", cuda_graph_max_batch=max_batch)
    assert llm.engine.runner.cuda_graphs_apply() == applies
    assert (llm.engine.runner.decode_graphs is not None) == applies


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures real CUDA graphs")
def test_captured_graphs_give_the_eager_tokens_on_a_gpu(tiny_llama, tmp_path):
    # In bf16, padding a batch of 3 to the graph of 4 (other GEMM shapes, other rounding) may change a
    # greedy token only at a near-tie. The model, its weights spread, travels to a lent GPU.
    path = spread_copy(tiny_llama, tmp_path / "spread")

    def run(max_batch):
        llm = LLM(path, show_progress=False, device="cuda", dtype="bfloat16", cuda_graph_max_batch=max_batch)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (24, 9, 16)]
        return llm, llm.generate(PROMPTS, params, use_tqdm=False)

    eager, expected = run(0)
    assert eager.engine.runner.decode_graphs is None
    graphed, outputs = run(16)
    graphs = graphed.engine.runner.decode_graphs
    assert graphs.capture and graphs.sizes == [1, 2, 4, 8, 16] and graphs.replays > 0
    first_difference_at_a_near_tie(expected, [o.outputs[0].token_ids for o in outputs], BF16_NEAR_TIE)
