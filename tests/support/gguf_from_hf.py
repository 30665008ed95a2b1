"""A tiny transformers model written as a GGUF file the way llama.cpp's convert_hf_to_gguf writes its
family (tensor names, Llama's Q/K row permutation, Gemma 2's norms with +1 folded in, Phi-3's fused
tensors, experts stacked in 3-D), its linear weights and experts quantized by the gguf package; and
the same model with those weights replaced by their dequantized values, the float reference.
The tokenizer is the bundled GGUF's."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from support.gguf_files import tokenizer_fields

# HF model_type -> GGUF general.architecture (Mixtral is llama with experts, as llama.cpp writes it)
GGUF_ARCH = {"llama": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "gemma2": "gemma2", "phi3": "phi3",
             "qwen3": "qwen3"}
_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_GEMMA2_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
# the transformer's parameters that GGUF stores quantized: every projection and expert, not norms,
# embeddings or the router (llama.cpp keeps ffn_gate_inp in float)
QUANTIZED = ("_proj.weight", "experts.gate_up_proj", "experts.down_proj")


def round_trip(weight: torch.Tensor, type_name: str) -> torch.Tensor:
    """gguf's quantization of `weight` (rows of blocks along its last axis), dequantized."""
    import gguf
    qtype = gguf.GGMLQuantizationType[type_name]
    data = gguf.quants.quantize(weight.detach().float().numpy(), qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, qtype))).reshape(weight.shape).to(weight.dtype)


def dequantized_reference(model, type_name: str):
    """`model` with each weight GGUF stores quantized replaced by its dequantized value, in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(QUANTIZED):
                p.copy_(round_trip(p, type_name))
    return model


def write_gguf_from_hf(model, path: Path, source: Path, type_name: str) -> Path:
    import gguf

    c = model.config
    kind = c.model_type
    arch = GGUF_ARCH[kind]
    heads, kv_heads, hidden = c.num_attention_heads, c.num_key_value_heads, c.hidden_size
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if type_name == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    rotary = int(head_dim * (getattr(c, "partial_rotary_factor", None) or 1.0))
    writer.add_rope_dimension_count(rotary)
    if kind in ("mixtral", "qwen3_moe"):
        writer.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    if kind == "qwen3_moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    if kind == "gemma2":
        writer.add_sliding_window(c.sliding_window)
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    if kind == "phi3":
        original = c.original_max_position_embeddings
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original  # LongRoPE's attention factor, as llama.cpp's converter writes it
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        if c.sliding_window:
            writer.add_sliding_window(c.sliding_window)
    for key, contents, value_type, sub in tokenizer_fields(Path(source)):  # read once per process
        writer.add_key_value(key, contents, value_type, sub)

    def add(name: str, tensor: torch.Tensor, quantize: bool) -> None:
        array = tensor.detach().float().numpy()
        if quantize and type_name != "F32":
            qtype = gguf.GGMLQuantizationType[type_name]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)

    rope = c.rope_parameters if getattr(c, "rope_parameters", None) else None
    if kind == "phi3" and rope and rope.get("rope_type") == "longrope":
        add("rope_factors_long.weight", torch.tensor(rope["long_factor"]), False)
        add("rope_factors_short.weight", torch.tensor(rope["short_factor"]), False)
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if not name.startswith("model.layers."):
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], _gemma_norm(kind, name, p), False)
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        if rest.startswith("mlp.experts."):
            if rest.endswith("gate_up_proj"):
                gate, up = p.chunk(2, dim=1)
                add(f"blk.{layer}.ffn_gate_exps.weight", gate, True)
                add(f"blk.{layer}.ffn_up_exps.weight", up, True)
            else:
                add(f"blk.{layer}.ffn_down_exps.weight", p, True)
            continue
        module, _, suffix = rest.rpartition(".")
        gguf_part = (_GEMMA2_NAMES.get(module) if kind == "gemma2" else None) or _NAMES[module]
        if arch == "llama" and gguf_part in ("attn_q", "attn_k"):
            p = _permute(p, heads if gguf_part == "attn_q" else kv_heads)
        add(f"blk.{layer}.{gguf_part}.{suffix}", _gemma_norm(kind, name, p), name.endswith(QUANTIZED))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _gemma_norm(kind: str, name: str, p: torch.Tensor) -> torch.Tensor:
    return p + 1 if kind == "gemma2" and name.endswith("norm.weight") else p


def _permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's two rotary halves interleaved."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))
