"""random://<shape>: a well-known model's shape with seeded random weights, for benchmarks.

Measuring speed needs the shape, not the trained values, and no model hub is reachable
from where benchmarks run. Each shape is the HF config.json of the model it copies, so
HF transformers can build the same model for comparison (`hf_config`). Weights are drawn
per tensor from a seed derived from the tensor's name: iterating `weights()` twice, or
from another process, gives the same values. The tokenizer has one token per byte
(Tokenizer.bytes_only): nothing to download, and nobody reads the text.
"""
from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelNotFoundError

RANDOM_SCHEME = "random://"
_INIT_STD = 0.02  # what HF initialises Llama linears and embeddings with

_LLAMA3 = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, num_attention_heads=32, num_key_value_heads=8,
               max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
               eos_token_id=128001)
RANDOM_MODELS: dict[str, dict] = {
    "llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, head_dim=128,
                         tie_word_embeddings=False,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    "llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                         tie_word_embeddings=True,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
    # The bundled model's shape: small enough for CPU tests of the random path itself.
    "smollm2-135m": dict(architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}


def hf_config(name: str) -> dict:
    """The config.json of a random:// shape, e.g. for transformers.LlamaConfig(**hf_config(name))."""
    if name not in RANDOM_MODELS:
        raise ModelNotFoundError(f"unknown random model {name!r}; available: {', '.join(RANDOM_MODELS)}")
    return dict(RANDOM_MODELS[name])


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of a Llama-family checkpoint with this config."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (c.hidden_size,),
                   p + "post_attention_layernorm.weight": (c.hidden_size,),
                   p + "self_attn.q_proj.weight": (q, c.hidden_size),
                   p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                   p + "self_attn.v_proj.weight": (kv, c.hidden_size),
                   p + "self_attn.o_proj.weight": (c.hidden_size, q),
                   p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                   p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                   p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)}
        if c.attention_bias:
            shapes |= {p + f"self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
    return shapes


def random_weights(config: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Seeded normal(0, 0.02) matrices, ones for norms, zeros for biases; drawn on the GPU when there is one
    (an 8B model's worth of normals takes a CPU tens of seconds)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name, shape in tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, device=device)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, device=device)
        else:
            generator = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
            yield name, torch.empty(shape, device=device).normal_(0.0, _INIT_STD, generator=generator)
