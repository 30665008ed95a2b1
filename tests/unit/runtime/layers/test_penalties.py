"""vLLM's logits adjustments (layers/penalties.py), batched, against a row-by-row reference in plain torch."""
from __future__ import annotations

import math

import pytest
import torch

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.layers.penalties import RowHistory, adjust_logits, row_history, token_counts
from kaon_runtime.layers.sample_step import RowsToSample, sample_rows
from kaon_runtime.sampling import SamplingParams

VOCAB = 40
EOS = [2]


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """One row, the textbook way: a Python loop over tokens."""
    row = logits.clone()
    if len(output) < params.min_tokens:
        for t in ([] if params.ignore_eos else EOS) + params.stop_token_ids:
            row[t] = float("-inf")
    for t, bias in params.logit_bias.items():
        row[t] += bias
    for t in set(prompt) | set(output) if params.repetition_penalty != 1.0 else ():
        row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
    for t in set(output):
        row[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if params.min_p > 0 and params.temperature > 0:
        probs = torch.softmax(row / params.temperature, dim=-1)
        row[probs < params.min_p * probs.max()] = float("-inf")
    return row


CASES = [
    SamplingParams(),  # untouched
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.7),
    SamplingParams(frequency_penalty=0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=0.2),
    SamplingParams(logit_bias={3: 100, 7: -100, 11: 2.5}),
    SamplingParams(min_p=0.1, temperature=0.7),
    SamplingParams(min_p=0.3, temperature=0),  # greedy: min_p changes nothing
    SamplingParams(min_tokens=5, stop_token_ids=[9]),
    SamplingParams(min_tokens=5, ignore_eos=True, logit_bias={2: 1.0}),
    SamplingParams(min_tokens=2, stop_token_ids=[9]),  # reached: nothing banned
]


def test_batched_adjustments_equal_the_reference_row_by_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=gen) * 3
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(1, 9, (len(CASES),))]
    outputs = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(0, 5, (len(CASES),))]
    outputs[-1] = [1, 1, 4]
    histories = [row_history(p, prompt + out, len(prompt), EOS) or RowHistory(p, out)
                 for p, prompt, out in zip(CASES, prompts, outputs)]
    got = adjust_logits(logits, histories)
    for i, p in enumerate(CASES):
        want = reference(logits[i], p, prompts[i], outputs[i])
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, p)
        finite = torch.isfinite(want)
        assert torch.allclose(got[i][finite], want[finite], atol=1e-5), (i, p)


def test_nothing_asked_returns_the_same_tensor():
    logits = torch.randn(3, VOCAB)
    assert adjust_logits(logits, [RowHistory(SamplingParams(), [1, 2])] * 3) is logits


def test_token_counts_is_one_scatter_of_padded_histories():
    counts = token_counts([[1, 1, 3], [], [0]], 5, "cpu")
    assert counts.tolist() == [[0, 2, 0, 1, 0], [0] * 5, [1, 0, 0, 0, 0]]


def test_sample_rows_applies_them_greedy_and_to_draft_rows():
    logits = torch.zeros(3, VOCAB)
    logits[:, 5] = 1.0
    banned = SamplingParams(temperature=0, logit_bias={5: -100}, max_tokens=None)
    plain = SamplingParams(temperature=0)
    rows = [RowsToSample(banned, None, history=RowHistory(banned, [])), RowsToSample(plain, None)]
    assert [t[0] for t in sample_rows(logits[:2], rows).token_ids] == [0, 5]
    # A sequence with one draft: its second row has seen the draft, and a presence penalty turns it away.
    penalised = SamplingParams(temperature=0, presence_penalty=2.0, max_tokens=None)
    draft_logits = torch.zeros(2, VOCAB)
    draft_logits[:, 5] = 1.0
    draft_logits[:, 6] = 0.5
    rows = [RowsToSample(penalised, None, draft_token_ids=[5], history=RowHistory(penalised, []))]
    assert sample_rows(draft_logits, rows).token_ids == [[5, 6]]


def test_min_p_keeps_the_head_at_the_rows_temperature():
    logits = torch.tensor([[0.0, -1.0, -3.0]])
    for temperature in (0.5, 1.0, 2.0):
        p = SamplingParams(min_p=0.2, temperature=temperature)
        kept = torch.isfinite(adjust_logits(logits, [RowHistory(p, [])])[0]).tolist()
        probs = torch.softmax(logits[0] / temperature, -1)
        assert kept == (probs >= 0.2 * probs.max()).tolist()
    assert math.isclose(SamplingParams(min_p=0.0).min_p, 0.0)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                                 dict(logit_bias={1: 101}), dict(logit_bias={-1: 1}), dict(min_p=1.5),
                                 dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10), dict(prompt_logprobs=21)])
def test_out_of_range_values_are_refused(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)
