"""The common step's batched sampling (sample_plain) gives sample_rows' tokens, draw for draw."""
from __future__ import annotations

import random

import pytest
import torch

from kaon_runtime.layers.sample_step import RowsToSample, is_plain, sample_plain, sample_rows
from kaon_runtime.sampling import SamplingParams


def _plain_params(rng: random.Random, kind: str) -> SamplingParams:
    if kind == "greedy" or (kind == "mixed" and rng.random() < 0.4):
        return SamplingParams(temperature=0, max_tokens=None)
    return SamplingParams(temperature=rng.choice([0.3, 0.7, 1.0, 1.5]), top_k=rng.choice([0, 1, 5, 50]),
                          top_p=rng.choice([1.0, 0.9, 0.5]), max_tokens=None)


@pytest.mark.parametrize("kind", ["greedy", "random", "mixed"])
def test_sample_plain_equals_sample_rows(kind):
    rng = random.Random(kind)
    for trial in range(20):
        n, vocab = rng.randint(1, 40), rng.choice([7, 100, 1000])
        params = [_plain_params(rng, kind) for _ in range(n)]
        assert all(is_plain(p) for p in params)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        if rng.random() < 0.3:  # ties: argmax must pick the same index both ways
            logits[:, : vocab // 2] = logits[:, :1]
        torch.manual_seed(100 + trial)
        rows = sample_rows(logits.clone(), [RowsToSample(p, None) for p in params])
        after_rows = torch.rand(1)  # the global RNG where sample_rows left it
        torch.manual_seed(100 + trial)
        plain = sample_plain(logits.clone(), params)
        assert rows.logprobs is None
        assert [[t] for t in plain] == rows.token_ids, (kind, trial)
        assert torch.equal(torch.rand(1), after_rows), "the same draws from the global RNG"


@pytest.mark.parametrize("change", [
    dict(logprobs=0), dict(logprobs=3), dict(seed=1), dict(presence_penalty=0.5), dict(frequency_penalty=-0.2),
    dict(repetition_penalty=1.1), dict(logit_bias={3: 1.0}), dict(min_p=0.1), dict(min_tokens=2),
])
def test_anything_that_is_not_plain_takes_sample_rows(change):
    assert is_plain(SamplingParams(temperature=0.5, top_k=5, top_p=0.9, max_tokens=None))
    assert not is_plain(SamplingParams(temperature=0.5, max_tokens=None, **change))
