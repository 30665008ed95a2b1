"""vLLM's SamplingParams output fields through kaon_runtime.LLM and the async engine's stream:
detokenize, output_kind (RequestOutputKind), logits_processors (refused, as vLLM's V1 engine does)."""
from __future__ import annotations

import asyncio

import pytest

from kaon_runtime import SamplingParams
from kaon_runtime.sampling import RequestOutputKind

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


def test_detokenize_false_gives_the_same_tokens_and_no_text(llm):
    text, ids = (llm.generate("The capital of France is", SamplingParams(**GREEDY, detokenize=d), use_tqdm=False)[0]
                 .outputs[0] for d in (True, False))
    assert text.text and ids.text == ""
    assert ids.token_ids == text.token_ids and len(ids.token_ids) == 8
    with pytest.raises(ValueError, match="stop strings are only supported when detokenize is True"):
        SamplingParams(detokenize=False, stop=["."])
    with pytest.raises(ValueError, match="detokenize must be True or False"):
        SamplingParams(detokenize="no")


def test_generate_returns_each_finished_output_whole_whatever_the_output_kind(llm):
    """As vLLM's LLM.generate (which sets FINAL_ONLY on every request): the finished output, whole."""
    outputs = [llm.generate("Once upon a time", SamplingParams(**GREEDY, output_kind=kind), use_tqdm=False)[0]
               for kind in RequestOutputKind]
    assert len({(o.outputs[0].text, tuple(o.outputs[0].token_ids)) for o in outputs}) == 1
    assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in outputs)


def _stream(llm, params: SamplingParams) -> list:
    from kaon_runtime.engine.async_engine import AsyncEngine

    front = AsyncEngine(llm.engine)

    async def run():
        front.start()
        try:
            stream = await front.add_request("kinds", "Once upon a time", params)
            return [output async for output in stream]
        finally:
            await front.stop()

    return asyncio.run(run())


def test_the_async_engines_stream_follows_the_output_kind(llm):
    whole = llm.generate("Once upon a time", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    final = _stream(llm, SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].text == whole.text
    deltas = _stream(llm, SamplingParams(**GREEDY, logprobs=1, output_kind=RequestOutputKind.DELTA))
    assert deltas[-1].finished
    assert "".join(d.outputs[0].text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.outputs[0].token_ids] == whole.token_ids
    assert sum(len(d.outputs[0].logprobs) for d in deltas) == len(whole.token_ids)
    # Every output of a cumulative stream ends with the whole text so far.
    cumulative = _stream(llm, SamplingParams(**GREEDY))
    assert cumulative[-1].outputs[0].text == whole.text


def test_a_delta_stream_never_hands_out_text_a_stop_string_later_cuts(llm):
    out = llm.generate("Once upon a time", SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    whole = out.text
    # A stop string across two tokens: its first character comes a step before the rest, and must wait.
    ends = [len(llm.get_tokenizer().decode(out.token_ids[:k])) for k in range(1, len(out.token_ids))]
    stop = next(whole[e - 1:e + 1] for e in ends[2:] if whole.find(whole[e - 1:e + 1]) == e - 1)
    params = dict(temperature=0, max_tokens=8, stop=[stop])
    cut = llm.generate("Once upon a time", SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    deltas = _stream(llm, SamplingParams(**params, output_kind=RequestOutputKind.DELTA))
    assert "".join(d.outputs[0].text for d in deltas) == cut == whole[:whole.index(stop)]


def test_logits_processors_and_unknown_output_kinds_are_refused_by_name():
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda token_ids, logits: logits])
    assert SamplingParams(logits_processors=[]).logits_processors == []  # none given: nothing to refuse
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind=3)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
