"""A tiny random Llama (two layers) for the kernel and backend tests, and the prompts they run."""
from __future__ import annotations

import pytest
import torch

from support.hf_dirs import write_hf_dir

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PREFIX = list(range(500, 524))  # three blocks of 8, shared by two prompts
PROMPTS = [PREFIX + list(range(100, 117)), list(range(300, 305)), PREFIX + list(range(1000, 1050))]


def tiny_llama_model():
    """The model itself, seeded (bench/gpu/gpu_fixtures.py builds the same one with another tokenizer)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, gguf_path):
    model = tiny_llama_model()
    path = tmp_path_factory.mktemp("tiny-llama")
    write_hf_dir(model, path, gguf_path, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    return str(path)
