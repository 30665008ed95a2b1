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
from support.tp_ranks import all_shard_outputs, checkpoint, rank_sums, run_ranks

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
# GeGLU, soft-cap and a sliding window; Qwen3-MoE's experts (each rank half of every expert's width, the router
# replicated: the ranks route alike, and the weighted sum of their shares is summed as down's is)
CASES = {"llama": ("llama", {}), "qwen2-replicated-kv": ("qwen2", dict(num_key_value_heads=1)),
         "gemma2": ("gemma2", dict(sliding_window=6, attn_logit_softcapping=2.0, query_pre_attn_scalar=16)),
         "qwen3_moe": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                         norm_topk_prob=True)),
         # widths that are not whole blocks of 32 (float shards: cpu_decode_step.unsupported_shard): hidden 48, a
         # rank's MLP 40 and heads 2 x 12 = 24
         "llama-odd-widths": ("llama", dict(hidden_size=48, intermediate_size=80, head_dim=12))}


@pytest.fixture(scope="module")
def shard_outputs():
    """Every case's hidden states at one rank (in this process) and at two, through the C step and torch's."""
    checkpoints = {name: checkpoint(family, extra) for name, (family, extra) in CASES.items()}
    return all_shard_outputs(TensorParallel(), checkpoints), run_ranks(all_shard_outputs, 2, checkpoints)


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_through_the_c_step_compute_torchs_hidden_states(shard_outputs, case):
    one, (rank0, rank1) = shard_outputs
    for step in ("decode", "mixed"):
        fused = rank0[case]["c"][step]
        assert torch.equal(fused, rank1[case]["c"][step]), f"{step}: the ranks hold the same hidden states"
        torch.testing.assert_close(fused, rank0[case]["torch"][step], atol=1e-4, rtol=1e-4, msg=f"{step}: torch's")
        torch.testing.assert_close(fused, one[case]["c"][step], atol=1e-4, rtol=1e-4, msg=f"{step}: one rank's")



# Quantized shards at widths that are not whole blocks of 32 (cpu_decode_step.unsupported_shard): the odd-width
# model quantized on each rank after its float shard loads, as the engine does (a rank's MLP 40 and heads 24 are its
# row-parallel inputs: int8 packs them to 64 with zero columns, int4 pads them to whole groups, fp8 reads any width)
QUANTIZED = ("int8", "int4", "fp8")


@pytest.fixture(scope="module")
def quantized_outputs():
    """The odd-width model under each quantization at one rank (in this process) and at two."""
    checkpoints = {method: checkpoint(*CASES["llama-odd-widths"]) for method in QUANTIZED}
    methods = {method: method for method in QUANTIZED}
    return (all_shard_outputs(TensorParallel(), checkpoints, methods),
            run_ranks(all_shard_outputs, 2, checkpoints, methods))


@pytest.mark.parametrize("method", QUANTIZED)
def test_quantized_shards_at_odd_widths_through_the_c_step(quantized_outputs, method):
    """Each rank's quantized shard computes what its weights say, and a prompt row's numbers do not depend on the
    rows beside it: the same alone, in two chunks, or beside decodes, bit for bit. The shards are not one rank's
    weights (per-row scales over half a row, int4's groups from rank 1's first column), so one rank's numbers are
    the bound on a shard's distance from torch's, not its value: a shard's C step is as near torch's path (float
    activations) as the whole model's is, within 2x; fp8 (weight-only, float activations in both) equals torch's."""
    one, (rank0, rank1) = quantized_outputs
    ours, theirs = rank0[method], one[method]
    for step in ("decode", "mixed"):
        fused = ours["c"][step]
        assert torch.equal(fused, rank1[method]["c"][step]), f"{step}: the ranks hold the same hidden states"
        if method == "fp8":
            torch.testing.assert_close(fused, ours["torch"][step], atol=1e-4, rtol=1e-4, msg=f"{step}: torch's")
        else:
            whole = (theirs["c"][step] - theirs["torch"][step]).abs().max().item()
            shard = (fused - ours["torch"][step]).abs().max().item()
            assert shard <= 2 * whole, f"{step}: a shard {shard} from torch's path, one rank {whole}"
    for rows in ("alone", "chunked"):
        assert torch.equal(ours["c"][rows], ours["c"]["mixed"][3:]), f"the prompt's rows {rows} = beside decodes"


# ---- whole engines ---------------------------------------------------------------------------

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)
# Prompts of different lengths, the last sharing its first 40 tokens (two blocks of 16) with the second
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 160)), [300, 301, 302] * 8, list(range(1000, 1037)),
           list(range(100, 140)) + [7, 8, 9]]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _answers(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's tokens and each token's own log-probability."""
    outputs = llm.generate(prompts, _greedy(), use_tqdm=False)
    return [(c.token_ids, [step[t] for t, step in zip(c.token_ids, c.logprobs)])
            for c in (o.outputs[0] for o in outputs)]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, gguf_path):
    """A tiny float32 Llama at one rank, and at two: (no prefix cache, whole prompts in one step),
    (prefix cache, prefill chunks of 16 tokens)."""
    from support.hf_dirs import write_hf_dir
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tp-step")
    write_hf_dir(transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)), path, gguf_path,
                 {"eos_token": "<|im_end|>"})
    with pytest.MonkeyPatch.context() as env:
        for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
            env.delenv(name, raising=False)
        options = dict(show_progress=False, device="cpu", dtype="float32", num_kv_blocks=256)
        made = [LLM(str(path), **options),
                LLM(str(path), tensor_parallel_size=2, enable_prefix_caching=False, **options),
                LLM(str(path), tensor_parallel_size=2, enable_prefix_caching=True, max_num_batched_tokens=16,
                    **options)]
    try:
        for llm in made:
            assert llm.engine.runner.model.model.cpu_decode is not None, "the C step runs every rank's shard"
        yield made
    finally:
        for llm in made:
            llm.close()


def _assert_same(got, expected, how: str) -> None:
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g[0] == e[0], f"prompt {i} {how}: tokens {g[0]} != alone {e[0]}"
        assert g[1] == e[1], f"prompt {i} {how}: log-probabilities differ from alone's\n{g[1]}\n{e[1]}"


def test_an_answer_at_two_ranks_does_not_depend_on_batch_chunking_or_cache(engines):
    one, plain, chunked = engines
    alone = [_answers(plain, [p])[0] for p in PROMPTS]
    _assert_same(_answers(plain, PROMPTS), alone, "in a batch")
    _assert_same(_answers(chunked, PROMPTS), alone, "in chunks of 16, batched")
    _assert_same([_answers(chunked, [p])[0] for p in PROMPTS], alone, "with its prefix cached")
    # and one rank's greedy tokens on the same weights (float32: the sums differ in order, not in choice)
    assert [tokens for tokens, _ in _answers(one, PROMPTS)] == [tokens for tokens, _ in alone]


def test_two_stages_of_two_ranks_answer_as_two_ranks_do(engines):
    """PP=2 x TP=2: each stage's ranks run their shards of its layers through the C step and sum within the
    stage's group; a stage hands the next its residual stream in float32. Every layer's sums are then those
    of TP=2 alone, so the answers equal TP=2's bit for bit, chunked and batched."""
    _, plain, _ = engines
    alone = [_answers(plain, [p])[0] for p in PROMPTS]
    path = plain.engine.config.model
    with LLM(path, show_progress=False, device="cpu", dtype="float32", num_kv_blocks=256, tensor_parallel_size=2,
             pipeline_parallel_size=2, max_num_batched_tokens=16) as staged:
        assert staged.engine.runner.cpu_decode_step
        _assert_same(_answers(staged, PROMPTS), alone, "at PP=2 x TP=2, in chunks of 16, batched")


def test_an_int8_model_at_odd_rank_widths_answers_at_two_ranks_alike_alone_or_batched(tmp_path, gguf_path):
    """`--quantization int8` on a model whose rank widths are not whole blocks of 32 (hidden 48, MLP 80, head_dim 12:
    a rank's MLP 40, heads 24) at TP=2: the blocker lets it through (cpu_decode_step.unsupported_shard), every rank
    quantizes its shard and runs it through the C step, and an answer does not depend on its batch, its prompt's
    chunks or a cached prefix, bit for bit."""
    from support.hf_dirs import write_hf_dir
    torch.manual_seed(0)
    odd = dict(SMALL, hidden_size=48, intermediate_size=80, head_dim=12)
    write_hf_dir(transformers.LlamaForCausalLM(transformers.LlamaConfig(**odd)), tmp_path, gguf_path,
                 {"eos_token": "<|im_end|>"})
    with pytest.MonkeyPatch.context() as env:
        for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
            env.delenv(name, raising=False)
        llm = LLM(str(tmp_path), show_progress=False, device="cpu", dtype="float32", num_kv_blocks=256,
                  quantization="int8", tensor_parallel_size=2, max_num_batched_tokens=16)
    with llm:
        model = llm.engine.runner.model
        assert model.model.cpu_decode is not None, "the C step runs the rank's quantized shard"
        down = model.model.layers[0].mlp.down_proj.kernel_weights.struct
        assert (down.kind, down.k_in, down.k) == (cpu_decode.KIND_INT8, 40, 64), "a rank's MLP 40, packed to 64"
        alone = [_answers(llm, [p])[0] for p in PROMPTS]
        _assert_same(_answers(llm, PROMPTS), alone, "in chunks of 16, batched, its prefix cached")
