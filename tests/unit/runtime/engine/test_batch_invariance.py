"""The same request gets the same answer, whatever else the engine is doing (issue 49, section 2).

On the bundled model in its default precision (int4 weights, float16 KV cache, the fused C step for
decode and prompt rows alike, one int8 activation pass per block), again with two passes
(KAON_CPU_ACTIVATIONS=int8x2, opt-in), and with its int4 weights in a bfloat16 model (--dtype bfloat16
--quantization int4: bfloat16 norms, embedding rows and KV cache, the same C step; float16 and int8
on the tiny model: test_quant.py), greedy: each prompt answered alone is the reference, and the same prompts answered
  - in one batch with prompts of other lengths (batch neighbours),
  - in prefill chunks of 16 tokens (chunked prefill),
  - a second time, their prefix blocks already cached (prefix-cache hits),
  - as the second turn of a conversation whose first turn is cached,
must give the same tokens and the same log-probabilities, bit for bit. Each row of a step goes
through kernels whose result for a row does not depend on the other rows (models/cpu_decode_step.py).
"""
from __future__ import annotations

import pytest

from kaon_runtime import LLM, SamplingParams
from support import MODEL
from support.prompts import QUESTIONS

pytestmark = pytest.mark.slow

DOCUMENT = ("The harbour office opens at seven. Ferries to the north island leave every ninety minutes, "
            "the last one at nine in the evening; tickets bought on board cost a third more. Bicycles "
            "travel free on weekdays. In storms above force eight every crossing is cancelled and "
            "refunds are paid at the kiosk by the car park. ")
MAX_TOKENS = 12


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=0)


def _answer(output) -> tuple[list[int], list[float]]:
    """The tokens and each token's own log-probability."""
    completion = output.outputs[0]
    return completion.token_ids, [step[token] for token, step in zip(completion.token_ids, completion.logprobs)]


def _prompts(llm: LLM) -> list[list[int]]:
    """Prompts of different lengths, the longer ones a shared document and a question."""
    short = [llm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS[:3]]
    documents = [llm.encode_chat([{"role": "system", "content": DOCUMENT * n}, {"role": "user", "content": q}])
                 for n, q in ((1, "When does the last ferry leave?"), (2, "Do bicycles cost extra?"))]
    return short + documents


def _alone(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [_answer(llm.generate([p], _greedy(), use_tqdm=False)[0]) for p in prompts]


def _together(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    return [_answer(o) for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


# name: (KAON_CPU_ACTIVATIONS or None for the default, the engine's dtype and quantization options)
SETTINGS = {"default": (None, {}), "int8x2": ("int8x2", {}),
            "bfloat16-int4": (None, {"dtype": "bfloat16", "quantization": "int4"})}


@pytest.fixture(scope="module", params=list(SETTINGS))
def engines(request):
    """(no prefix cache, whole prompts in one step), (prefix cache, prefill chunks of 16 tokens)."""
    # Nothing set but the activation passes (models/cpu_decode_step.prefills_take_the_c_step then sends
    # the prompt rows through the C step itself): a change of that policy that loses invariance fails here.
    with pytest.MonkeyPatch.context() as env:
        for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
            env.delenv(name, raising=False)
        activations, options = SETTINGS[request.param]
        if activations is not None:
            env.setenv("KAON_CPU_ACTIVATIONS", activations)
        plain = LLM(MODEL, show_progress=False, device="cpu", enable_prefix_caching=False, **options)
        chunked = LLM(MODEL, show_progress=False, device="cpu", enable_prefix_caching=True,
                      max_num_batched_tokens=16, **options)
    yield plain, chunked
    for llm in (plain, chunked):
        close = getattr(llm, "close", None)
        if close:
            close()


def _assert_same(got, expected, how: str) -> None:
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g[0] == e[0], f"prompt {i} {how}: tokens {g[0]} != alone {e[0]}"
        assert g[1] == e[1], f"prompt {i} {how}: log-probabilities differ from alone's\n{g[1]}\n{e[1]}"


def test_an_answer_does_not_depend_on_batch_chunking_or_cache(engines):
    plain, chunked = engines
    prompts = _prompts(plain)
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 100
    reference = _alone(plain, prompts)
    _assert_same(_together(plain, prompts), reference, "in a batch")
    _assert_same(_together(chunked, prompts), reference, "in chunks of 16, batched")
    _assert_same(_alone(chunked, prompts), reference, "with its prefix cached")


def test_a_follow_up_answers_the_same_with_its_first_turn_cached(engines):
    plain, chunked = engines
    first = [{"role": "system", "content": DOCUMENT * 2}, {"role": "user", "content": "Summarise the rules."}]
    tokens, _ = _answer(chunked.generate([chunked.encode_chat(first)], _greedy(), use_tqdm=False)[0])
    follow_up = chunked.encode_chat([*first, {"role": "assistant", "content": chunked.tokenizer.decode(tokens)},
                                     {"role": "user", "content": "And when are crossings cancelled?"}])
    cached = _answer(chunked.generate([follow_up], _greedy(), use_tqdm=False)[0])
    fresh = _alone(plain, [follow_up])[0]
    _assert_same([cached], [fresh], "after its first turn")
