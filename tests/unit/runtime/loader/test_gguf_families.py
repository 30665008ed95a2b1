"""GGUF files of every family beyond Llama/Qwen, written the way llama.cpp's converter writes them
(support/gguf_from_hf.py): Gemma 2 (norms with +1 folded in, soft-caps and windows in metadata),
Phi-3 (fused q|k|v and gate|up, LongRoPE factor tensors, partial rotary), Mixtral (llama with 3-D
experts) and Qwen3-MoE. Q8_0 weights; kaon's greedy tokens in float32 equal transformers' on the
dequantized weights, and the file also loads kept quantized (the default on CPU, experts included) and decodes; against
llama.cpp on the same file, whose kernels quantize activations, the common prefix is printed."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.loader import open_checkpoint
from support.gguf_from_hf import dequantized_reference, write_gguf_from_hf

pytestmark = pytest.mark.slow  # whole models, and the bundled 49k-token tokenizer
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.5, 3.0, 7.0, 16.0]}
FAMILIES = {
    # llama.cpp scales Gemma 2's queries by the head size (hidden / heads for the 27B): so does this model
    "gemma2": ("Gemma2", dict(sliding_window=24, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    # Both prompts are longer than the pretraining length (32): HF and kaon use the long factors.
    "phi3": ("Phi3", dict(original_max_position_embeddings=32, partial_rotary_factor=0.5, sliding_window=24,
                          rope_parameters=LONGROPE, pad_token_id=0)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True)),
}
PROMPTS = [[1, *range(300, 340)], [1, 42, 4242, 9000, 12, 7, *range(1000, 1034)]]  # longer than the windows
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _hf_model(family: str):
    prefix, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**SMALL, **extra})
    config._attn_implementation = "eager"  # SDPA in HF ignores Gemma 2's soft-capping
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # weights spread so that greedy choices are far from ties; norms away from 1 (or 0)
        for _name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    return model


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _kaon_greedy(path, **options) -> list[list[int]]:
    llm = LLM(str(path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22, **options)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def _llama_cpp_greedy(path, prompt: list[int]) -> list[int] | None:
    llama_cpp = pytest.importorskip("llama_cpp")
    try:
        llm = llama_cpp.Llama(str(path), n_ctx=256, verbose=False)
    except Exception:  # noqa: BLE001  llama.cpp refusing the file is reported, not a failure of kaon's
        return None
    tokens = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        tokens.append(token)
        if len(tokens) == GREEDY.max_tokens:
            break
    return tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_gguf(request, tmp_path_factory, gguf_path):
    model = _hf_model(request.param)
    path = write_gguf_from_hf(model, tmp_path_factory.mktemp(request.param) / "model.gguf", gguf_path, "Q8_0")
    return request.param, path, dequantized_reference(model, "Q8_0")


def test_config_is_the_family_of_the_file(family_gguf):
    family, path, model = family_gguf
    checkpoint = open_checkpoint(str(path))
    config = checkpoint.config
    assert config.architecture == family
    assert config.num_experts == (getattr(model.config, "num_local_experts", None)
                                  or getattr(model.config, "num_experts", 0) or 0)
    # The experts' blocks are offered too, to be kept quantized (tests/unit/runtime/quant/test_quantized_experts.py)
    experts = {name for name, _, _ in checkpoint.quantized_blocks() if ".experts." in name}
    assert len(experts) == 2 * 3 * config.num_experts


def test_float32_greedy_tokens_equal_transformers_on_the_dequantized_weights(family_gguf):
    _family, path, model = family_gguf
    assert _kaon_greedy(path, dtype="float32") == [_hf_greedy(model, p) for p in PROMPTS]


def test_kept_quantized_decodes_and_agrees_with_llama_cpp(family_gguf):
    family, path, model = family_gguf
    ours = _kaon_greedy(path)  # the default on CPU: the file's own Q8_0 blocks
    reference = [_hf_greedy(model, p) for p in PROMPTS]
    assert all(len(tokens) == GREEDY.max_tokens for tokens in ours)
    for prompt, tokens, expected in zip(PROMPTS, ours, reference):
        theirs = _llama_cpp_greedy(path, prompt)
        print(f"{family}: kept-quantized common prefix with float {_prefix(tokens, expected)}/{len(tokens)}, "
              f"with llama.cpp {'(does not load the file)' if theirs is None else _prefix(tokens, theirs)}")


def _prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
