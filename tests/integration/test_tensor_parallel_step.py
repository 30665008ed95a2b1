"""Tensor parallelism through the fused CPU step (issue 49 §2): each rank runs its shard of every layer in
the C step (its heads, KV heads and MLP width), and the partial sums of o and down are summed over the
ranks in rank order before anything reads them (models/cpu_decode_step.rank_sum), so a request's tokens at
TP=2 do not depend on cache state, chunking or batch neighbours, as they do not at TP=1.

Ranks are spawned processes in one gloo group (support/tp_ranks.py), or whole engines
(`LLM(..., tensor_parallel_size=2)`) on tiny random HF directories whose widths two ranks split into whole
activation blocks (the bundled SmolLM2's 9 heads do not split in two: test_tensor_parallel.py).
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.kernels import cpu_decode
from support.tp_ranks import all_shard_outputs, rank_sums, run_ranks

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
transformers = pytest.importorskip("transformers")


def test_the_rank_order_sum_of_a_row_does_not_depend_on_the_rows_beside_it():
    """At three ranks gloo's all_reduce summed every row of 2-300-row steps in another order than a row
    alone (its ring sums an element in an order set by the chunk it falls in: torch 2.15; at two ranks
    a + b = b + a). sum_in_rank_order gives each element (x0 + x1) + x2 on every rank, whatever the rows."""
    steps = [1, 2, 3, 5, 17, 64]
    results = run_ranks(rank_sums, 3, steps, 576)
    rows = [row for row, _ in results]
    expected = (rows[0] + rows[1]) + rows[2]
    for rank, (_, sums) in enumerate(results):
        for n, summed in zip(steps, sums):
            assert torch.equal(summed, expected.repeat(n, 1)), f"rank {rank}, a step of {n} rows"


# name: (family, its config's options): GQA (a KV head per rank); one KV head replicated on both ranks with
# q/k/v biases; Gemma 2's sandwich norms (post-attention and post-feedforward norms read the summed output),
# GeGLU, soft-cap and a sliding window
CASES = {"llama": ("llama", {}), "qwen2-replicated-kv": ("qwen2", dict(num_key_value_heads=1)),
         "gemma2": ("gemma2", dict(sliding_window=6, attn_logit_softcapping=2.0, query_pre_attn_scalar=16))}


@pytest.fixture(scope="module")
def shard_outputs():
    """Every case's hidden states at one rank (in this process) and at two, through the C step and torch's."""
    return all_shard_outputs(TensorParallel(), CASES), run_ranks(all_shard_outputs, 2, CASES)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_through_the_c_step_compute_torchs_hidden_states(shard_outputs, case):
    one, (rank0, rank1) = shard_outputs
    for step in ("decode", "mixed"):
        fused = rank0[case]["c"][step]
        assert torch.equal(fused, rank1[case]["c"][step]), f"{step}: the ranks hold the same hidden states"
        torch.testing.assert_close(fused, rank0[case]["torch"][step], atol=1e-4, rtol=1e-4, msg=f"{step}: torch's")
        torch.testing.assert_close(fused, one[case]["c"][step], atol=1e-4, rtol=1e-4, msg=f"{step}: one rank's")
