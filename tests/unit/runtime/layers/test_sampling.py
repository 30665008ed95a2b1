"""Sampler behaviour on synthetic logits: no model needed."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.layers.sampler import SamplingBatch, _apply_top_k_top_p, sample
from kaon_runtime.sampling import SamplingParams


def batch(n, temperature=1.0, top_k=0, top_p=1.0, generators=None, logprobs=None):
    return SamplingBatch([temperature] * n, [top_k] * n, [top_p] * n, generators or [None] * n, logprobs)


def seeded(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert sample(logits, batch(5, temperature=0)).token_ids == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = torch.randn(1, 100)
    alone = [sample(logits, batch(1, generators=[seeded(7)])).token_ids[0] for _ in range(1)]
    many = torch.cat([torch.randn(3, 100), logits])
    together = sample(many, batch(4, generators=[None, None, None, seeded(7)])).token_ids[3]
    assert alone[0] == together


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(20000, 1)
    counts = torch.bincount(torch.tensor(sample(logits, batch(20000)).token_ids), minlength=4).float() / 20000
    assert torch.allclose(counts, probs, atol=0.015), counts


def test_temperature_sharpens():
    logits = torch.tensor([[2.0, 1.0, 0.0]]).repeat(5000, 1)
    cold = torch.tensor(sample(logits, batch(5000, temperature=0.2)).token_ids)
    hot = torch.tensor(sample(logits, batch(5000, temperature=5.0)).token_ids)
    assert (cold == 0).float().mean() > 0.95 > (hot == 0).float().mean()


def test_top_k_and_top_p_keep_only_the_head():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    only_two = _apply_top_k_top_p(logits, [2], [1.0])
    assert torch.isinf(only_two[0, 2:]).all() and torch.isfinite(only_two[0, :2]).all()
    probs = torch.softmax(logits, -1)  # [0.64, 0.24, 0.09, ...]
    head = _apply_top_k_top_p(logits, [0], [0.8])
    assert torch.isfinite(head[0, :2]).all() and torch.isinf(head[0, 2:]).all(), probs
    draws = sample(logits.repeat(2000, 1), batch(2000, top_k=2)).token_ids
    assert set(draws) == {0, 1}


def test_logprobs_are_log_softmax():
    logits = torch.randn(3, 20)
    result = sample(logits, batch(3, temperature=0, logprobs=2))
    ref = torch.log_softmax(logits, -1)
    for row, chosen in enumerate(result.token_ids):
        assert set(ref[row].topk(2).indices.tolist()) <= set(result.logprobs[row])
        for token, value in result.logprobs[row].items():
            assert value == pytest.approx(ref[row, token].item(), abs=1e-6)
        assert chosen in result.logprobs[row]


@pytest.mark.parametrize("bad", [dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0),
                                 dict(top_k=-2), dict(n=0), dict(logprobs=21), dict(stop=[""])])  # -1: off, as vLLM
def test_bad_sampling_params_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_tiny_temperature_is_greedy_and_huge_values_are_refused():
    assert SamplingParams(temperature=1e-45).temperature == 0
    with pytest.raises(InvalidRequestError, match="seed"):
        SamplingParams(seed=10 ** 23)
    with pytest.raises(InvalidRequestError, match="top_k"):
        SamplingParams(top_k=2 ** 63)
    logits = torch.randn(2, 30)
    assert sample(logits, batch(2, top_k=2 ** 63 - 1)).token_ids  # clamped to the vocabulary
