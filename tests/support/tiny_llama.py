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


def spread_copy(path: str, out) -> str:
    """The model at `path` with its weights spread (normal(0, 0.2), norms 1 +- 0.3), saved to `out` with
    its tokenizer: random init's logits are all near zero, every step a tie, which says nothing in bf16.
    Spread, most steps are far from one, so the bf16 GPU tests can run without the bundled model,
    which does not travel to a lent GPU (bench/gpu/gpu_fixtures.py). Ties still happen (49,152
    candidates): the tests allow a different token where the reference's top two are within a bf16
    rounding (first_difference_at_a_near_tie)."""
    import shutil

    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    shutil.copytree(path, out)
    model.save_pretrained(out)
    return str(out)


def first_difference_at_a_near_tie(reference, tokens: list[list[int]], near_tie: float) -> None:
    """Each run's tokens equal the reference run's (generated with logprobs >= 2), or first differ at a
    step where the reference's top two were within `near_tie`: from there the runs follow other tokens."""
    for ref, ours in zip(reference, tokens):
        expected = list(ref.outputs[0].token_ids)
        at = next((i for i, (a, b) in enumerate(zip(expected, ours)) if a != b), None)
        if at is None:
            assert len(ours) == len(expected)
            continue
        top = sorted(ref.outputs[0].logprobs[at].values(), reverse=True)
        assert top[0] - top[1] <= near_tie, (f"step {at}: {ours[at]} instead of {expected[at]}, whose margin "
                                             f"{top[0] - top[1]:.3f} is no tie")
