"""random://<shape>: seeded random weights in a known model's shape, the same for kaon and HF transformers."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import ModelNotFoundError
from kaon_runtime.loader import open_checkpoint
from kaon_runtime.loader.hf_dir import model_config_from_hf
from kaon_runtime.loader.random_weights import RANDOM_MODELS, hf_config, tensor_shapes

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(RANDOM_MODELS))
def test_every_shape_names_the_tensors_hf_builds(name):
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(name)))
    expected = {n: tuple(p.shape) for n, p in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert tensor_shapes(model_config_from_hf(hf_config(name))) == expected


@pytest.fixture(scope="module")
def weights():
    return dict(open_checkpoint("random://smollm2-135m").weights())


def test_weights_are_the_same_on_every_pass(weights):
    first = weights
    again = dict(open_checkpoint("random://smollm2-135m").weights())
    assert first.keys() == again.keys() and all(torch.equal(first[n], again[n]) for n in first)
    q = first["model.layers.0.self_attn.q_proj.weight"]
    assert 0.019 < q.std().item() < 0.021 and torch.equal(first["model.norm.weight"], torch.ones(576))
    assert not torch.equal(q, first["model.layers.1.self_attn.q_proj.weight"])  # a seed per tensor


@pytest.mark.slow
def test_greedy_tokens_match_hf_on_the_same_random_weights(weights):
    llm = LLM("random://smollm2-135m", show_progress=False, device="cpu", dtype="float32")
    prompts = [list(range(1, 9)), list(range(100, 140))]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config("smollm2-135m"))).eval()
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embedding
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_an_unknown_shape_is_refused_with_the_known_ones():
    with pytest.raises(ModelNotFoundError, match=r"llama-3\.1-8b"):
        open_checkpoint("random://gpt-5")


def test_the_byte_tokenizer_round_trips_any_text_and_skips_ids_past_a_byte():
    tokenizer = open_checkpoint("random://llama-3.1-8b").tokenizer  # builds no weights
    text = "Grüße, 世界! \n\t<|im_end|>"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode()) and max(ids) < 256
    assert tokenizer.decode(ids) == text and tokenizer.decode(ids + [128000, 5000]) == text
    assert tokenizer.eos_token_ids == [128001] and tokenizer.chat_template is None
