"""HF-format directories (config.json + safetensors + tokenizer.json) for each supported family.

Tiny randomly initialised models, written by transformers' own save_pretrained, so the test
covers what real checkpoints look like: Llama 3 rope scaling with an untied head, Qwen2 with
q/k/v biases and tied embeddings. Both engines run in float64 so ties cannot flip argmax.
"""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from support.hf_dirs import write_hf_dir

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)

pytestmark = pytest.mark.slow  # transformers' models loaded and compared (make unit leaves it out)

FAMILIES = {
    "llama3": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
               dict(tie_word_embeddings=False, rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory, gguf_path):
    config_cls, model_cls, extra = FAMILIES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**SMALL, **extra)).eval()
    path = tmp_path_factory.mktemp(request.param)
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, chat_template=True)
    return path, model.to(torch.float64)


def test_hf_directory_matches_transformers(model_dir):
    path, hf = model_dir
    llm = LLM(str(path), show_progress=False, device="cpu", dtype="float64")
    assert llm.engine.model_config.architecture in ("llama", "qwen2")
    prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in ("Hello there", "What is 2+2?")]
    prompts.append(list(range(100, 400)))  # long enough for the scaled rope frequencies to matter
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=2)
        assert output.outputs[0].token_ids == expected[0, len(prompt):].tolist()


def test_hf_directory_tokenizer_and_template(model_dir):
    path, _ = model_dir
    llm = LLM(str(path), show_progress=False, device="cpu")
    assert llm.tokenizer.eos_token_ids == [2]
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
