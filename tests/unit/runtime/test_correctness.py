"""Greedy output of the engine equals HF transformers token for token on the same weights.

HF loads the same GGUF file (dequantized to float32, Q/K permutation undone by its own
converter) and scores each prompt alone, without padding: the cleanest reference.
The engine runs every prompt through the paged cache with continuous batching.

HF's greedy continuation is, by definition, the token HF ranks first at each step given the
tokens before it. So HF scores prompt + kaon's tokens in one forward pass (teacher-forced)
and every kaon token must be HF's first choice there, and kaon must stop where HF's greedy
run would (at EOS, which must then be HF's choice, or at max_tokens): the same check as
HF generating token by token, one forward per prompt instead of one per token (the mixed
batch's 22 prompts x 24 tokens were ~40 s of HF decoding on a 2-vCPU Zen 2).
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from support.prompts import MAX_TOKENS, QUESTIONS, chat_ids
from support.quantized_dirs import teacher_forced_logits

pytestmark = pytest.mark.slow


def greedy(max_tokens=MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def hf_choices(hf_model, prompt: list[int], tokens: list[int]) -> tuple[list[int], list[float]]:
    """HF's first choice after each prefix prompt + tokens[:i] (i = 0..len(tokens)-1), from one forward
    pass over prompt + tokens, and by how much it leads the token at that step (0 where they agree)."""
    logits = teacher_forced_logits(hf_model, prompt, tokens)
    best = logits.max(dim=-1)
    lead = best.values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return best.indices.tolist(), lead.tolist()


def assert_matches_hf(hf_model, llm: LLM, prompts: list[list[int]], outputs, max_tokens=MAX_TOKENS):
    """Each output is HF's greedy continuation of its prompt (the module docstring says why one forward does)."""
    eos = llm.tokenizer.eos_token_id
    for prompt, output in zip(prompts, outputs):
        got = list(output.outputs[0].token_ids)
        assert got, f"nothing generated for the prompt of {len(prompt)} tokens"
        assert len(got) == max_tokens or (len(got) < max_tokens and got[-1] == eos), \
            f"stopped after {len(got)} of {max_tokens} tokens on {got[-1]}, not EOS {eos}: {got}"
        assert eos not in got[:-1], f"ran past EOS, where HF's greedy run stops: {got}"
        hf, lead = hf_choices(hf_model, prompt, got)
        step = next((i for i, (ours, theirs) in enumerate(zip(got, hf)) if ours != theirs), None)
        assert step is None, (f"diverged at step {step} for a prompt of {len(prompt)} tokens: kaon {got[step]}, "
                              f"HF's first choice {hf[step]} (ahead by {lead[step]:.3g})\n kaon {got}")


def test_mixed_length_batch_matches_hf(llm, hf_model):
    prompts = [chat_ids(llm, q) for q in QUESTIONS]
    lengths = [len(p) for p in prompts]
    assert max(lengths) - min(lengths) >= 30, "the batch should mix prompt lengths"
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert_matches_hf(hf_model, llm, prompts, outputs)


def test_multi_turn_conversation_matches_hf(llm, hf_model):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Pick a number between 1 and 10."},
                {"role": "assistant", "content": "7"},
                {"role": "user", "content": "Now double it and explain."}]
    prompt = llm.encode_chat(messages)
    assert_matches_hf(hf_model, llm, [prompt], llm.generate([prompt], greedy(), use_tqdm=False))


LONG_SYSTEM = ("You are a meticulous assistant for a logistics company. Always answer in plain English, "
               "cite the rule you apply, never invent shipment numbers, keep answers under fifty words, "
               "and when a question is ambiguous ask one clarifying question first. Rules: parcels over "
               "thirty kilograms ship by freight; fragile goods need double boxing; international orders "
               "need a customs form; refunds take five working days; weekend deliveries cost extra. ") * 2


def test_shared_prefix_hits_cache_and_matches_hf(llm, hf_model):
    questions = ["Can I ship a 40 kg parcel by post?", "How long does a refund take?",
                 "Do I need a form to send a vase to Canada?", "Is Saturday delivery free?"]
    prompts = [chat_ids(llm, q, system=LONG_SYSTEM) for q in questions]
    bm = llm.engine.block_manager
    llm.generate(prompts[:1], greedy(), use_tqdm=False)  # warms the cache with the shared prefix
    hits_before = bm.prefix_hits
    outputs = llm.generate(prompts[1:], greedy(), use_tqdm=False)
    shared = len(chat_ids(llm, "", system=LONG_SYSTEM)) - 8  # the system part, minus the user header
    block = llm.engine.config.block_size
    assert bm.prefix_hits - hits_before >= 3 * (shared // block - 1) * block
    assert all(o.num_cached_tokens >= (shared // block - 1) * block for o in outputs)
    assert_matches_hf(hf_model, llm, prompts[1:], outputs)


def test_a_burst_on_a_cold_prefix_computes_it_once_and_matches_hf(llm, hf_model):
    # Sent together, nothing cached yet: the first computes the shared system prompt and the
    # others wait a step for it (scheduler.wait_for_shared_prefix) instead of computing it too.
    system = "Burst. " + LONG_SYSTEM
    questions = ["Can I ship a 40 kg parcel by post?", "How long does a refund take?", "Is Saturday delivery free?"]
    prompts = [chat_ids(llm, q, system=system) for q in questions]
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    shared = len(chat_ids(llm, "", system=system)) - 8
    block = llm.engine.config.block_size
    assert outputs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= (shared // block - 1) * block for o in outputs[1:])
    assert_matches_hf(hf_model, llm, prompts, outputs)


def test_tiny_kv_pool_preempts_and_still_matches_hf(hf_model):
    # 8 prompts of ~30 tokens + 24 generated need ~4 blocks of 16 each, 32 in all, against 14: preemptions.
    small = LLM(show_progress=False, device="cpu", dtype="float32", num_kv_blocks=14, block_size=16)
    prompts = [chat_ids(small, q) for q in QUESTIONS[:8]]
    outputs = small.generate(prompts, greedy(), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 14, "every block must come back"
    assert_matches_hf(hf_model, small, prompts, outputs)


def test_chunked_prefill_longer_than_budget_matches_hf(hf_model):
    chunked = LLM(show_progress=False, device="cpu", dtype="float32", max_num_batched_tokens=64)
    long_prompt = chat_ids(chunked, "Summarise this policy in one sentence: " + LONG_SYSTEM)
    short_prompt = chat_ids(chunked, QUESTIONS[0])
    assert len(long_prompt) > 3 * 64
    steps = []
    execute = chunked.engine.runner.execute
    chunked.engine.runner.execute = lambda batch: (steps.append(list(batch.num_new_tokens)), execute(batch))[1]
    outputs = chunked.generate([short_prompt, long_prompt], greedy(), use_tqdm=False)
    assert max(sum(s) for s in steps) <= 64
    assert any(1 in s and max(s) > 1 for s in steps), "a decode should share a step with a prefill chunk"
    assert_matches_hf(hf_model, chunked, [short_prompt, long_prompt], outputs)


def test_logprobs_match_hf_logits(llm, hf_model):
    """Every generated token's log-probability, and the top-5, agree with HF's logits."""
    prompt = chat_ids(llm, QUESTIONS[2])
    out = llm.generate([prompt], greedy(logprobs=5), use_tqdm=False)[0].outputs[0]
    ref = torch.log_softmax(teacher_forced_logits(hf_model, prompt, out.token_ids), dim=-1)
    worst = 0.0
    for step, (token, alternatives) in enumerate(zip(out.token_ids, out.logprobs)):
        for token_id, logprob in alternatives.items():
            worst = max(worst, abs(logprob - ref[step, token_id].item()))
        assert set(alternatives) - {token} <= set(ref[step].topk(6).indices.tolist())
    assert worst < 1e-3, f"max |logprob difference| {worst:.2e}"


# Prompt logprobs against HF's (from test_prompt_logprobs.py: here, HF's model is loaded once per worker).
PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid."


def test_prompt_logprobs_equal_transformers_and_max_tokens_0_generates_nothing(llm, hf_model):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    reference = torch.log_softmax(teacher_forced_logits(hf_model, ids[:1], ids[1:]), dim=-1)  # row p-1: token p's
    for p in range(1, len(ids)):
        entry = scored[p]
        assert abs(entry[ids[p]] - reference[p - 1, ids[p]].item()) < 1e-4, p
        top = reference[p - 1].topk(3)
        assert set(top.indices.tolist()) <= set(entry), p
